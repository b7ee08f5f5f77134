"""The expert warm start (issue 27): experts, the demo pool, the demonstrations' format, the job.

- each env's expert plays its tasks (WebShop's oracle on the synthetic catalogue wins them all);
- the demo pool never overlaps a client's shard or the validation set (``partition --exclude``);
- a demonstration's turns are the rollout's prompt + the expert's answer in the answer format,
  ending with the chat turn's end, and the env parses it as a valid turn;
- the job trains the base model on them (loss falls) and writes an atomic model dir;
- through Snakemake: a warm-started run's round 0 model differs from the base model, round 0 has
  the base's eval beside the warm start's, and a second invocation runs nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from fedagent.envs.service import build_app
from fedagent.envs.webshop.build import build_catalog
from fedagent.envs.webshop.source import WebShopTaskSource
from fedagent.plan.demo_pool import draw_demo_pool

REPO = Path(__file__).resolve().parent.parent
N_PRODUCTS, VAL = 120, 40


@pytest.fixture(scope="module")
def ws_games(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ws") / "games"
    build_catalog(out, data_seed=42, n_products=N_PRODUCTS, val_goals=VAL)
    return out


def _fedagent(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedagent.cli", *args], capture_output=True, text=True, timeout=600, env=env
    )


def test_webshop_oracle_wins_every_goal_it_plays(ws_games):
    src = WebShopTaskSource(ws_games)
    env = src.make_env(15, policy_commands=True)
    train = json.loads((ws_games / "games.json").read_text())["train"][:40]
    for tid in train:
        env.reset(tid)
        for _ in range(15):
            r = env.step(env.expert_action())
            if r.done:
                break
        assert r.won and r.score == 1.0, tid
        assert env.expert_action() is None  # nothing left to do once bought


def test_demo_pool_is_seeded_and_refuses_the_whole_catalogue():
    tasks = [f"t{i}" for i in range(20)]
    a = draw_demo_pool(tasks, 5, 42)
    assert a == draw_demo_pool(tasks, 5, 42) and len(set(a)) == 5 and set(a) <= set(tasks)
    assert a == [t for t in tasks if t in a]  # catalogue order
    assert a != draw_demo_pool(tasks, 5, 43)
    with pytest.raises(ValueError, match="warm_start.demos"):
        draw_demo_pool(tasks, 20, 42)


@pytest.mark.parametrize("strategy", ["uniform", "task_disjoint"])
def test_demo_pool_never_overlaps_a_shard_or_the_validation_set(ws_games, tmp_path, strategy):
    pool, part = tmp_path / "demo_pool.json", tmp_path / "partition.json"
    r = _fedagent("demo-pool", "--games", str(ws_games), "--n", "16", "--seed", "42", "--out", str(pool))
    assert r.returncode == 0, r.stderr
    r = _fedagent(
        "partition",
        "--games",
        str(ws_games),
        "--clients",
        "4",
        "--strategy",
        strategy,
        "--seed",
        "42",
        "--exclude",
        str(pool),
        "--out",
        str(part),
    )
    assert r.returncode == 0, r.stderr
    demos = set(json.loads(pool.read_text())["tasks"])
    index = json.loads((ws_games / "games.json").read_text())
    shards = json.loads(part.read_text())["clients"]
    assert len(demos) == 16 and demos <= set(index["train"])
    for c, shard in shards.items():
        assert not demos & set(shard), f"client {c} owns demo tasks {sorted(demos & set(shard))[:3]}"
    assert not demos & set(index["val"])
    # the rest of the catalogue is still served (uniform covers it)
    if strategy == "uniform":
        assert set().union(*map(set, shards.values())) == set(index["train"]) - demos
    assert json.loads(part.read_text())["excluded"] == sorted(demos)


def test_demonstration_turns_are_the_rollout_format(ws_games, tmp_path):
    """The expert's turns through a real (spawned) service + the episode loop: valid answers, the
    rollout's prompt, the answer's tokens ending with <|im_end|>, and the episode won."""
    from fedagent.envs.lifecycle import env_service
    from fedagent.rollout.episode import run_episodes
    from fedagent.rollout.expert import answer_text

    tok = _tiny_tokenizer()
    src = WebShopTaskSource(ws_games)
    train = json.loads((ws_games / "games.json").read_text())["train"][:4]
    with env_service(
        ws_games,
        "train",
        train,
        tmp_path / "svc",
        mode="index",
        pool_size=4,
        max_turns=8,
        source="webshop",
        expert=True,
    ) as env:
        trajs = run_episodes(
            None,
            tok,
            env,
            [0, 1, 2, 3],
            max_turns=8,
            max_new_tokens=0,
            temperature=1.0,
            generator=None,
            session_prefix="d",
            max_prompt_tokens=4096,
            expert=True,
        )
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for t in trajs:
        assert t.won, t.summary()
        for turn in t.turns:
            assert turn.valid
            assert turn.response_ids[-1] == end
            assert tok.decode(turn.response_ids[:-1]) == answer_text(turn.action, "think_action")
            assert tok.decode(turn.prompt_ids).endswith("<think>")
    # a service without its expert has no /expert_batch
    with TestClient(build_app(src, "train", train, mode="index", pool_size=1, max_turns=8)) as http:
        assert http.post("/expert_batch", json={"items": [{"session_id": "x"}]}).status_code == 404


def _tiny_tokenizer():
    from fedagent.model.base_model_tiny import build_tokenizer

    return build_tokenizer()


def test_warm_start_job_trains_on_the_demos_and_writes_round_0(ws_games, tiny_model, tmp_path):
    """The job end to end on CPU (tiny model, WebShop): the loss falls over the epochs, the model
    changes, the output is a verified model dir; the same inputs give the same bytes."""
    from fedagent.core.atomic import verify_manifest

    base = tiny_model(3)  # `fedagent tiny-model --seed 3`'s model, made in this process (read only here)
    pool = tmp_path / "demo_pool.json"
    assert (
        _fedagent("demo-pool", "--games", str(ws_games), "--n", "6", "--seed", "42", "--out", str(pool)).returncode == 0
    )
    params = json.dumps(
        {
            "base_seed": 7,
            "epochs": 2,  # the loss already falls from the first epoch to the second
            "lr": 3e-3,
            "mini_batch_size": 8,
            "micro_batch_size": 8,
            "only_won": True,
            "max_turns": 8,
            "max_prompt_tokens": 1024,
            "pool_size": 3,
        }
    )
    # The second job as a GPU rule's job is started, on a card given by hand (it still trains on the CPU):
    # it records the card it was placed on, and the placement changes no byte of the model.
    placed_env = {
        **{k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"},  # the suite's '' means no card
        "FEDAGENT_GPUS": "0:10000",
        "FEDAGENT_GPU_RESERVE_MIB": "0",
        "FEDAGENT_GPU_LEDGER": str(tmp_path / "ledger"),
        "FEDAGENT_JOB_GPUS": "1",
        "FEDAGENT_JOB_GPU_MEM_MB": "1234",
    }
    outs = []
    for k in range(2):
        out = tmp_path / f"warm{k}"
        r = _fedagent(
            "warm-start",
            "--model",
            str(base),
            "--games",
            str(ws_games),
            "--demo-pool",
            str(pool),
            "--params",
            params,
            "--threads",
            "1",
            "--out",
            str(out),
            env=placed_env if k == 1 else None,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        verify_manifest(out, check_hashes=True)
        outs.append(out)
    m = json.loads((outs[0] / "metrics.json").read_text())
    assert m["demos"] == 6 and m["demos_won"] == 6 and m["num_samples"] >= 6 * 3
    assert m["loss_last_epoch"] < m["loss_first_epoch"]
    digest = lambda d: hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert digest(outs[0]) != digest(base)
    assert digest(outs[0]) == digest(outs[1])
    assert json.loads((outs[0] / "provenance.json").read_text())["job"] == "warm_start"
    assert "gpu_placed" not in m
    assert json.loads((outs[1] / "metrics.json").read_text())["gpu_placed"] == {"cards": ["0"], "mib": 1234}


def test_warm_start_params_are_checked_like_the_plan():
    from fedagent.core.config import ConfigError
    from fedagent.train.warm_start import WarmStartParams

    with pytest.raises(ConfigError, match="warm_start.lr"):
        WarmStartParams.from_dict({"lr": 0.0})
    with pytest.raises(ValueError, match="unknown warm_start params"):
        WarmStartParams.from_dict({"demos_per_task": 2})


@pytest.mark.workflow
@pytest.mark.slow
def test_warm_started_run_through_snakemake(tmp_path):
    from workflow_helpers import RUN, executed_jobs, make_workdir, run_snakemake

    work = make_workdir(tmp_path / "w")
    cfg = yaml.safe_load((work / "config" / "config.yaml").read_text())
    cfg.update(rounds=1)
    cfg["env"].update(train_games=3)
    cfg["train"].update(max_turns=4)
    cfg["eval"].update(max_turns=4)
    cfg["warm_start"] = {"enabled": True, "demos": 1, "epochs": 1, "lr": 1e-3, "mini_batch_size": 4, "only_won": False}
    (work / "config" / "config.yaml").write_text(yaml.safe_dump(cfg))
    first = run_snakemake(work)
    jobs = {rule for rule, _ in executed_jobs(first)}
    assert {"demo_pool", "warm_start", "eval_base", "base_model", "partition"} <= jobs
    run = work / RUN
    digest = lambda d: hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert digest(run / "round_000" / "model") != digest(run / "round_000" / "base")
    assert json.loads((run / "round_000" / "eval.json").read_text())["label"] == "warm_start"
    assert json.loads((run / "round_000" / "base_eval.json").read_text())["label"] == "base"
    demos = set(json.loads((run / "plan" / "demo_pool.json").read_text())["tasks"])
    for shard in json.loads((run / "plan" / "partition.json").read_text())["clients"].values():
        assert not demos & set(shard)
    summary = (run / "summary.csv").read_text().splitlines()
    assert summary[1].startswith("0,base,") and summary[2].startswith("0,warm_start,") and summary[3].startswith("1,")
    again = run_snakemake(work)
    assert executed_jobs(again) == [], again.stdout[-2000:]


def test_textworld_walkthrough_expert_wins(tmp_path):
    """TextWorld's expert (policy_commands from every state) wins generated games."""
    from fedagent.envs.textworld.games import TextWorldTaskSource

    games = tmp_path / "games"
    r = _fedagent(
        "games",
        "--n-train",
        "2",
        "--n-val",
        "1",
        "--world-size",
        "1",
        "--nb-objects",
        "2",
        "--quest-length",
        "2",
        "--out",
        str(games),
        "--seed",
        "5",
        "--jobs",
        "1",
    )
    assert r.returncode == 0, r.stderr
    src = TextWorldTaskSource(games)
    env = src.make_env(10, policy_commands=True)
    try:
        for tid in src.task_ids("train"):
            env.reset(tid)
            for _ in range(10):
                r = env.step(env.expert_action())
                if r.done:
                    break
            assert r.won, tid
            assert env.expert_action() is None
    finally:
        env.close()
