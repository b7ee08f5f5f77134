"""The first rollout batch prefetched while a train job starts (fedagent.rollout.prefetch)."""

from __future__ import annotations

import hashlib
import threading

import pytest

from fake_env import FakeEnv, Pending, build_tiny_model
from fedagent.rollout.prefetch import PrefetchedEnv
from fedagent.train.local import TrainParams, train_client

PARAMS = {
    "epochs": 2,
    "groups_per_epoch": 2,
    "group_size": 2,
    "max_turns": 2,
    "max_new_tokens": 4,
    "mini_batch_size": 4,
    "micro_batch_size": 2,
    "pool_size": 3,
    "lr": 1e-3,
    "max_prompt_tokens": 256,
}


class BatchFake(FakeEnv):
    """FakeEnv with the env client's batch calls; logs every call and the thread it came from."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def _log(self, name, arg):
        self.calls.append((name, arg, threading.current_thread().name))

    def create_many(self, sids):
        self._log("create_many", tuple(sids))
        return [self.create(s) for s in sids]

    def reset_many(self, pairs):
        self._log("reset_many", tuple(pairs))
        return [self.reset(s, seed) for s, seed in pairs]

    def step_many(self, pairs):
        self._log("step_many", len(pairs))
        return [self.step(s, t) for s, t in pairs]

    def close_many(self, sids):
        self._log("close_many", tuple(sids))
        return [self.close(s) for s in sids]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=5)


def _digest(d):
    return hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()


def test_prefetched_first_batch_changes_no_byte_and_no_call(tiny_dir, tmp_path):
    """Same update, and the service sees the same calls in the same order; only the first batch's
    create and reset come from the prefetch thread (3 rollouts of 4 per epoch fit one pool of 3:
    the epoch has two batches, only the first is prefetched)."""
    p = TrainParams.from_dict(PARAMS)
    plain, pre = BatchFake(mode="draw"), BatchFake(mode="draw")
    train_client(tiny_dir, tiny_dir, plain, round=1, client=0, params=p, threads=1, out_dir=tmp_path / "a")
    train_client(tiny_dir, tiny_dir, Pending(pre), round=1, client=0, params=p, threads=1, out_dir=tmp_path / "b")
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert [c[:2] for c in plain.calls] == [c[:2] for c in pre.calls]
    threads = [(c[0], c[2]) for c in pre.calls if c[2] != "MainThread"]
    assert threads == [("create_many", "env-prefetch"), ("reset_many", "env-prefetch")]
    assert pre.calls[0][1] == ("r1-c0-e0-b0-0", "r1-c0-e0-b0-1", "r1-c0-e0-b0-2")


def test_a_batch_other_than_the_prefetched_one_gets_its_envs_back_first():
    """Were the rollout to ask for other sessions, the prefetched ones are closed before the new
    create (a full pool would otherwise wait for ever), and the stale resets are never served."""
    env = BatchFake(mode="draw")
    served = PrefetchedEnv(Pending(env), ["x-0", "x-1"], [7, 8]).ready()
    served.create_many(["y-0"])
    assert [c[:2] for c in env.calls][-2:] == [("close_many", ("x-0", "x-1")), ("create_many", ("y-0",))]
    out = served.reset_many([("x-0", 7), ("x-1", 8)])
    assert env.calls[-1][0] == "reset_many" and len(out) == 2


def test_the_prefetch_error_reaches_the_job():
    class Broken:
        def ready(self):
            raise RuntimeError("service never came up")

    with pytest.raises(RuntimeError, match="never came up"):
        PrefetchedEnv(Broken(), ["s-0"], [1]).ready()


def test_an_env_without_batch_calls_is_passed_through():
    env = FakeEnv(mode="draw")
    assert PrefetchedEnv(Pending(env), ["s-0"], [1]).ready() is env


def test_reference_read_in_the_background_is_the_model_a_reload_gives(tmp_path):
    """Rounds ≥ 2: the reference (another model) is read in a thread and filled into a copy of the
    policy module; its log-probs equal those of the model loaded the old way, and a reference whose
    bytes do not match its manifest stops the job."""
    import shutil

    import torch

    from fedagent.model.policy import load_policy
    from fedagent.train import grpo, local

    start = build_tiny_model(tmp_path / "start", seed=5)
    ref_dir = build_tiny_model(tmp_path / "ref", seed=6)
    policy, _ = load_policy(start, threads=1)
    ref = __import__("copy").deepcopy(policy)
    local._fill(ref, local._read_tensors_async(ref_dir, True).result(), ref_dir)
    want, _ = load_policy(ref_dir, threads=1)
    samples = [grpo.Sample([5, 6, 7], [8, 9], 1.0, 0)]
    with torch.no_grad():
        a = grpo.response_logprobs(ref, samples, temperature=1.0)[0]
        b = grpo.response_logprobs(want, samples, temperature=1.0)[0]
        c = grpo.response_logprobs(policy, samples, temperature=1.0)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert ref.get_output_embeddings().weight is ref.get_input_embeddings().weight
    # A merged round's model dir also holds server_state.safetensors (the server optimizer's
    # state): only the model's own weight files are read.
    merged = tmp_path / "merged"
    shutil.copytree(ref_dir, merged)
    from safetensors.torch import save_file

    save_file({"exp_avg.model.norm.weight": torch.zeros(3)}, str(merged / "server_state.safetensors"))
    ref2 = __import__("copy").deepcopy(policy)
    local._fill(ref2, local._read_tensors_async(merged, False).result(), merged)
    with torch.no_grad():
        assert torch.equal(grpo.response_logprobs(ref2, samples, temperature=1.0)[0], b)
    bad = tmp_path / "bad"
    shutil.copytree(ref_dir, bad)
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[-3] ^= 1
    (bad / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(Exception, match="model.safetensors"):
        local._read_tensors_async(bad, True).result()
