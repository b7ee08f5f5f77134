"""The verl agent loop with a fake generation server and the in-process fake env.

Per turn: the exact windowed prompt the local backend would build, the answer's tokens as
the response with mask 1, reward = episode return minus the invalid penalty on that turn
only (and kept through verl's copy of the last reward onto earlier turns), task ids, the
session closed. Needs verl importable (envs/verl-cpu.txt).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is installed by scripts/setup.sh (envs/verl-cpu.txt)")

from fake_env import COMMANDS, FakeEnv, build_tiny_model  # noqa: E402
from verl_helpers import compose_ppo  # noqa: E402

from fedagent.rollout.prompts import RESPONSE_PREFIX, encode_prompt, windowed_prompt  # noqa: E402
from fedagent.train.local import TrainParams  # noqa: E402
from fedagent.train.verl.launch import VerlJob  # noqa: E402
from fedagent.train.verl.overrides import build_overrides  # noqa: E402
from fedagent.train.verl.settings import VerlSettings  # noqa: E402


class FakeServer:
    """verl's LLM server client: scripted answers (as token ids), every request recorded."""

    def __init__(self, tokenizer, answers, global_steps=1):
        self.tok, self.answers, self.calls = tokenizer, list(answers), []
        self.global_steps = global_steps

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
        from verl.workers.rollout.replica import TokenOutput

        self.calls.append({"prompt_ids": list(prompt_ids), "sampling_params": dict(sampling_params)})
        ids = self.tok.encode(self.answers[len(self.calls) - 1], add_special_tokens=False)
        # As verl's LLMServerManager.generate: the server's weight version, copied to min/max.
        out = TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), extra_fields={"global_steps": self.global_steps})
        out.extra_fields.setdefault("min_global_steps", self.global_steps)
        out.extra_fields.setdefault("max_global_steps", self.global_steps)
        return out


def row(seed, **coords):
    """A row's extra_info as job_files.task_rows writes it (task seed + the job's seed coordinates)."""
    return {"seed": seed, "epoch": 0, "group": 0, "round": 1, "client": 0, "base_seed": 0, **coords}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from fedagent.model.policy import load_tokenizer

    d = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m")
    return d, load_tokenizer(d)


def make_loop(tiny, tmp_path, server, env, *, max_prompt_tokens=1024, max_turns=3, penalty=0.1, response_length=40):
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    from fedagent.train.verl.agent_loop import WindowedAgentLoop

    model_dir, tok = tiny
    p = TrainParams(max_prompt_tokens=1024, max_new_tokens=response_length, group_size=2)
    job = VerlJob(tag="t", workdir=tmp_path, ray_tmp=tmp_path)
    cfg = compose_ppo(
        build_overrides(
            p,
            VerlSettings(),
            job=job,
            model_dir=model_dir,
            rows=tmp_path / "r.parquet",
            agent_loop_yaml=tmp_path / "a.yaml",
            rollout_seed=0,
        )
    )
    return WindowedAgentLoop(
        trainer_config=DictConfigWrap(cfg),
        server_manager=server,
        tokenizer=tok,
        processor=None,
        dataset_cls=None,
        data_config=DictConfigWrap(cfg.data),
        name="fedagent_windowed",
        tools=None,
        env=env,
        max_turns=max_turns,
        max_prompt_tokens=max_prompt_tokens,
        invalid_penalty=penalty,
        record_file=str(tmp_path / "episodes.jsonl"),
    )


def expected_prompts(tok, env_log_answers, seed, max_prompt_tokens, prompt_template="textworld"):
    """Replay the episode on a second fake env, building prompts the local backend's way."""
    env = FakeEnv(max_turns=3, prompt_template=prompt_template)
    env.create("x")
    r = env.reset("x", seed)
    obs, history, prompts = r["observation"], [], []
    for text in env_log_answers:
        prompts.append(
            encode_prompt(
                tok,
                windowed_prompt(r["task"], obs, r["admissible_commands"], history, template=r["prompt_template"]),
                max_prompt_tokens,
            )
        )
        s = env.step("x", RESPONSE_PREFIX + text)
        history.append((obs, s["action"]))
        obs = s["observation"]
        if s["done"]:
            break
    return prompts


def test_per_turn_samples_prompts_masks_rewards_and_task_ids(tiny, tmp_path):
    _, tok = tiny
    seed = 2  # index mode: fake-002, target "take key"
    assert FakeEnv.target("fake-002") == "take key" == COMMANDS[2]
    answers = ["no tags here", "x</think><action>go north</action>", "y</think><action>take key</action>"]
    server, env = FakeServer(tok, answers), FakeEnv(max_turns=3)
    loop = make_loop(tiny, tmp_path, server, env)
    outs = asyncio.run(
        loop.run({"temperature": 1.0, "top_p": 1.0}, uid="u1", session_id=1, extra_info=row(seed), raw_prompt=[])
    )
    assert len(outs) == 3  # one sample per turn
    assert [c["prompt_ids"] for c in server.calls] == expected_prompts(tok, answers, seed, 1024)
    assert all(c["sampling_params"]["max_tokens"] == 40 for c in server.calls)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert all(im_end in c["sampling_params"]["stop_token_ids"] for c in server.calls)
    for o, a in zip(outs, answers):
        ids = tok.encode(a, add_special_tokens=False)
        assert o.response_ids == ids and o.response_mask == [1] * len(ids)
        assert o.response_logprobs == [-0.5] * len(ids)
        assert o.extra_fields["task_id"] == "fake-002" and o.extra_fields["task_type"] == "even"
    # Return 10 (won on turn 3); turn 1 was invalid: 10 - 0.1; turns 2 and 3 were valid.
    assert [o.turn_reward for o in outs] == [pytest.approx(9.9), 10.0, 10.0]
    assert [o.extra_fields["valid"] for o in outs] == [False, True, True]
    # Every sample arrives scored: verl's AgentLoopWorker._compute_score calls a reward-loop worker only
    # for a final output whose reward_score is None, so train.verl.reward_workers (1) are never used.
    assert all(o.reward_score is not None for o in outs)
    # verl's v1 worker copies the last output's reward_score onto the earlier ones: rm_scores keep theirs.
    for o in outs[:-1]:
        o.reward_score = outs[-1].reward_score
    d0 = outs[0].as_dict()
    assert float(d0["rm_scores"][-1]) == pytest.approx(9.9) and float(d0["rm_scores"][:-1].abs().sum()) == 0
    assert d0["responses"].tolist() == outs[0].response_ids and d0["response_mask"].tolist() == [1] * len(
        outs[0].response_ids
    )
    assert env.sessions == {} and ("close", "u1-s1") in env.log
    rec = [json.loads(line) for line in Path(tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert len(rec) == 1 and rec[0]["task_id"] == "fake-002" and rec[0]["won"] and rec[0]["return"] == 10.0
    assert [t["valid"] for t in rec[0]["turns"]] == [False, True, True]


@pytest.mark.parametrize("family,marker", [("webshop", "WebShop e\u2011commerce"), ("alfworld", "ALFRED Embodied")])
def test_prompts_follow_the_family_the_env_names(tiny, tmp_path, family, marker):
    _, tok = tiny
    answers = ["x</think><action>go north</action>", "y</think><action>take key</action>"]
    server, env = FakeServer(tok, answers), FakeEnv(max_turns=3, prompt_template=family)
    loop = make_loop(tiny, tmp_path, server, env)
    asyncio.run(loop.run({}, uid="u5", session_id=0, extra_info=row(2), raw_prompt=[]))
    assert [c["prompt_ids"] for c in server.calls] == expected_prompts(tok, answers, 2, 1024, family)
    assert all(marker in tok.decode(c["prompt_ids"]) for c in server.calls)


def test_lost_episode_all_turns_get_zero_and_penalty_per_invalid_turn(tiny, tmp_path):
    _, tok = tiny
    answers = ["x</think><action>look</action>", "bad", "x</think><action>go south</action>"]
    server, env = FakeServer(tok, answers), FakeEnv(max_turns=3)
    loop = make_loop(tiny, tmp_path, server, env, penalty=0.25)
    outs = asyncio.run(loop.run({}, uid="u2", session_id=0, extra_info=row(2), raw_prompt=[]))
    assert [o.turn_reward for o in outs] == [0.0, -0.25, 0.0]
    assert [o.extra_fields["episode_return"] for o in outs] == [0.0, 0.0, 0.0]


def test_prompt_is_left_truncated_to_the_cap(tiny, tmp_path):
    _, tok = tiny
    answers = ["x</think><action>take key</action>"]
    server, env = FakeServer(tok, answers), FakeEnv(max_turns=3)
    loop = make_loop(tiny, tmp_path, server, env, max_prompt_tokens=48)
    outs = asyncio.run(loop.run({}, uid="u3", session_id=0, extra_info=row(2), raw_prompt=[]))
    full = expected_prompts(tok, answers, 2, 10_000)[0]
    assert len(full) > 48 and outs[0].prompt_ids == full[-48:] == server.calls[0]["prompt_ids"]


def test_session_is_closed_when_generation_fails(tiny, tmp_path):
    _, tok = tiny

    class Broken(FakeServer):
        async def generate(self, request_id, **kw):
            raise RuntimeError("server gone")

    env = FakeEnv(max_turns=3)
    loop = make_loop(tiny, tmp_path, Broken(tok, []), env)
    with pytest.raises(RuntimeError, match="server gone"):
        asyncio.run(loop.run({}, uid="u4", session_id=0, extra_info=row(1), raw_prompt=[]))
    assert env.sessions == {}


def test_verl_v1_worker_stores_one_row_per_turn_with_its_own_reward(tiny, tmp_path, monkeypatch):
    """Our outputs through verl 0.9.1's own v1 worker code (AgentLoopWorkerTQ._agent_loop_postprocess,
    TransferQueue's put captured): one row per turn under the task's uid, each row's rm_scores
    ending in that turn's reward although verl copies the last reward_score onto earlier turns."""
    tq_mod = pytest.importorskip("verl.trainer.ppo.v1.agent_loop_tq")

    _, tok = tiny
    answers = ["no tags here", "x</think><action>go north</action>", "y</think><action>take key</action>"]
    loop = make_loop(tiny, tmp_path, FakeServer(tok, answers), FakeEnv(max_turns=3))
    outs = asyncio.run(loop.run({}, uid="task-uid", session_id=3, extra_info=row(2), raw_prompt=[]))
    captured = {}

    async def fake_put(keys, fields, tags, partition_id):
        captured.update(keys=keys, fields=fields, tags=tags, partition_id=partition_id)

    monkeypatch.setattr(tq_mod.tq, "async_kv_batch_put", fake_put)
    worker_cls = tq_mod.AgentLoopWorkerTQ.__ray_metadata__.modified_class
    worker = object.__new__(worker_cls)
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    worker.processor = None
    worker.tokenizer = tok
    kwargs = {"uid": "task-uid", "session_id": 3, "global_steps": 1, "extra_info": row(2)}
    asyncio.run(worker._agent_loop_postprocess(outs, False, **kwargs))
    assert captured["keys"] == ["task-uid_3_0", "task-uid_3_1", "task-uid_3_2"] and captured["partition_id"] == "train"
    f = captured["fields"]
    rows = [f[i] for i in range(len(captured["keys"]))]
    rewards = [float(r["rm_scores"][-1]) for r in rows]
    assert rewards == [pytest.approx(9.9), 10.0, 10.0]
    for r, o in zip(rows, outs):
        assert r["responses"].tolist() == o.response_ids and r["prompts"].tolist() == o.prompt_ids
        assert r["response_mask"].tolist() == [1] * len(o.response_ids) and float(r["rm_scores"][:-1].abs().sum()) == 0
    assert [t["response_len"] for t in captured["tags"]] == [len(o.response_ids) for o in outs]


def test_loop_from_yaml_keys_talks_to_a_real_env_service(tiny, tmp_path):
    """The agent-loop YAML's env address (a Unix socket) reaches a real service; the episode's
    session is closed there and the loop's own client is shut down."""
    from env_fixtures import FakeTaskSource, serve_in_thread, short_tmp
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    from fedagent.envs.service import build_app
    from fedagent.train.verl.agent_loop import WindowedAgentLoop

    model_dir, tok = tiny
    src = FakeTaskSource(n=4)
    app = build_app(src, "train", src.ids, mode="draw", pool_size=2, max_turns=2)
    with serve_in_thread(app, short_tmp() / "env.sock") as uds:
        base = make_loop(tiny, tmp_path, FakeServer(tok, []), FakeEnv())
        loop = WindowedAgentLoop(
            trainer_config=DictConfigWrap(base.config),
            server_manager=FakeServer(tok, ["a", "b"]),
            tokenizer=tok,
            processor=None,
            dataset_cls=None,
            data_config=DictConfigWrap(base.config.data),
            env_uds=str(uds),
            max_turns=2,
        )
        outs = asyncio.run(loop.run({}, uid="u", session_id=0, extra_info=row(11), raw_prompt=[]))
        assert len(outs) == 2 and all(o.extra_fields["task_id"] in src.ids for o in outs)
        assert all(o.turn_reward == pytest.approx(-0.1) for o in outs)  # both answers invalid, no win
        assert loop.env._http.is_closed


def test_every_turn_carries_the_weight_version_verls_v1_trainer_reads(tiny, tmp_path):
    """verl's v1 trainer builds ``np.array([tag["min_global_steps"] ...], dtype=int)`` from each
    sample's extra fields (AgentLoopWorkerTQ); a sample without them stopped the H200 run after
    step 1 (TypeError on None)."""
    import numpy as np

    _, tok = tiny
    answers = ["no tags here", "x</think><action>go north</action>", "y</think><action>take key</action>"]
    server, env = FakeServer(tok, answers, global_steps=3), FakeEnv(max_turns=3)
    loop = make_loop(tiny, tmp_path, server, env)
    outs = asyncio.run(
        loop.run({"temperature": 1.0, "top_p": 1.0}, uid="u1", session_id=0, extra_info=row(2), raw_prompt=[])
    )
    fields = [o.as_dict()["extra_fields"] for o in outs]
    tags = [
        {"min_global_steps": f.get("min_global_steps"), "max_global_steps": f.get("max_global_steps")} for f in fields
    ]
    assert np.array([t["min_global_steps"] for t in tags], dtype=int).tolist() == [3, 3, 3]
    assert np.array([t["max_global_steps"] for t in tags], dtype=int).tolist() == [3, 3, 3]


def test_a_job_files_start_model_gives_the_stop_tokens_and_a_missing_one_fails(tiny, tmp_path):
    """On live engines (warm refit, run-scoped sets) verl's config names the first job's start model,
    which a later round may have deleted: the loop takes its stop tokens from the job file's model dir,
    and a named dir that does not exist is an error, never the tokenizer-only fallback."""
    import json

    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    from fedagent.train.verl.agent_loop import WindowedAgentLoop

    model_dir, tok = tiny
    base = make_loop(tiny, tmp_path, FakeServer(tok, []), FakeEnv())
    mine = tmp_path / "round_002-model"
    mine.mkdir()
    (mine / "generation_config.json").write_text(json.dumps({"eos_token_id": [7]}))
    job = tmp_path / "job.json"

    def loop_with(model):
        job.write_text(
            json.dumps(
                {
                    "env_uds": "/tmp/x.sock",
                    "env_url": None,
                    "env_token": None,
                    "record_file": str(tmp_path / "ep.jsonl"),
                    "model_dir": str(model),
                }
            )
        )
        return WindowedAgentLoop(
            trainer_config=DictConfigWrap(base.config),
            server_manager=FakeServer(tok, []),
            tokenizer=tok,
            processor=None,
            dataset_cls=None,
            data_config=DictConfigWrap(base.config.data),
            env=FakeEnv(),
            job_file=str(job),
        )

    assert 7 in loop_with(mine).stop_token_ids and 7 not in base.stop_token_ids
    with pytest.raises(FileNotFoundError, match="does not exist"):
        loop_with(tmp_path / "deleted-round-model")


def test_every_request_carries_the_jobs_own_sampling_seed(tiny, tmp_path):
    """vLLM's engine seed is engine-wide (on a run-scoped set: its first job's), so each request carries its
    own seed from the row's job coordinates, session and turn: the same episode samples the same way on any
    engine, a group's sessions get different streams, and every turn's seed is in the episode record."""
    from fedagent.core.seeds import request_seed

    _, tok = tiny
    answers = [
        "x</think><action>go north</action>",
        "y</think><action>go north</action>",
        "z</think><action>take key</action>",
    ]
    calls = {}
    for session in (0, 1):
        server = FakeServer(tok, answers)
        loop = make_loop(tiny, tmp_path, server, FakeEnv(max_turns=3))
        asyncio.run(
            loop.run(
                {"temperature": 1.0},
                uid="u",
                session_id=session,
                extra_info=row(2, round=3, client=1, epoch=1, group=4, base_seed=9),
                raw_prompt=[],
            )
        )
        calls[session] = [c["sampling_params"]["seed"] for c in server.calls]
        assert calls[session] == [
            request_seed(9, round=3, client=1, epoch=1, group=4, session=session, turn=k)
            for k in range(len(server.calls))
        ]
    assert len(calls[0]) == 3 and not set(calls[0]) & set(calls[1])
    recs = [json.loads(line) for line in Path(tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert [[t["sampling_seed"] for t in r["turns"]] for r in recs] == [calls[0], calls[1]]
    with pytest.raises(ValueError, match="base_seed"):
        asyncio.run(
            make_loop(tiny, tmp_path, FakeServer(tok, answers), FakeEnv()).run(
                {},
                uid="u",
                session_id=0,
                extra_info={"seed": 2, "epoch": 0, "group": 0, "round": 1, "client": 0},
                raw_prompt=[],
            )
        )
