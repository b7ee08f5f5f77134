"""Eval: fixed seeds and generator every round, eval.json schema, Wilson interval, CLI."""

from __future__ import annotations

import argparse
import contextlib
import json

import pytest

from fake_env import Pending, FakeEnv, build_tiny_model
from fedagent.evaluate import validation as ev
from fedagent.model.policy import load_policy


def test_wilson_interval_known_values():
    lo, hi = ev.wilson_interval(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    assert ev.wilson_interval(0, 10)[0] == 0.0 and ev.wilson_interval(10, 10)[1] == pytest.approx(1.0)
    assert ev.wilson_interval(0, 0) == [0.0, 1.0]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=5)


PARAMS = {"base_seed": 9, "max_turns": 2, "max_new_tokens": 6, "max_prompt_tokens": 256, "pool_size": 4, "batch": 4}


def test_same_seeds_and_samples_every_round(tiny_dir):
    model, tok = load_policy(tiny_dir, threads=1)
    p = ev.EvalParams.from_dict(PARAMS)
    assert p.temperature == 0.4
    results, envs = [], []
    for r in (0, 3):
        env = FakeEnv(mode="index", max_turns=2)
        results.append(ev.evaluate(model, tok, env, list(range(6)), p, round=r))
        envs.append(env)
    for env in envs:
        assert [e[2] for e in env.log if e[0] == "reset"] == list(range(6))
        assert env.sessions == {}
    a, b = results
    assert a["round"] == 0 and b["round"] == 3
    assert a["samples"] == b["samples"]  # same model + same generator → same episodes
    assert [s["task_id"] for s in a["samples"]] == [f"fake-{i:03d}" for i in range(6)]


def test_summary_schema_with_wins(tiny_dir):
    model, tok = load_policy(tiny_dir, threads=1)
    env = FakeEnv(mode="index", max_turns=2, win_if=lambda text: True)
    out = ev.evaluate(model, tok, env, list(range(5)), ev.EvalParams.from_dict(PARAMS), round=1)
    assert out["n"] == 5 and out["success_rate"] == 1.0 and out["score_mean"] == 1.0
    assert out["return_mean"] == 10.0
    assert out["ci95"] == pytest.approx(ev.wilson_interval(5, 5))
    assert out["per_task_type"] == {"even": {"n": 3, "success_rate": 1.0}, "odd": {"n": 2, "success_rate": 1.0}}
    s = out["samples"][0]
    assert set(s) >= {"task_id", "won", "score", "n_turns", "actions"} and s["n_turns"] == 1


def test_eval_cli_writes_eval_json(tiny_dir, tmp_path, monkeypatch):
    seen = {}

    @contextlib.contextmanager
    def fake_service(
        games_dir,
        split,
        task_ids,
        workdir,
        *,
        mode,
        pool_size,
        max_turns,
        client_id=None,
        answer_format="think_action",
        source="textworld",
        env_params=None,
        env_procs=0,
        wait=True,
        projection="unset",
    ):
        seen.update(
            env_procs=env_procs,
            split=split,
            tasks=list(task_ids),
            mode=mode,
            source=source,
            env_params=env_params,
            projection=projection,
        )
        env = FakeEnv(list(task_ids), mode=mode, max_turns=max_turns)
        yield env if wait else Pending(env)

    monkeypatch.setattr("fedagent.envs.lifecycle.env_service", fake_service)
    vs = tmp_path / "val_set.json"
    vs.write_text(json.dumps({"tasks": ["fake-004", "fake-001", "fake-002"], "seeds": [0, 1, 2, 3]}))
    (tmp_path / "games.json").write_text(json.dumps({"train": ["fake-000"], "val": ["fake-004"]}))
    parser = argparse.ArgumentParser()
    ev.add_args(parser)
    out = tmp_path / "round_000" / "eval.json"
    args = parser.parse_args(
        [
            "--model",
            str(tiny_dir),
            "--games",
            str(tmp_path),
            "--val-set",
            str(vs),
            "--params",
            json.dumps({**PARAMS, "env_procs": 2}),
            "--round",
            "0",
            "--threads",
            "1",
            "--out",
            str(out),
        ]
    )
    assert ev.run(args) == 0
    res = json.loads(out.read_text())
    assert seen == {
        "split": "val",
        "tasks": ["fake-004", "fake-001", "fake-002"],
        "mode": "index",
        "source": "textworld",
        "env_params": None,
        "env_procs": 2,  # validation: never an env arm
        "projection": "reference",
    }  # rollout.projection reaches the eval's service
    assert res["n"] == 4 and [s["task_id"] for s in res["samples"]] == ["fake-004", "fake-001", "fake-002", "fake-004"]
    for key in ("round", "success_rate", "score_mean", "return_mean", "ci95", "per_task_type", "samples"):
        assert key in res
    assert not any(p.name.startswith(".env-") for p in out.parent.iterdir())
