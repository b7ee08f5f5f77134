"""Episode loop: lockstep batching, session hygiene, trajectory bookkeeping."""

from __future__ import annotations

import pytest

import fedagent.rollout.episode as episode
from fake_env import FakeEnv, build_tiny_model
from fedagent.model.policy import load_policy
from fedagent.core.seeds import torch_generator

KW = dict(max_turns=3, max_new_tokens=6, temperature=1.0, max_prompt_tokens=512)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return load_policy(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=2), threads=1)


def test_lockstep_one_sample_call_per_turn(policy, monkeypatch):
    model, tok = policy
    calls = []
    real = episode.sample

    def spy(m, t, prompts, *a, **k):
        calls.append(len(prompts))
        return real(m, t, prompts, *a, **k)

    monkeypatch.setattr(episode, "sample", spy)
    env = FakeEnv(max_turns=10)
    trajs = episode.run_episodes(
        model, tok, env, [0, 1, 2, 3], generator=torch_generator(0, "t"), session_prefix="s", **KW
    )
    assert calls == [4, 4, 4]  # nobody wins: all 4 sessions, 3 turns
    assert [t.seed for t in trajs] == [0, 1, 2, 3]
    assert [t.task_id for t in trajs] == ["fake-000", "fake-001", "fake-002", "fake-003"]
    assert all(t.n_turns == 3 == len(t.turns) and not t.won for t in trajs)
    assert env.sessions == {}  # all closed
    assert sorted(e[1] for e in env.log if e[0] == "close") == ["s-0", "s-1", "s-2", "s-3"]
    turn = trajs[0].turns[0]
    assert turn.prompt_ids and turn.response_ids and isinstance(turn.text, str)


def test_done_sessions_leave_the_batch(policy, monkeypatch):
    model, tok = policy
    calls = []
    real = episode.sample
    monkeypatch.setattr(episode, "sample", lambda m, t, p, *a, **k: calls.append(len(p)) or real(m, t, p, *a, **k))
    # Seeds 0 and 2 win at once; the others play on.
    env = FakeEnv(max_turns=10)
    env.win_if = None
    won_sessions = {"s-0", "s-2"}
    orig_step = env.step

    def step(sid, text):
        r = orig_step(sid, text)
        if sid in won_sessions:
            r.update(reward=10.0, done=True, won=True, score=1.0)
            env.sessions[sid]["done"] = True
        return r

    env.step = step
    trajs = episode.run_episodes(
        model, tok, env, [0, 1, 2, 3], generator=torch_generator(0, "t"), session_prefix="s", **KW
    )
    assert calls == [4, 2, 2]
    assert [t.won for t in trajs] == [True, False, True, False]
    assert [t.episode_return for t in trajs] == [10.0, 0.0, 10.0, 0.0]
    assert [t.n_turns for t in trajs] == [1, 3, 1, 3]


def test_sessions_closed_when_a_step_fails(policy):
    model, tok = policy
    env = FakeEnv()

    def boom(sid, text):
        raise RuntimeError("service died")

    env.step = boom
    with pytest.raises(RuntimeError, match="service died"):
        episode.run_episodes(model, tok, env, [0, 1], generator=torch_generator(0, "t"), session_prefix="x", **KW)
    assert env.sessions == {}


def test_batched_runner_chunks_to_pool(policy):
    model, tok = policy
    env = FakeEnv(pool_size=2)
    trajs = episode.run_episodes_batched(
        model, tok, env, [0, 1, 2, 3, 4], batch_size=2, generator=torch_generator(0, "t"), session_prefix="p", **KW
    )
    assert [t.seed for t in trajs] == [0, 1, 2, 3, 4]
    assert env.sessions == {}


class BatchFakeEnv(FakeEnv):
    """FakeEnv plus the batch forms (per-session calls in order); records the step call sizes."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.batches = []
        self.phases = []

    def create_many(self, sids):
        self.phases.append(("create", len(sids)))
        return [self.create(sid) for sid in sids]

    def reset_many(self, items):
        self.phases.append(("reset", len(items)))
        return [self.reset(sid, seed) for sid, seed in items]

    def step_many(self, items):
        self.batches.append(len(items))
        return [self.step(sid, text) for sid, text in items]

    def close_many(self, sids):
        self.phases.append(("close", len(sids)))
        return [self.close(sid) for sid in sids]


def _summaries(trajs):
    return [t.summary(with_tokens=True) for t in trajs]


def _win_on_odd_length(text):
    return len(text) % 2 == 1  # some sessions finish early, so the active set shrinks


def test_step_many_path_gives_identical_trajectories(policy, monkeypatch):
    model, tok = policy
    calls = []
    real = episode.sample
    monkeypatch.setattr(episode, "sample", lambda m, t, p, *a, **k: calls.append(len(p)) or real(m, t, p, *a, **k))
    kw = dict(KW, max_turns=4)
    plain = FakeEnv(max_turns=10, win_if=_win_on_odd_length)
    batched = BatchFakeEnv(max_turns=10, win_if=_win_on_odd_length)
    a = episode.run_episodes(
        model, tok, plain, [0, 1, 2, 3, 4, 5], generator=torch_generator(0, "t"), session_prefix="s", **kw
    )
    per_turn = list(calls)
    b = episode.run_episodes(
        model, tok, batched, [0, 1, 2, 3, 4, 5], generator=torch_generator(0, "t"), session_prefix="s", **kw
    )
    assert _summaries(a) == _summaries(b)
    assert batched.batches == per_turn  # one step_many per turn, all active sessions
    assert batched.phases == [("create", 6), ("reset", 6), ("close", 6)]  # one call per phase
    assert plain.log == batched.log  # same texts, same order
    assert batched.sessions == {}


class BrokenCloseMany(BatchFakeEnv):
    """``close_many`` always fails (a broken batch route): sessions must still be closed."""

    def close_many(self, sids):
        raise ConnectionError("close_batch lost")


def test_failed_close_many_falls_back_to_closing_each_session(policy):
    model, tok = policy
    env = BrokenCloseMany(max_turns=3)
    episode.run_episodes(model, tok, env, [0, 1, 2], generator=torch_generator(0, "t"), session_prefix="s", **KW)
    assert env.sessions == {}
    assert [c[1] for c in env.log if c[0] == "close"] == ["s-0", "s-1", "s-2"]


class FailingCreateMany(BatchFakeEnv):
    """``create_many`` creates the first session, then fails: whatever it made must be closed."""

    def create_many(self, sids):
        self.create(sids[0])
        raise RuntimeError("pool borrow timed out")


def test_a_half_done_create_many_leaks_nothing(policy):
    model, tok = policy
    env = FailingCreateMany(max_turns=3)
    with pytest.raises(RuntimeError, match="timed out"):
        episode.run_episodes(model, tok, env, [0, 1], generator=torch_generator(0, "t"), session_prefix="s", **KW)
    assert env.sessions == {}


class PerSession:
    """Hides the batch forms: the loop must fall back to one call per session."""

    def __init__(self, inner):
        self.create, self.reset, self.step, self.close = inner.create, inner.reset, inner.step, inner.close


def test_service_batch_and_per_session_paths_agree(policy):
    from env_fixtures import FakeTaskSource, serve_in_thread, short_tmp
    from fedagent.envs.client import EnvClient
    from fedagent.envs.service import build_app

    model, tok = policy
    src = FakeTaskSource(5)
    app = build_app(src, "train", src.task_ids("train"), mode="index", pool_size=4, max_turns=3)
    uds = short_tmp() / "e.sock"
    with serve_in_thread(app, uds), EnvClient(uds=str(uds)) as client:
        run = lambda env, prefix: episode.run_episodes(  # noqa: E731
            model, tok, env, [3, 1, 4, 1], generator=torch_generator(0, "svc"), session_prefix=prefix, **KW
        )
        a = run(PerSession(client), "p")
        before = client.health()["counters"]
        b = run(client, "b")
        after = client.health()
    assert _summaries(a) == _summaries(b)
    # max_turns 3: one /step_batch per turn, plus one create, reset and close batch
    assert before["batches"] == 0 and after["counters"]["batches"] == 3 + 3
    assert after["counters"]["steps"] - before["steps"] == before["steps"] == 12
    assert (after["sessions"], after["pool_free"]) == (0, 4)


def test_clock_splits_the_loop_into_env_prompt_and_sample(policy):
    """Each turn's env step lands in rollout_env and its sampler call in rollout_sample (a job's timings
    say which one its rollout waits on); the trajectories are the untimed run's."""
    import time

    from fedagent.core.timing import PhaseClock

    model, tok = policy

    class SlowEnv(FakeEnv):
        def step(self, sid, text):
            time.sleep(0.05)
            return super().step(sid, text)

    def slow_sample(*a, **k):
        time.sleep(0.1)
        return episode.sample(*a, **k)

    def play(clock):
        return episode.run_episodes(
            model,
            tok,
            SlowEnv(max_turns=10),
            [0, 1],
            generator=torch_generator(0, "t"),
            session_prefix="s",
            sampler=slow_sample,
            clock=clock,
            **KW,
        )

    clock = PhaseClock()
    t0 = time.time()
    timed = play(clock)
    wall = time.time() - t0
    ph = clock.phases
    assert ph["rollout_env"] >= 3 * 2 * 0.05  # 3 turns x 2 sessions stepped one by one
    assert ph["rollout_sample"] >= 3 * 0.1  # one sampler call a turn
    assert ph["rollout_env"] < 3 * 2 * 0.05 + 3 * 0.1  # the sampler's sleep is not the env's
    assert "rollout_prompt" in ph
    assert ph["rollout_env"] + ph["rollout_sample"] + ph["rollout_prompt"] <= wall
    assert _summaries(timed) == _summaries(play(None))
