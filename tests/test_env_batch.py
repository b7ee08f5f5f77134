"""/*_batch routes: each item is exactly its single endpoint (replay, 409, 404, 422), errors stay per item."""

from __future__ import annotations

import random
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from env_fixtures import FakeTaskSource, FlakyTransport, serve_in_thread, short_tmp
from fedagent.envs.client import MAX_BATCH_ITEMS, EnvBatchError, EnvClient
from fedagent.envs.service import MAX_TEXT_CHARS, build_app

GOOD = "<think>ok</think><action>{}</action>"


def make(n=10, **kw):
    src = FakeTaskSource(n)
    kw.setdefault("pool_size", 4)
    kw.setdefault("max_turns", 5)
    return src, build_app(src, "train", src.task_ids("train"), mode="index", **kw)


def post(tc, path, body, code=200):
    r = tc.post(path, json=body)
    assert r.status_code == code, (path, r.status_code, r.text[:300])
    return r.json()


def item(sid, action, step_id):
    return {"session_id": sid, "text": GOOD.format(action), "step_id": step_id}


def open_sessions(tc, sids, reset=True):
    for i, sid in enumerate(sids):
        post(tc, "/create", {"session_id": sid})
        if reset:
            post(tc, "/reset", {"session_id": sid, "seed": i})


def counters(tc):
    return tc.get("/health").json()["counters"]


@pytest.fixture
def tc():
    _src, app = make()
    with TestClient(app) as client:
        yield client


def test_batch_items_are_steps_in_order(tc):
    open_sessions(tc, ["a", "b", "c"])
    out = post(tc, "/step_batch", {"items": [item("a", "look", 0), item("b", "win", 0), item("c", "look", 0)]})
    a, b, c = out["results"]
    assert (a["task_id"], b["task_id"], c["task_id"]) == ("fake-000", "fake-001", "fake-002")
    assert not a["won"] and b["won"] and b["done"] and b["reward"] == 10.0 and not c["won"]
    assert all(r["step_id"] == 0 and r["turns"] == 1 for r in (a, b, c))
    # the same as /step would have answered for the next id
    nxt = post(tc, "/step", item("a", "look", 1))
    assert nxt["turns"] == 2 and set(nxt) == set(a)
    assert (counters(tc)["steps"], counters(tc)["batches"]) == (4, 1)


def test_resent_batch_replays_without_stepping_again(tc):
    """A retried batch (lost response) must get the cached answers, not step the envs twice."""
    open_sessions(tc, ["a", "b"])
    body = {"items": [item("a", "look", 0), item("b", "look", 0)]}
    first = post(tc, "/step_batch", body)
    steps = counters(tc)["steps"]
    again = post(tc, "/step_batch", body)
    assert again == first
    assert counters(tc)["steps"] == steps and counters(tc)["replays"] == 2
    assert post(tc, "/step", item("a", "look", 0)) == first["results"][0]  # replay across routes
    # the next id steps for real
    assert post(tc, "/step_batch", {"items": [item("a", "look", 1)]})["results"][0]["turns"] == 2


def test_mixed_good_and_bad_items_fail_only_themselves(tc):
    open_sessions(tc, ["a", "b"])
    open_sessions(tc, ["fresh"], reset=False)
    items = [
        item("a", "look", 0),  # ok
        item("nope", "look", 0),  # unknown session
        item("b", "look", 5),  # out of order
        item("fresh", "look", 0),  # step before reset
        {"session_id": "b", "text": "x" * (MAX_TEXT_CHARS + 1), "step_id": 0},  # too long
        {"session_id": "b", "text": "x", "step_id": "0"},  # wrong type (strict)
        {"session_id": "b", "text": "x", "step_id": 0, "extra": 1},  # unknown field
        {"session_id": "a/b", "text": "x", "step_id": 0},  # bad id
        {"text": "x", "step_id": 0},  # missing field
        item("b", "win", 0),  # ok, after all the bad ones
    ]
    res = post(tc, "/step_batch", {"items": items})["results"]
    statuses = [r["error"]["status"] if "error" in r else 200 for r in res]
    assert statuses == [200, 404, 409, 409, 422, 422, 422, 422, 422, 200]
    assert all(isinstance(r["error"]["detail"], str) and r["error"]["detail"] for r in res if "error" in r)
    assert "nope" in res[1]["error"]["detail"] and "out of order" in res[2]["error"]["detail"]
    assert res[0]["turns"] == 1 and res[9]["won"]
    # a replay of a with other text is a 409 for that item only
    res = post(tc, "/step_batch", {"items": [item("a", "win", 0), item("a", "look", 1)]})["results"]
    assert res[0]["error"]["status"] == 409 and res[1]["turns"] == 2
    h = tc.get("/health").json()
    assert h["ok"] and h["sessions"] == 3 and h["counters"]["steps"] == 3


def test_one_session_twice_in_a_batch_steps_in_item_order(tc):
    open_sessions(tc, ["a"])
    res = post(tc, "/step_batch", {"items": [item("a", "look", 0), item("a", "look", 1), item("a", "win", 2)]})
    assert [r["turns"] for r in res["results"]] == [1, 2, 3] and res["results"][2]["won"]


def test_an_env_that_raises_fails_only_its_item():
    _src, app = make()
    with TestClient(app) as tc:
        open_sessions(tc, ["a", "b"])

        def boom(action):
            raise RuntimeError("env crashed")

        app.state.sessions["a"].env.step = boom
        res = post(tc, "/step_batch", {"items": [item("a", "look", 0), item("b", "look", 0)]})["results"]
        assert res[0]["error"]["status"] == 500 and "env crashed" in res[0]["error"]["detail"]
        assert res[1]["turns"] == 1


def test_batch_limits_are_4xx():
    _src, app = make(max_batch_body=200_000)
    with TestClient(app) as tc:
        open_sessions(tc, ["a"])
        over = {"items": [item("a", "look", i) for i in range(MAX_BATCH_ITEMS + 1)]}
        assert tc.post("/step_batch", json=over).status_code == 422
        for body in ({"items": []}, {"items": "a"}, {"items": [1]}, {}, {"items": [], "x": 1}):
            r = tc.post("/step_batch", json=body)
            assert r.status_code == 422 and "detail" in r.json(), body
        # 80 KiB: over the 64 KiB /step cap, fine for the batch route, 413 over its own cap
        big = [{"session_id": "a", "text": "y" * 10_000, "step_id": i} for i in range(8)]
        res = post(tc, "/step_batch", {"items": big})["results"]
        assert [r["turns"] for r in res] == list(range(1, 9))
        assert (
            tc.post(
                "/step",
                content=b'{"session_id": "a", "text": "' + b"y" * 70_000 + b'", "step_id": 8}',
                headers={"content-type": "application/json"},
            ).status_code
            == 413
        )
        huge = {"items": [{"session_id": "a", "text": "y" * 16_000, "step_id": i} for i in range(13)]}
        assert tc.post("/step_batch", json=huge).status_code == 413
        assert tc.get("/health").json()["ok"]


def test_batch_items_step_concurrently():
    src, app = make(pool_size=4)
    with TestClient(app) as tc:
        open_sessions(tc, ["a", "b", "c", "d"])
        for env in src.envs:
            env.delay = 0.2
        t0 = time.monotonic()
        post(tc, "/step_batch", {"items": [item(s, "look", 0) for s in "abcd"]})
        assert time.monotonic() - t0 < 0.6  # serial would be 0.8 s


def test_client_step_many_over_a_flaky_socket():
    """Lost /step_batch responses are retried; replays keep every session stepped once per call."""
    src, app = make(pool_size=4)
    uds = short_tmp() / "b.sock"
    with serve_in_thread(app, uds):
        flaky = FlakyTransport(
            httpx.HTTPTransport(uds=str(uds)), random.Random(7), {"/step_batch"}, before=0.2, after=0.3
        )
        with EnvClient(transport=flaky, sleep=lambda s: None) as c:
            sids = ["a", "b", "c"]
            for i, sid in enumerate(sids):
                c.create(sid)
                c.reset(sid, i)
            for turn in range(1, 5):
                res = c.step_many([(sid, GOOD.format("look")) for sid in sids])
                assert [r["turns"] for r in res] == [turn] * 3
                assert [r["step_id"] for r in res] == [turn - 1] * 3
            assert flaky.injected > 0
            h = c.health()
            assert h["counters"]["steps"] == 12
            # "ghost" is closed behind this client's back: its item fails with 404, a's counts
            c.create("ghost")
            c.reset("ghost", 0)
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(uds)), base_url="http://x") as raw:
                assert raw.post("/close", json={"session_id": "ghost"}).status_code == 200
            with pytest.raises(EnvBatchError, match="session 'ghost'") as err:
                c.step_many([("a", GOOD.format("look")), ("ghost", GOOD.format("look"))])
            assert err.value.status == 404 and err.value.session_id == "ghost"
            assert [f[:3] for f in err.value.failures] == [(1, "ghost", 404)]
            assert err.value.results[0]["turns"] == 5  # a's step counted and advanced
            assert c.step_many([("a", GOOD.format("look"))])[0]["turns"] == 6
            for sid in sids:
                c.close(sid)


def test_create_reset_close_batches_are_their_single_endpoints(tc):
    # a duplicate id in one batch (a retried item) waits for the first borrow: one env, not two
    res = post(tc, "/create_batch", {"items": [{"session_id": "a"}, {"session_id": "b"}, {"session_id": "a"}]})
    assert [r["created"] for r in res["results"]] == [True, True, False]
    h = tc.get("/health").json()
    assert (h["sessions"], h["pool_free"], h["counters"]["borrows"]) == (2, 2, 2)
    res = post(
        tc,
        "/reset_batch",
        {
            "items": [
                {"session_id": "a", "seed": 3},
                {"session_id": "ghost", "seed": 0},  # unknown session
                {"session_id": "b", "seed": -1},  # out of range
                {"session_id": "b", "seed": "1"},  # wrong type (strict)
                {"session_id": "b", "seed": 11},
            ]
        },
    )["results"]
    assert [r["error"]["status"] if "error" in r else 200 for r in res] == [200, 404, 422, 422, 200]
    assert (res[0]["task_id"], res[4]["task_id"]) == ("fake-003", "fake-001")  # seed % 10
    assert set(res[0]) == set(post(tc, "/reset", {"session_id": "a", "seed": 3}))
    assert post(tc, "/step_batch", {"items": [item("a", "look", 0), item("b", "look", 0)]})["results"][1]["turns"] == 1
    # close: idempotent per item (an unknown or repeated id is fine), every env back in the pool
    res = post(
        tc,
        "/close_batch",
        {
            "items": [
                {"session_id": "a"},
                {"session_id": "ghost"},
                {"session_id": "b"},
                {"session_id": "a"},
                {"session_id": "a/b"},
            ]
        },
    )["results"]
    assert [r.get("existed") for r in res[:4]] == [True, False, True, False] and res[4]["error"]["status"] == 422
    h = tc.get("/health").json()
    assert (h["sessions"], h["pool_free"]) == (0, 4)
    for path in ("/create_batch", "/reset_batch", "/close_batch"):
        assert tc.post(path, json={"items": []}).status_code == 422


def test_create_batch_larger_than_the_pool_is_refused_whole():
    """Without a create timeout such a batch used to wait forever; now a 409, nothing borrowed.

    (The timeout here only turns a regression into a failure instead of a hang.)"""
    _src, app = make(pool_size=2, create_timeout=3)
    with TestClient(app) as tc:
        post(tc, "/create", {"session_id": "a"})
        res = tc.post("/create_batch", json={"items": [{"session_id": s} for s in "abcd"]})
        assert res.status_code == 409 and "pool of 2" in res.json()["detail"]
        h = tc.get("/health").json()
        assert (h["sessions"], h["pool_free"]) == (1, 1)
        # "a" exists (idempotent re-create, no borrow) and "b" is new: fits the pool
        res = post(tc, "/create_batch", {"items": [{"session_id": s} for s in "aab"]})["results"]
        assert [r["created"] for r in res] == [False, False, True]
        # malformed ids are each item's own 422 (not counted as new sessions, never a 500)
        res = post(
            tc, "/create_batch", {"items": [{"session_id": ["x"]}, {"session_id": {"y": 1}}, {"session_id": 3}, {}]}
        )["results"]
        assert [r["error"]["status"] for r in res] == [422] * 4


def test_create_batch_item_times_out_while_others_hold_the_pool():
    _src, app = make(pool_size=2, create_timeout=0.3)
    with TestClient(app) as tc:
        post(tc, "/create", {"session_id": "x"})
        res = post(tc, "/create_batch", {"items": [{"session_id": s} for s in "ab"]})["results"]
        assert [r["error"]["status"] if "error" in r else 200 for r in res] == [200, 503]
        post(tc, "/close_batch", {"items": [{"session_id": s} for s in "abx"]})
        h = tc.get("/health").json()
        assert (h["sessions"], h["pool_free"]) == (0, 2)


def test_client_batch_lifecycle_over_a_flaky_socket():
    """Lost create/reset/close batch responses are retried without a second borrow or a leak."""
    src, app = make(pool_size=4)
    uds = short_tmp() / "l.sock"
    with serve_in_thread(app, uds):
        flaky = FlakyTransport(
            httpx.HTTPTransport(uds=str(uds)),
            random.Random(3),
            {"/create_batch", "/reset_batch", "/close_batch"},
            before=0.3,
            after=0.3,
        )
        with EnvClient(transport=flaky, sleep=lambda s: None) as c:
            for rnd in range(6):
                sids = [f"r{rnd}-{i}" for i in range(4)]
                c.create_many(sids)
                res = c.reset_many([(sid, i + rnd) for i, sid in enumerate(sids)])
                assert [r["task_id"] for r in res] == [f"fake-{(i + rnd) % 10:03d}" for i in range(4)]
                assert [r["turns"] for r in c.step_many([(sid, GOOD.format("look")) for sid in sids])] == [1] * 4
                c.close_many(sids)
            assert flaky.injected > 0
            h = c.health()
            assert (h["sessions"], h["pool_free"], h["counters"]["borrows"]) == (0, 4, 24)
            with pytest.raises(EnvBatchError, match="/reset_batch.*session 'ghost'"):
                c.reset_many([("ghost", 0)])
            with pytest.raises(ValueError, match="appears twice"):
                c.create_many(["x", "x"])
