"""A new environment is one package plus one registration line: a toy env written here, in tmp_path,
registered by an entry point (a ``*.dist-info`` directory on PYTHONPATH, no repo file edited), runs
one round of the real workflow (select → train_client → aggregate → merge → eval) with ``env.kind: toy``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from workflow_helpers import RUN, make_workdir, run_snakemake

pytestmark = [pytest.mark.workflow, pytest.mark.slow]

TOY_SPEC = '''
"""A toy environment: "say the word X"; the answer "say X" wins."""

import hashlib
import json
from pathlib import Path

from fedagent.core.atomic import atomic_dir
from fedagent.core.envs import EnvSpec
from fedagent.envs.base import ResetResult, StepResult

WORDS = ["apple", "river", "stone", "cloud", "amber", "maple"]


def task_ids(n_train, n_val):
    return [f"toy-train-{i}" for i in range(n_train)], [f"toy-val-{i}" for i in range(n_val)]


def word_of(task_id):
    return WORDS[int(task_id.rsplit("-", 1)[1]) % len(WORDS)]


class ToyEnv:
    def __init__(self, verb, max_turns):
        self.verb, self.max_turns = verb, max_turns

    def reset(self, task_id):
        self.word, self.turns = word_of(task_id), 0
        return ResetResult(f"Say the word {self.word}.", f"say the word {self.word}", self.admissible(), task_id, "toy")

    def admissible(self):
        return [f"{self.verb} {w}" for w in WORDS]

    def step(self, action):
        self.turns += 1
        won = action.strip() == f"{self.verb} {self.word}"
        done = won or self.turns >= self.max_turns
        return StepResult("You win." if won else "Nothing happens.", 10.0 if won else 0.0, done, won,
                          self.admissible(), 1.0 if won else 0.0)

    def close(self):
        pass


class ToySource:
    prompt_template = "toy"

    def __init__(self, games):
        self.index = json.loads((Path(games) / "games.json").read_text())

    def task_ids(self, split):
        return list(self.index[split])

    def task_type(self, task_id):
        return "toy"

    def make_env(self, max_turns, **_):
        return ToyEnv(self.index["verb"], max_turns)


class ToyPrompt:
    fallback_chars = 30

    def windowed(self, task, observation, admissible, history, history_length, answer_format):
        return f"Task: {task}\\nObservation: {observation}\\nActions: {', '.join(admissible)}\\n<action>"

    def concat_turn(self, observation, admissible, step, answer_format):
        return f"Step {step}: {observation}\\nActions: {', '.join(admissible)}"


TEMPLATE = ToyPrompt()


def open_source(games, split, *, tasks=None, env_params=None, client_id=None):
    return ToySource(games), split


def add_args(parser):
    for flag in ("--out", "--quarantine", "--verb"):
        parser.add_argument(flag)
    for flag in ("--seed", "--n-train", "--n-val"):
        parser.add_argument(flag, type=int)


def run(args):
    train, val = task_ids(args.n_train, args.n_val)
    with atomic_dir(Path(args.out), Path(args.quarantine) if args.quarantine else None) as staging:
        sha = hashlib.sha256(json.dumps([train, val]).encode()).hexdigest()
        index = {"kind": "toy", "verb": args.verb, "train": train, "val": val, "sha256": sha}
        (staging / "games.json").write_text(json.dumps(index, sort_keys=True))
    return 0


SPEC = EnvSpec(
    kind="toy",
    source="toyenv.spec:open_source",
    catalogue="toyenv.spec",
    catalogue_args=lambda c: (
        f"toy-games --seed {c['data_seed']} --n-train {c['env']['train_games']} --n-val {c['env']['val_games']}"
        f" --verb {c['env']['toy']['verb']}"
    ),
    catalogue_keys=lambda env: {k: env[k] for k in ("train_games", "val_games", "toy")},
    prompt_templates={"toy": "toyenv.spec:TEMPLATE"},
    schema={"toy": {"type": "object", "additionalProperties": False, "default": {},
                    "properties": {"verb": {"type": "string", "default": "say"}}}},
)
'''


def write_toy_env(site: Path) -> None:
    """The toy package and its one registration line (an entry point in a dist-info directory)."""
    (site / "toyenv").mkdir(parents=True)
    (site / "toyenv" / "__init__.py").write_text("")
    (site / "toyenv" / "spec.py").write_text(textwrap.dedent(TOY_SPEC))
    dist = site / "toyenv-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toyenv\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[fedagent.envs]\ntoy = toyenv.spec:SPEC\n")


@pytest.fixture
def toy_site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    write_toy_env(site)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    return site


def test_unknown_kind_is_one_config_error_naming_the_known_kinds(tmp_path, toy_site):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("env: {kind: nosuch}\n")
    exe = Path(sys.executable).parent / "fedagent"
    proc = subprocess.run([str(exe), "check-config", str(cfg)], capture_output=True, text=True, env=dict(os.environ))
    assert proc.returncode == 2
    assert "config key 'env.kind'" in proc.stderr and "'toy'" in proc.stderr and "'webshop'" in proc.stderr


def test_a_toy_env_from_an_entry_point_runs_one_round(tmp_path, toy_site):
    work = make_workdir(tmp_path / "w")
    (work / "toy.yaml").write_text("rounds: 1\nenv: {kind: toy, train_games: 4, val_games: 2, toy: {verb: say}}\n")
    proc = run_snakemake(work, "--configfile", "toy.yaml")
    out = proc.stdout + proc.stderr
    for rule in ("games", "select", "train_client", "aggregate", "merge", "eval"):
        assert f"rule {rule}:" in out, rule
    run = work / RUN
    games = json.loads((run / "plan/games/games.json").read_text())
    assert games["kind"] == "toy" and games["train"] == [f"toy-train-{i}" for i in range(4)]
    ev = json.loads((run / "round_001/eval.json").read_text())
    assert ev["n"] == 2
    assert set(json.loads((run / "plan/val_set.json").read_text())["tasks"]) == {"toy-val-0", "toy-val-1"}
    assert "toy-val-0" in json.dumps(ev)
