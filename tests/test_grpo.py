"""GRPO math, loss terms, learning direction, and byte-identical local training."""

from __future__ import annotations

import hashlib
import json
import math
import statistics

import pytest
import torch

from fake_env import TINY_TRAIN, Pending, FakeEnv
from fedagent.core.atomic import verify_manifest
from fedagent.model.policy import load_policy
from fedagent.rollout.episode import Trajectory, Turn
from fedagent.core.seeds import python_rng
from fedagent.train import grpo
from fedagent.train.local import TrainParams, epoch_task_seeds, train_client
from fedagent.train.actor import grpo_epoch


def test_group_advantages_match_hand_computation():
    rewards = [10.0, 0.0, 0.0, 10.0, 9.9, 5.0, 1.0, 3.0]
    groups = [0, 0, 0, 0, 0, 1, 1, 2]
    adv = grpo.group_advantages(rewards, groups)
    g0 = rewards[:5]
    m, s = statistics.mean(g0), statistics.stdev(g0)  # unbiased, as torch.std
    assert adv[:5] == pytest.approx([(r - m) / (s + 1e-6) for r in g0], rel=1e-12)
    m1, s1 = 3.0, statistics.stdev([5.0, 1.0])
    assert adv[5:7] == pytest.approx([(5 - m1) / (s1 + 1e-6), (1 - m1) / (s1 + 1e-6)])
    assert adv[7] == pytest.approx(3.0 / (1 + 1e-6))  # single-sample group: mean 0, std 1
    assert grpo.group_advantages([4.0, 4.0], [0, 0]) == [0.0, 0.0]
    # All turns invalid (everyone -0.1): exactly zero, not rounding noise that Adam would amplify.
    assert grpo.group_advantages([-0.1] * 12, [0] * 12) == [0.0] * 12


def test_no_signal_leaves_the_weights_untouched(tiny_dir, tmp_path):
    """A round where every answer is invalid and nobody wins must not move the model."""
    from safetensors.torch import load_file

    p = TrainParams.from_dict({**PARAMS, "epochs": 1})
    m = train_client(
        tiny_dir, tiny_dir, FakeEnv(mode="draw"), round=0, client=0, params=p, threads=1, out_dir=tmp_path / "u"
    )
    assert m["mean_return"] == 0.0 and all(s["grad_norm"] == 0.0 for s in m["steps"])
    before, after = load_file(tiny_dir / "model.safetensors"), load_file(tmp_path / "u" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_every_turn_carries_the_return_and_only_invalid_turns_pay():
    def turn(valid):
        return Turn(prompt_ids=[1], response_ids=[2], text="", action="", valid=valid, reward=0.0)

    t1 = Trajectory("a", "x", 0, turns=[turn(True), turn(False), turn(True)], episode_return=10.0)
    t2 = Trajectory("a", "x", 0, turns=[turn(False)], episode_return=0.0)
    s = grpo.turn_samples([t1, t2], [0, 0], invalid_penalty=0.1)
    assert [x.reward for x in s] == [10.0, 9.9, 10.0, -0.1]
    assert [x.group for x in s] == [0, 0, 0, 0]


def test_k3_kl_and_clipping():
    lp = torch.tensor([-1.0, -2.0, -0.5])
    assert torch.equal(grpo.k3_kl(lp, lp), torch.zeros(3))
    ref = torch.tensor([-1.5, -1.0, -0.5])
    d = ref - lp
    assert torch.allclose(grpo.k3_kl(lp, ref), torch.exp(d) - d - 1)
    assert (grpo.k3_kl(lp, ref) >= 0).all()
    # ratio 2 with positive advantage: clipped at 1.2, so no gradient flows.
    logp = torch.tensor([math.log(2.0)], requires_grad=True)
    loss, st = grpo.grpo_token_terms(logp, torch.zeros(1), None, torch.ones(1), clip=0.2, kl_coef=0.0)
    assert loss.item() == pytest.approx(-1.2)
    loss.sum().backward()
    assert logp.grad.item() == 0.0 and st["clipped"].item() == 1.0
    # ratio 2 with negative advantage: unclipped branch, gradient flows.
    logp = torch.tensor([math.log(2.0)], requires_grad=True)
    loss, _ = grpo.grpo_token_terms(logp, torch.zeros(1), None, -torch.ones(1), clip=0.2, kl_coef=0.0)
    assert loss.item() == pytest.approx(2.0)
    loss.sum().backward()
    assert logp.grad.item() == pytest.approx(2.0)


def test_kl_is_zero_when_policy_equals_reference(tiny_dir):
    model, tok = load_policy(tiny_dir, threads=1)
    ref, _ = load_policy(tiny_dir, threads=1)
    samples = [grpo.Sample([5, 6, 7, 8], [9, 10, 11], 1.0, 0), grpo.Sample([5, 6], [12, 13, 14, 15], 0.0, 0)]
    with torch.no_grad():
        a, _ = grpo.response_logprobs(model, samples, temperature=1.0)
        b, _ = grpo.response_logprobs(ref, samples, temperature=1.0)
    assert a.shape == (7,)
    assert torch.equal(grpo.k3_kl(a, b), torch.zeros(7))


@pytest.mark.parametrize("right_pad", [False, True])
def test_response_logprobs_match_an_unpadded_forward_whichever_side_is_padded(tiny_dir, right_pad):
    model, _ = load_policy(tiny_dir, threads=1)
    samples = [
        grpo.Sample([5, 6, 7, 8, 9, 10], [11, 12, 13], 1.0, 0),
        grpo.Sample([5, 6], [14, 15, 16, 17], 0.0, 0),
        # observation glue inside the response: context, not a target
        grpo.Sample([7, 8, 9], [18, 19, 20, 21, 22], 0.5, 1, response_mask=[1, 0, 0, 1, 1]),
    ]
    with torch.no_grad():
        got, ent = grpo.response_logprobs(model, samples, temperature=0.7, with_entropy=True, right_pad=right_pad)
        want = []
        for s in samples:
            full = torch.tensor([s.prompt_ids + s.response_ids])
            lp = torch.log_softmax(model(input_ids=full).logits[0].float() / 0.7, -1)
            n = len(s.prompt_ids)
            want += [
                lp[n - 1 + k, t] for k, t in enumerate(s.response_ids) if s.response_mask is None or s.response_mask[k]
            ]
    assert torch.allclose(got, torch.stack(want), atol=1e-5)
    assert ent.shape == got.shape and (ent > 0).all()


def test_response_logprobs_padded_to_a_static_shape_are_the_same(tiny_dir):
    """train.compile_train pads each micro-batch to (micro_batch_size, width rounded up): the
    extra rows and columns must add no target and change no log-prob."""
    model, _ = load_policy(tiny_dir, threads=1)
    samples = [
        grpo.Sample([5, 6, 7, 8, 9, 10], [11, 12, 13], 1.0, 0),
        grpo.Sample([7, 8, 9], [18, 19, 20, 21, 22], 0.5, 1, response_mask=[1, 0, 0, 1, 1]),
    ]
    shape = grpo.static_pad_shape(len(samples), 9, rows_to=4, width_step=8)
    assert shape == (4, 16)
    with torch.no_grad():
        want, _ = grpo.response_logprobs(model, samples, temperature=0.7, right_pad=True)
        got, _ = grpo.response_logprobs(model, samples, temperature=0.7, right_pad=True, pad_shape=shape)
    assert got.shape == want.shape == (6,)
    assert torch.allclose(got, want, atol=1e-6)
    with torch.no_grad():  # the trained-token list padded too (what compile_train's buckets add)
        got3, _ = grpo.response_logprobs(model, samples, temperature=0.7, right_pad=True, pad_shape=shape + (16,))
    assert got3.shape == (6,) and torch.allclose(got3, want, atol=1e-6)
    with pytest.raises(ValueError, match="smaller than the batch"):
        grpo.response_logprobs(model, samples, temperature=0.7, right_pad=True, pad_shape=(1, 16))


def test_compiled_forward_with_padded_targets_gives_the_same_log_probs(tiny_dir, tmp_path):
    """train.compile_train's path on the CPU (Dynamo with the eager backend: the same padding,
    target padding, slicing and mask-free causal attention, without inductor or CUDA graphs)."""
    import json

    from fedagent.model.policy import save_policy
    from fedagent.train.actor import CAUSAL_SDPA, causal_attention_without_mask

    model, tok = load_policy(tiny_dir, threads=1)
    samples = [
        grpo.Sample([5, 6, 7, 8, 9, 10], [11, 12, 13], 1.0, 0),
        grpo.Sample([7, 8, 9], [18, 19, 20, 21, 22], 0.5, 1, response_mask=[1, 0, 0, 1, 1]),
    ]
    with torch.no_grad():
        want, want_ent = grpo.response_logprobs(model, samples, temperature=0.7, with_entropy=True)
    causal_attention_without_mask(model)
    model._fedagent_forward = torch.compile(grpo.forward_logprobs, backend="eager", dynamic=False)
    shape = grpo.static_pad_shape(2, 9, rows_to=4, width_step=8, n_targets=6, target_step=16)
    assert shape == (4, 16, 16)
    with torch.no_grad():
        got, ent = grpo.response_logprobs(
            model, samples, temperature=0.7, with_entropy=True, right_pad=True, pad_shape=shape
        )
    assert got.shape == want.shape == (6,)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(ent, want_ent, atol=1e-5)
    # the registered attention name is the process's, not the model's: never saved with it
    save_policy(model, tok, tmp_path / "m")
    assert CAUSAL_SDPA not in (tmp_path / "m" / "config.json").read_text()
    assert json.loads((tmp_path / "m" / "config.json").read_text()).get("attn_implementation") in (None, "sdpa")


def test_compiled_training_accumulates_micro_batches_into_gradients_it_keeps(tiny_dir):
    """train.compile_train: every .grad is allocated before the step and zeroed in place, so a
    CUDA-graph replay can never own a parameter's gradient between micro-batches (the step's
    numbers are the plain path's). Seen failing with zero_grad(set_to_none=True) for the compiled
    model (gradients re-made every step); the GPU failure itself needs CUDA graphs."""
    from fedagent.train.actor import token_slices, update_step
    from fedagent.train.local import TrainParams

    samples = [
        grpo.Sample([5, 6, 7, 8, 9, 10], [11, 12, 13], 1.0, 0, advantage=1.0),
        grpo.Sample([7, 8, 9], [18, 19, 20, 21, 22], 0.5, 1, advantage=-0.5),
        grpo.Sample([5, 6], [14, 15, 16], 0.0, 0, advantage=0.5),
    ]
    p = TrainParams(mini_batch_size=3, micro_batch_size=1, kl_coef=0.0, temperature=1.0)
    old = torch.zeros(sum(s.trained_count() for s in samples))
    adv = grpo.token_advantages(samples)
    results = []
    for compiled in (False, True):
        model, _ = load_policy(tiny_dir, threads=1)
        if compiled:
            # what compile_for_training sets (Dynamo's eager backend here: no inductor, no CUDA graphs)
            model._fedagent_forward = torch.compile(grpo.forward_logprobs, backend="eager", dynamic=False)
        params = [q for q in model.parameters() if q.requires_grad]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        update_step(model, opt, samples, [0, 1, 2], old, None, adv, token_slices(samples), p, params)
        kept = [q.grad for q in params]
        update_step(model, opt, samples, [0, 1, 2], old, None, adv, token_slices(samples), p, params)
        if compiled:
            assert all(g is not None for g in kept) and all(q.grad is g for q, g in zip(params, kept))
        results.append([q.detach().clone() for q in params])
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-6)


def test_bf16_residual_stream_keeps_the_hidden_states_in_bf16(tiny_dir):
    """train.residual_dtype: bfloat16 casts the embedding's output once, so every decoder layer
    reads and writes bf16 hidden states (under the autocast the GPU path runs), the log-probs
    stay fp32 and close to the fp32 stream's, the gradient reaches the fp32 embedding; float32
    gives the model back its own forward, byte for byte. Also traced whole by Dynamo."""
    model, _ = load_policy(tiny_dir, threads=1)
    samples = [
        grpo.Sample([5, 6, 7, 8, 9, 10], [11, 12, 13], 1.0, 0),
        grpo.Sample([7, 8, 9], [18, 19, 20, 21, 22], 0.5, 1, response_mask=[1, 0, 0, 1, 1]),
    ]
    seen = []
    for layer in model.model.layers:
        layer.register_forward_hook(
            lambda mod, args, kwargs, out: seen.append((args[0] if args else kwargs["hidden_states"]).dtype),
            with_kwargs=True,
        )

    def run():
        seen.clear()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, _ = grpo.response_logprobs(model, samples, temperature=0.7, right_pad=True)
        lp.sum().backward()
        return lp.detach(), list(seen), model.get_input_embeddings().weight.grad.clone()

    want, dtypes32, _ = run()
    assert set(dtypes32) == {torch.float32}
    grpo.set_residual_dtype(model, "bfloat16")
    got, dtypes16, g16 = run()
    assert dtypes16 == [torch.bfloat16] * model.config.num_hidden_layers
    assert got.dtype == torch.float32 and not torch.equal(got, want)
    assert torch.allclose(got, want, atol=0.1)
    assert g16.dtype == torch.float32 and g16.abs().sum() > 0
    explain = torch._dynamo.explain(grpo.forward_logprobs)
    ids, pos, rows, cols, targets = grpo._right_padded(samples, None, torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ex = explain(model, ids, None, pos, rows, cols, targets, 0.7, True)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0)
    grpo.set_residual_dtype(model, "float32")
    again, dtypes, _ = run()
    assert torch.equal(again, want) and set(dtypes) == {torch.float32}
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        grpo.set_residual_dtype(model, "float16")


def test_bf16_residual_needs_cuda():
    """A job's params with residual_dtype bfloat16 on the CPU are refused by name (the config
    rule in fedagent.core.config refuses the same at planning)."""
    with pytest.raises(ValueError, match="residual_dtype"):
        TrainParams.from_dict({"residual_dtype": "bfloat16"})
    assert TrainParams.from_dict({"residual_dtype": "bfloat16", "device": "cuda"}).residual_dtype == "bfloat16"


def _pair_logps(model, samples):
    with torch.no_grad():
        lp, _ = grpo.response_logprobs(model, samples, temperature=1.0)
    return float(lp[:3].sum()), float(lp[3:].sum())


def test_policy_moves_toward_the_rewarded_answer(tiny_dir):
    model, tok = load_policy(tiny_dir, threads=1)
    ref, _ = load_policy(tiny_dir, threads=1)
    prompt = tok.encode("take the key", add_special_tokens=False)
    good, bad = [40, 41, 42], [50, 51, 52]
    samples = [grpo.Sample(prompt, good, 10.0, 0), grpo.Sample(prompt, bad, 0.0, 0)]
    for s, a in zip(samples, grpo.group_advantages([10.0, 0.0], [0, 0])):
        s.advantage = a
    p = TrainParams(lr=3e-3, mini_batch_size=2, micro_batch_size=1)
    opt = torch.optim.AdamW(model.parameters(), lr=p.lr, weight_decay=0.0)
    g0, b0 = _pair_logps(model, samples)
    for e in range(4):
        steps = grpo_epoch(model, ref, opt, samples, p, python_rng(0, "t", epoch=e), e)
    g1, b1 = _pair_logps(model, samples)
    assert g1 > g0 + 0.5 and b1 < b0 - 0.5
    assert steps[-1]["kl"] > 0  # moved away from the reference


PARAMS = TINY_TRAIN


def _env():
    # Reward variance inside groups (a random tiny model never wins the real fake game).
    return FakeEnv(mode="draw", win_if=lambda text: len(text) % 2 == 0)


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_train_client_is_byte_identical_and_writes_the_update(tiny_dir, tmp_path, monkeypatch, capsys):
    """The first job prints a progress line every millisecond, the second only its first and last: the same
    bytes (progress lines never change a result), and the lines count every episode (seen failing with
    the rollout's on_done left unwired: the last line said done=0)."""
    from fedagent.core.progress import PROGRESS_ENV, parse_line

    p = TrainParams.from_dict(PARAMS)
    outs = []
    for k, every in enumerate(("0.001", "3600")):
        monkeypatch.setenv(PROGRESS_ENV, every)
        env = _env()
        m = train_client(tiny_dir, tiny_dir, env, round=1, client=0, params=p, threads=1, out_dir=tmp_path / f"u{k}")
        assert env.sessions == {}
        outs.append((tmp_path / f"u{k}", m))
        lines = [x for x in map(parse_line, capsys.readouterr().err.splitlines()) if x is not None]
        total = p.epochs * p.groups_per_epoch * p.group_size
        assert lines[0]["done"] == 0 and lines[-1] == {**lines[-1], "done": total, "total": total, "state": "done"}
        assert len(lines) > 2 if k == 0 else len(lines) == 2
    (a, ma), (b, _) = outs
    assert _sha(a / "model.safetensors") == _sha(b / "model.safetensors")
    # provenance.json: the job's params and seeds; no clock or pid, so re-runs write the same bytes
    assert _sha(a / "provenance.json") == _sha(b / "provenance.json")
    prov = json.loads((a / "provenance.json").read_text())
    assert prov["job"] == "train_client" and prov["seeds"]["client"] == 0 and prov["params"]["lr"] == p.lr
    from safetensors.torch import load_file

    before, after = load_file(tiny_dir / "model.safetensors"), load_file(a / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the update moved weights
    for e in range(2):  # both epochs had a learning signal (so later tests can tell epochs apart)
        assert max(s["grad_norm"] for s in ma["steps"] if s["epoch"] == e) > 0
    verify_manifest(a)
    # Phase timings: marks in process order; on CPU the cold start ends where the first rollout starts.
    tm = ma["timings"]
    order = ["job_ready", "weights_loaded", "model_loaded", "rollout_start", "train_start", "saved"]
    assert [tm["marks"][k] for k in order] == sorted(tm["marks"][k] for k in order)
    split = {"rollout_env", "rollout_prompt", "rollout_sample"}  # the rollout loop's own split, inside rollout
    assert tm["cold_start_s"] == tm["marks"]["rollout_start"] and set(tm["phases"]) == {"rollout", "train", *split}
    assert sum(tm["phases"][k] for k in split) <= tm["phases"]["rollout"] + 0.01
    assert ma["num_samples"] > 0 and ma["num_tokens"] > 0 and len(ma["steps"]) >= 2
    assert ma["groups"] == 2 * 2 and 0 <= ma["groups_nonzero_advantage"] <= ma["groups"]  # epochs × groups
    assert "samples_nonzero_reward" not in ma  # PPO's count
    assert ma["task_seeds"] == [epoch_task_seeds(p, 1, 0, e) for e in range(2)]
    assert ma["task_seeds"][0] != ma["task_seeds"][1]  # fresh draws every epoch
    for key in ("mean_return", "success_rate", "kl", "wall_time_s", "num_episodes"):
        assert key in ma
    lines = (a / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2 * 3
    assert {"epoch", "group", "seed", "task_id", "turns", "return", "won"} <= set(json.loads(lines[0]))
    # group_wins: every group of every epoch counted once, by how many of its rollouts won (samples.jsonl)
    wins: dict = {}
    for rec in map(json.loads, lines):
        wins[(rec["epoch"], rec["group"])] = wins.get((rec["epoch"], rec["group"]), 0) + int(rec["won"])
    expected = {str(k): sum(1 for w in wins.values() if w == k) for k in range(p.group_size + 1)}
    assert ma["group_wins"] == expected and sum(expected.values()) == ma["groups"], (ma["group_wins"], expected)
    # by_epoch: each epoch's own success (samples.jsonl) and its steps' mean entropy and KL
    recs = [json.loads(line) for line in lines]
    for e in range(2):
        mine = [r for r in recs if r["epoch"] == e]
        got = ma["by_epoch"][str(e)]
        assert got["success_rate"] == sum(bool(r["won"]) for r in mine) / len(mine), (e, got)
        ent = [s["entropy"] for s in ma["steps"] if s["epoch"] == e]
        assert math.isclose(got["entropy"], math.fsum(ent) / len(ent), rel_tol=1e-12), (e, got)
    assert set(ma["by_epoch"]) == {"0", "1"}
    # Another round or client draws other tasks.
    assert epoch_task_seeds(p, 2, 0, 0) != epoch_task_seeds(p, 1, 0, 0) != epoch_task_seeds(p, 1, 1, 0)


def test_train_client_seed_changes_the_update(tiny_dir, tmp_path):
    p = TrainParams.from_dict({**PARAMS, "epochs": 1})
    q = TrainParams.from_dict({**PARAMS, "epochs": 1, "base_seed": 4})
    for name, params in (("p", p), ("q", q)):
        train_client(tiny_dir, tiny_dir, _env(), round=1, client=0, params=params, threads=1, out_dir=tmp_path / name)
    assert _sha(tmp_path / "p" / "model.safetensors") != _sha(tmp_path / "q" / "model.safetensors")


def test_params_reject_unknown_keys():
    with pytest.raises(ValueError, match="bogus"):
        TrainParams.from_dict({"bogus": 1})


def test_train_client_cli_uses_the_shard_in_draw_mode(tiny_dir, tmp_path, monkeypatch):
    import argparse
    import contextlib

    from fedagent.train import cli

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
            pool=pool_size,
            client=client_id,
            source=source,
            env_params=env_params,
            projection=projection,
            workdir_outside=not str(workdir).startswith(str(tmp_path / "round_001" / "clients" / "1") + "/"),
        )
        env = FakeEnv(list(task_ids), mode=mode, max_turns=max_turns)
        yield env if wait else Pending(env)

    monkeypatch.setattr("fedagent.envs.lifecycle.env_service", fake_service)
    part = tmp_path / "partition.json"
    part.write_text(json.dumps({"clients": {"0": ["fake-000"], "1": ["fake-002", "fake-003"]}}))
    (tmp_path / "games.json").write_text(json.dumps({"train": ["fake-000"], "val": ["fake-005"]}))
    parser = argparse.ArgumentParser()
    cli.add_args(parser)
    out = tmp_path / "round_001" / "clients" / "1"
    args = parser.parse_args(
        [
            "--model",
            str(tiny_dir),
            "--ref-model",
            str(tiny_dir),
            "--games",
            str(tmp_path),
            "--partition",
            str(part),
            "--client",
            "1",
            "--round",
            "1",
            "--params",
            json.dumps({**PARAMS, "epochs": 1, "env_procs": 2, "projection": "noop"}),
            "--threads",
            "1",
            "--out",
            str(out),
            "--quarantine",
            str(tmp_path / "_failed"),
        ]
    )
    assert cli.run(args) == 0
    assert seen == {
        "split": "train",
        "tasks": ["fake-002", "fake-003"],
        "mode": "draw",
        "pool": 4,
        "client": "1",
        "workdir_outside": True,
        "source": "textworld",
        "env_params": None,
        "env_procs": 2,
        "projection": "noop",
    }  # rollout.projection reaches the job's service
    verify_manifest(out)
    tasks = {json.loads(line)["task_id"] for line in (out / "samples.jsonl").read_text().splitlines()}
    assert tasks <= {"fake-002", "fake-003"}
    assert sorted(p.name for p in out.parent.iterdir()) == ["1"]  # no leftover work dir


def test_reference_shortcut_gives_the_same_update(tiny_dir, tmp_path, monkeypatch):
    """Reusing behaviour log-probs as reference log-probs (same weights) changes no byte."""
    import fedagent.train.local as local

    p = TrainParams.from_dict({**PARAMS, "epochs": 2})
    local.train_client(tiny_dir, tiny_dir, _env(), round=0, client=0, params=p, threads=1, out_dir=tmp_path / "fast")
    monkeypatch.setattr(local, "same_weights", lambda a, b: False)
    local.train_client(tiny_dir, tiny_dir, _env(), round=0, client=0, params=p, threads=1, out_dir=tmp_path / "slow")
    assert _sha(tmp_path / "fast" / "model.safetensors") == _sha(tmp_path / "slow" / "model.safetensors")


def test_micro_batching_does_not_change_the_update(tiny_dir):
    """Gradient accumulation over micro-batches = one token-mean over the whole mini-batch."""
    samples = [
        grpo.Sample([5, 6, 7], [40, 41], 1.0, 0, advantage=1.0),
        grpo.Sample([5, 6], [50, 51, 52, 53, 54], 0.0, 0, advantage=-1.0),
        grpo.Sample([8, 9, 10, 11], [60], 0.0, 0, advantage=0.5),
    ]
    params = []
    for micro in (1, 3):
        model, _ = load_policy(tiny_dir, threads=1)
        ref, _ = load_policy(tiny_dir, threads=1)
        with torch.no_grad():  # make the reference differ so the KL term has a gradient
            next(ref.parameters()).mul_(1.1)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        p = TrainParams(mini_batch_size=3, micro_batch_size=micro, kl_coef=0.5, grad_clip=1e9)
        grpo_epoch(model, ref, opt, samples, p, python_rng(0, "t"), 0)
        params.append(torch.cat([q.detach().flatten() for q in model.parameters()]))
    base = torch.cat([q.detach().flatten() for q in load_policy(tiny_dir, threads=1)[0].parameters()])
    assert not torch.allclose(params[0], base)
    assert torch.allclose(params[0] - base, params[1] - base, atol=1e-6, rtol=1e-4)


def test_far_log_ratios_give_finite_gradients():
    # verl clamps log-ratios to ±20 before exp; without that an overflowing exp (ratio or k3 KL)
    # is clamped afterwards but its backward is 0 * inf = NaN, and NaN reaches the weights.
    from fedagent.train.grpo import grpo_token_terms

    logp = torch.tensor([-120.0, -0.5, -3.0], requires_grad=True)
    old = torch.tensor([-0.1, -0.5, -3.0])
    ref = torch.tensor([-0.2, -0.4, -95.0])
    adv = torch.tensor([1.0, -1.0, -1.0])
    loss, _ = grpo_token_terms(logp, old, ref, adv, clip=0.2, kl_coef=0.01)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all(), logp.grad
    logp2 = torch.tensor([-0.1], requires_grad=True)
    loss2, _ = grpo_token_terms(logp2, torch.tensor([-100.0]), None, torch.tensor([-1.0]), clip=0.2, kl_coef=0.0)
    loss2.sum().backward()
    assert torch.isfinite(loss2).all() and torch.isfinite(logp2.grad).all()


def _two_step_samples():
    return [
        grpo.Sample([5, 6, 7], [40, 41], 1.0, 0, advantage=1.0),
        grpo.Sample([5, 6], [50, 51, 52], 0.0, 0, advantage=-1.0),
        grpo.Sample([8, 9, 10, 11], [60], 0.0, 1, advantage=0.5),
        grpo.Sample([8, 9], [61, 62], 1.0, 1, advantage=-0.5),
    ]


def test_a_fused_optimizer_defers_the_stats_without_changing_them(tiny_dir):
    # The GPU path's fused AdamW: no host sync per step; the records and the weights are the
    # same as when each step's norm is read before stepping (defaults["fused"] off: that path).
    out = []
    for deferred in (True, False):
        model, _ = load_policy(tiny_dir, threads=1)
        ref, _ = load_policy(tiny_dir, threads=1)
        with torch.no_grad():
            next(ref.parameters()).mul_(1.1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        opt.defaults["fused"] = deferred
        p = TrainParams(mini_batch_size=2, micro_batch_size=1, kl_coef=0.1)
        steps = grpo_epoch(model, ref, opt, _two_step_samples(), p, python_rng(0, "t"), 0)
        out.append((steps, torch.cat([q.detach().flatten() for q in model.parameters()])))
    assert len(out[0][0]) == 2 and out[0][0] == out[1][0]
    assert torch.equal(out[0][1], out[1][1])


@pytest.mark.parametrize("optimizer", ["sgd", "fused_adamw"])
def test_a_non_finite_gradient_stops_the_epoch_before_the_weights_change(tiny_dir, optimizer):
    # clip_grad_norm_ of an inf norm scales every gradient by 0 → NaN (inf * 0): the step must
    # be refused by name, and the weights must stay as they were. SGD (the CPU path's kind) reads
    # the norm before stepping; a fused optimizer (the GPU path) gets found_inf, skips the step
    # on the device, and the epoch raises once the pass's stats come back.
    model, _ = load_policy(tiny_dir, threads=1)
    with torch.no_grad():
        model.get_output_embeddings().weight[45, 0] = float("inf")
    before = [q.detach().clone() for q in model.parameters()]
    samples = [
        grpo.Sample([5, 6, 7], [45, 41], 1.0, 0, advantage=1.0),
        grpo.Sample([5, 6], [50, 51], 0.0, 0, advantage=-1.0),
    ]
    opt = (
        torch.optim.SGD(model.parameters(), lr=1.0)
        if optimizer == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=1.0, fused=True)
    )
    with pytest.raises(FloatingPointError, match=r"non-finite gradient norm \(nan\) in epoch 0, optimizer step 0"):
        grpo_epoch(model, None, opt, samples, TrainParams(mini_batch_size=2, kl_coef=0.0), python_rng(0, "t"), 0)
    assert all(torch.equal(a, b) or (torch.isinf(a) & torch.isinf(b)).any() for a, b in zip(before, model.parameters()))
