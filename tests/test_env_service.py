"""Service protocol: idempotent create/close, step ids, seed → task, no-op turns, bad input."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from env_fixtures import FakeTaskSource, serve_in_thread, short_tmp
from fedagent.envs.client import EnvClient, EnvServiceError
from fedagent.envs.service import build_app, task_for_seed

GOOD = "<think>ok</think><action>{}</action>"


def make(n=10, **kw):
    src = FakeTaskSource(n)
    kw.setdefault("pool_size", 2)
    kw.setdefault("max_turns", 5)
    app = build_app(src, "train", src.task_ids("train"), **kw)
    return src, app


@pytest.fixture
def tc():
    src, app = make()
    with TestClient(app) as client:
        yield client


def post(tc, path, body, code=200):
    r = tc.post(path, json=body)
    assert r.status_code == code, (path, body, r.status_code, r.text)
    return r.json()


def health(tc):
    return tc.get("/health").json()


def test_create_is_idempotent_and_close_returns_env(tc):
    assert post(tc, "/create", {"session_id": "a"})["created"] is True
    assert post(tc, "/create", {"session_id": "a"})["created"] is False
    h = health(tc)
    assert (h["pool_free"], h["sessions"], h["counters"]["borrows"]) == (1, 1, 1)
    assert post(tc, "/close", {"session_id": "a"})["existed"] is True
    assert post(tc, "/close", {"session_id": "a"})["existed"] is False
    assert post(tc, "/close", {"session_id": "never"})["ok"] is True
    h = health(tc)
    assert (h["pool_free"], h["sessions"]) == (2, 0)


def test_seed_to_task_is_pure():
    tasks = [f"t{i}" for i in range(7)]
    assert [task_for_seed(tasks, s, "index") for s in range(9)] == [tasks[s % 7] for s in range(9)]
    draws = [task_for_seed(tasks, s, "draw") for s in range(50)]
    state = random.getstate()
    assert draws == [task_for_seed(tasks, s, "draw") for s in range(50)]
    assert random.getstate() == state  # no global RNG touched
    assert draws == [tasks[random.Random(s).randrange(7)] for s in range(50)]
    assert len(set(draws)) > 3  # draws spread over the tasks


def test_reset_maps_seed_in_index_mode_and_zeroes_steps():
    _src, app = make(mode="index")
    with TestClient(app) as tc:
        post(tc, "/create", {"session_id": "a"})
        assert post(tc, "/reset", {"session_id": "a", "seed": 13})["task_id"] == "fake-003"
        post(tc, "/step", {"session_id": "a", "text": GOOD.format("look"), "step_id": 0})
        r = post(tc, "/reset", {"session_id": "a", "seed": 4})
        assert r["task_id"] == "fake-004" and r["task_type"] == "fake"
        assert post(tc, "/step", {"session_id": "a", "text": GOOD.format("look"), "step_id": 0})["turns"] == 1


def test_reset_names_the_sources_prompt_family():
    src, app = make(mode="index")
    with TestClient(app) as tc:
        post(tc, "/create", {"session_id": "a"})
        assert post(tc, "/reset", {"session_id": "a", "seed": 1})["prompt_template"] == "textworld"
        res = post(tc, "/reset_batch", {"items": [{"session_id": "a", "seed": 2}]})["results"]
        assert res[0]["prompt_template"] == "textworld"
    src.prompt_template = "alfworld"
    with TestClient(build_app(src, "train", src.task_ids("train"), pool_size=1)) as tc:
        post(tc, "/create", {"session_id": "a"})
        assert post(tc, "/reset", {"session_id": "a", "seed": 1})["prompt_template"] == "alfworld"
    src.prompt_template = "tw"
    with pytest.raises(ValueError, match="prompt_template"):  # a source must name a known family
        build_app(src, "train", src.task_ids("train"))


def test_step_ids_replay_and_conflict(tc):
    post(tc, "/create", {"session_id": "a"})
    post(tc, "/reset", {"session_id": "a", "seed": 1})
    first = post(tc, "/step", {"session_id": "a", "text": GOOD.format("look"), "step_id": 0})
    replay = post(tc, "/step", {"session_id": "a", "text": GOOD.format("look"), "step_id": 0})
    assert replay == first
    assert health(tc)["counters"]["steps"] == 1  # the replay did not step the env again
    post(tc, "/step", {"session_id": "a", "text": GOOD.format("look"), "step_id": 0 + 5}, 409)
    post(tc, "/step", {"session_id": "a", "text": GOOD.format("win"), "step_id": 0}, 409)  # same id, other text
    second = post(tc, "/step", {"session_id": "a", "text": GOOD.format("win"), "step_id": 1})
    assert second["won"] and second["done"] and second["reward"] == 10.0 and second["step_id"] == 1
    post(tc, "/step", {"session_id": "a", "text": GOOD.format("look"), "step_id": 0}, 409)  # older id


@pytest.fixture
def tc_noop():
    src, app = make(projection="noop")
    with TestClient(app) as client:
        yield client


def test_invalid_answer_is_a_noop_that_costs_budget(tc_noop):
    """rollout.projection noop (the former behaviour): an invalid answer never reaches the env."""
    tc = tc_noop
    post(tc, "/create", {"session_id": "a"})
    obs = post(tc, "/reset", {"session_id": "a", "seed": 2})["observation"]
    for i in range(4):
        r = post(tc, "/step", {"session_id": "a", "text": "win (no tags)", "step_id": i})
        assert (r["is_action_valid"], r["reward"], r["observation"], r["done"]) == (False, 0.0, obs, False)
    r = post(tc, "/step", {"session_id": "a", "text": "<action>win</action>", "step_id": 4})  # no <think>
    assert r["is_action_valid"] is False and r["action"] == "win" and r["done"] is True  # budget 5 used
    assert health(tc)["counters"]["steps"] == 5
    r = post(tc, "/step", {"session_id": "a", "text": GOOD.format("win"), "step_id": 5})
    assert r["done"] and r["reward"] == 0.0 and not r["won"]  # nothing to earn after the end


def test_step_before_reset_and_unknown_session(tc):
    post(tc, "/create", {"session_id": "a"})
    post(tc, "/step", {"session_id": "a", "text": "x", "step_id": 0}, 409)
    post(tc, "/reset", {"session_id": "nope", "seed": 0}, 404)
    post(tc, "/step", {"session_id": "nope", "text": "x", "step_id": 0}, 404)


def test_token_required_when_set():
    _src, app = make(token="s3cret")
    with TestClient(app) as tc:
        assert tc.get("/health").status_code == 401
        assert tc.get("/health", headers={"x-fedagent-token": "wrong"}).status_code == 401
        assert tc.get("/health", headers={"x-fedagent-token": "s3cret"}).json()["ok"]


def test_malformed_requests_are_4xx_and_service_stays_healthy():
    """Issue 3 must-show 2: >= 20 malformed requests, every one a 4xx, then still healthy."""
    _src, app = make()
    bad = [
        ("/create", b"{not json"),
        ("/create", b"[]"),
        ("/create", b'"a"'),
        ("/create", b"{}"),
        ("/create", b'{"session_id": 5}'),
        ("/create", b'{"session_id": ""}'),
        ("/create", b'{"session_id": "a/b"}'),
        ("/create", b'{"session_id": "' + b"x" * 200 + b'"}'),
        ("/create", b'{"session_id": "a", "extra": 1}'),
        ("/create", b'{"session_id": null}'),
        ("/reset", b'{"session_id": "s", "seed": "1"}'),
        ("/reset", b'{"session_id": "s", "seed": -1}'),
        ("/reset", b'{"session_id": "s", "seed": 1.5}'),
        ("/reset", b'{"session_id": "s", "seed": 99999999999999999999999}'),
        ("/reset", b'{"session_id": "s"}'),
        ("/reset", b'{"session_id": "unknown", "seed": 1}'),
        ("/step", b'{"session_id": "s", "text": 3, "step_id": 0}'),
        ("/step", b'{"session_id": "s", "text": "x", "step_id": "0"}'),
        ("/step", b'{"session_id": "s", "text": "x", "step_id": -1}'),
        ("/step", b'{"session_id": "s", "text": "x"}'),
        ("/step", b'{"session_id": "s", "text": "' + b"a" * 20000 + b'", "step_id": 0}'),
        ("/step", b'{"session_id": "s", "text": "x", "step_id": 7}'),  # out of order
        ("/step", b'{"session_id": "unknown", "text": "x", "step_id": 0}'),
        ("/step", b'{"session_id": "s", "text": "x", "step_id": 0}' + b" " * 70000),  # > 64 KiB
        ("/close", b'{"session_id": ["s"]}'),
        ("/nowhere", b"{}"),
    ]
    with TestClient(app, raise_server_exceptions=False) as tc:
        post(tc, "/create", {"session_id": "s"})
        post(tc, "/reset", {"session_id": "s", "seed": 0})
        codes = []
        for path, body in bad:
            r = tc.post(path, content=body, headers={"content-type": "application/json"})
            codes.append((path, r.status_code))
            assert 400 <= r.status_code < 500, (path, body[:80], r.status_code, r.text[:300])
            assert "detail" in r.json()
        assert tc.get("/create").status_code == 405
        assert dict(codes).get("/nowhere") == 404
        assert len(bad) >= 20
        # Replayed and out-of-order ids did not disturb the session.
        r = post(tc, "/step", {"session_id": "s", "text": GOOD.format("win"), "step_id": 0})
        assert r["won"]
        h = health(tc)
        assert h["ok"] and h["sessions"] == 1 and h["pool_free"] == 1


def test_chunked_body_over_limit_is_413():
    _src, app = make(max_body=1024)
    with TestClient(app) as tc:

        def chunks():
            yield b'{"session_id": "s", "text": "'
            for _ in range(10):
                yield b"a" * 200
            yield b'", "step_id": 0}'

        r = tc.post("/step", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert tc.get("/health").json()["ok"]


def test_concurrent_duplicate_create_waits_for_first_borrow():
    """A create blocked on an empty pool + its retries borrow exactly one env."""
    src, app = make(pool_size=1)
    uds = short_tmp() / "s.sock"
    with serve_in_thread(app, uds), EnvClient(uds=str(uds)) as c:
        c.create("holder")  # pool now empty
        results = []
        threads = [threading.Thread(target=lambda: results.append(c.create("dup"))) for _ in range(5)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        h = c.health()
        assert h["sessions"] == 2 and h["pool_free"] == 0 and not results  # all waiting
        c.close("holder")
        for t in threads:
            t.join(10)
        assert sorted(r["created"] for r in results) == [False] * 4 + [True]
        h = c.health()
        assert h["counters"]["borrows"] == 2 and h["pool_free"] == 0 and h["sessions"] == 1
        c.close("dup")
        assert c.health()["pool_free"] == 1


def test_close_while_create_waits_returns_env_to_pool():
    src, app = make(pool_size=1)
    uds = short_tmp() / "s.sock"
    with serve_in_thread(app, uds), EnvClient(uds=str(uds)) as c:
        c.create("holder")
        errors = []

        def waiter():
            try:
                c.create("w")
            except EnvServiceError as exc:
                errors.append(exc.status)

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.2)
        c.close("w")  # closed before it ever got an env
        c.close("holder")
        t.join(10)
        assert errors == [409]
        h = c.health()
        assert (h["pool_free"], h["sessions"]) == (1, 0)


def test_create_timeout_gives_503_and_frees_the_reservation():
    _src, app = make(pool_size=1, create_timeout=0.2)
    uds = short_tmp() / "s.sock"
    with serve_in_thread(app, uds), EnvClient(uds=str(uds)) as c:
        c.create("holder")
        with pytest.raises(EnvServiceError) as err:
            c.create("late")
        assert err.value.status == 503
        assert c.health()["sessions"] == 1
        c.close("holder")
        assert c.create("late")["created"] is True


def test_client_aborted_mid_step_never_double_steps():
    """A client that gives up mid-step and re-sends the same step_id gets the cached answer."""
    src, app = make(pool_size=1)
    src.delay = 0.0
    uds = short_tmp() / "s.sock"
    with serve_in_thread(app, uds), EnvClient(uds=str(uds)) as c:
        c.create("a")
        c.reset("a", 0)
        for env in src.envs:
            env.delay = 0.5  # the step outlives the client's patience
        impatient = httpx.Client(transport=httpx.HTTPTransport(uds=str(uds)), base_url="http://x", timeout=0.1)
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/step", json={"session_id": "a", "text": GOOD.format("look"), "step_id": 0})
        impatient.close()
        r = c.step("a", GOOD.format("look"))  # step_id 0 again: waits, then replays
        assert r["step_id"] == 0 and r["turns"] == 1
        assert sum(e.steps for e in src.envs) == 1
        c.close("a")


def test_envs_in_worker_processes():
    """env_procs=K: the same protocol with envs hosted in K worker processes."""
    src, app = make(pool_size=3, env_procs=2)
    from fedagent.envs.pool import RemoteEnv

    with TestClient(app) as tc:
        envs = app.state.pool()._free
        assert all(isinstance(e, RemoteEnv) for e in envs) and len({id(e.worker) for e in envs}) == 2
        procs = [e.worker.proc for e in envs]
        for sid in ("a", "b", "c"):
            post(tc, "/create", {"session_id": sid})
            assert post(tc, "/reset", {"session_id": sid, "seed": 3})["task_id"] in src.ids
        r = post(tc, "/step", {"session_id": "b", "text": GOOD.format("win"), "step_id": 0})
        assert r["won"] and r["reward"] == 10.0
        for sid in ("a", "b", "c"):
            post(tc, "/close", {"session_id": sid})
        assert health(tc)["pool_free"] == 3
    for p in procs:  # workers stop with the service
        p.join(10)
        assert not p.is_alive()


def test_create_has_no_read_timeout():
    """A create that waits longer than the client's normal timeout still succeeds."""
    _src, app = make(pool_size=1)
    uds = short_tmp() / "s.sock"
    with serve_in_thread(app, uds), EnvClient(uds=str(uds), timeout=0.2, max_retries=0) as c:
        c.create("holder")
        out = []
        t = threading.Thread(target=lambda: out.append(c.create("late")))
        t.start()
        time.sleep(0.6)  # three read timeouts' worth of waiting
        c.close("holder")
        t.join(10)
        assert out and out[0]["created"] is True
        c.close("late")


def test_action_answer_format_needs_no_think_block():
    # rollout.answer_format=action: "<action>x</action>" alone is a valid turn that steps the env;
    # the default think_action format treats it as invalid (executed under the reference projection,
    # a no-op under noop: tests below and above).
    src, app = make(answer_format="action")
    with TestClient(app) as client:
        post(client, "/create", {"session_id": "a"})
        post(client, "/reset", {"session_id": "a", "seed": 2})
        r = post(client, "/step", {"session_id": "a", "text": "<action>win</action>", "step_id": 0})
        assert r["is_action_valid"] is True and r["won"] is True and r["reward"] > 0
        post(client, "/create", {"session_id": "b"})
        post(client, "/reset", {"session_id": "b", "seed": 2})
        r = post(client, "/step", {"session_id": "b", "text": "win, no tags", "step_id": 0})
        assert r["is_action_valid"] is False and r["reward"] == 0.0
        assert r["observation"].endswith("you said win, no tags")  # reference projection: the tail was sent


def _step_texts(app, texts, seed=2):
    with TestClient(app) as client:
        post(client, "/create", {"session_id": "a"})
        post(client, "/reset", {"session_id": "a", "seed": seed})
        return [post(client, "/step", {"session_id": "a", "text": t, "step_id": i}) for i, t in enumerate(texts)]


def test_reference_projection_executes_a_format_error_and_sends_the_tail():
    """FACTS §4, Projection (the default, rollout.projection reference): an answer missing <think> or
    carrying CJK text is invalid (penalised in training) but its tagged action is executed; an answer
    without action tags sends its last 30 characters (TextWorld, ALFWorld) or 20 (WebShop). Seen
    failing on the old service, which made every invalid answer a no-op."""
    src, app = make()
    r = _step_texts(
        app,
        [
            "<action>Look</action>",
            "<think>\u597d</think><action>look</action>",
            "I would now go to the kitchen and win",
            "<action>win</action>",
        ],
    )
    assert [x["is_action_valid"] for x in r] == [False] * 4
    task = r[0]["task_id"]
    assert r[0]["observation"] == f"{task}: you said look" and r[0]["action"] == "look"  # no <think>: executed
    assert r[1]["observation"] == f"{task}: you said look"  # CJK: executed
    tail = "I would now go to the kitchen and win"[-30:].strip().lower()
    assert r[2]["action"] == tail and r[2]["observation"] == f"{task}: you said {tail}"
    assert r[3]["won"] and r[3]["reward"] == 10.0 and r[3]["done"]  # a tagged action without <think> wins
    src.prompt_template = "webshop"
    ws = build_app(src, "train", src.task_ids("train"), pool_size=1, max_turns=5)
    r = _step_texts(ws, ["please search for a red shoe then click[buy now]"])
    assert r[0]["action"] == "please search for a red shoe then click[buy now]"[-20:].strip().lower()
    assert r[0]["observation"].endswith("you said " + r[0]["action"])
    src.prompt_template = "textworld"
    noop = build_app(src, "train", src.task_ids("train"), pool_size=1, max_turns=5, projection="noop")
    r = _step_texts(noop, ["<action>win</action>"])
    assert not r[0]["won"] and not r[0]["observation"].endswith("you said win")
    with pytest.raises(ValueError, match="rollout.projection"):
        build_app(src, "train", src.task_ids("train"), projection="skip")
    with pytest.raises(ValueError, match="answer_format"):
        make(answer_format="free_text")


def test_forked_env_workers_die_with_a_killed_service(tmp_path):
    """A single-threaded service forks its env workers (fast: nothing re-imported), and each
    closes its copies of the service's pipe ends, so a SIGKILLed service still ends them all."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from env_fixtures import FakeTaskSource\n"
        "from fedagent.envs.pool import default_start_method, process_envs\n"
        "method = default_start_method()\n"
        "envs, workers = process_envs(FakeTaskSource(4), 5, 4, 3)\n"
        "print(method, *[w.proc.pid for w in workers], flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        method, *pids = proc.stdout.readline().split()
        assert method == "fork" and len(pids) == 3
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    alive = [int(p) for p in pids]
    while alive and time.monotonic() < deadline:
        alive = [
            p
            for p in alive
            if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split(")")[-1].split()[0] != "Z"
        ]
        time.sleep(0.05)
    assert not alive, f"env workers {alive} outlived their killed service"


def test_serving_in_a_thread_leaves_the_test_process_logging_alone():
    """The fixture's uvicorn must not reconfigure this process's logging: a dictConfig closes every handler,
    and absl's (imported with dp_accounting) closes its stream with it, pytest's capture file when a test
    holding capsys serves an app; every later test of that worker then erred ("I/O operation on closed
    file"). A handler on the root logger stays open and attached."""
    import logging

    class Probe(logging.Handler):
        closed = False

        def close(self):
            self.closed = True
            super().close()

    probe = Probe()
    logging.getLogger().addHandler(probe)
    try:
        src, app = make()
        uds = short_tmp() / "s.sock"
        with serve_in_thread(app, uds), EnvClient(uds=str(uds)) as c:
            assert c.health()["ok"]
        assert not probe.closed and probe in logging.getLogger().handlers
    finally:
        logging.getLogger().removeHandler(probe)
