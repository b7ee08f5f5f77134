"""EnvClient: retries transport errors only, bounded backoff, step_id advances on success."""

from __future__ import annotations

import httpx
import pytest

from fedagent.envs.client import (
    BACKOFF_CAP,
    JITTER,
    MAX_BATCH_ITEMS,
    MAX_RETRIES,
    EnvBatchError,
    EnvClient,
    EnvServiceError,
)


class Scripted(httpx.BaseTransport):
    """Answers from a script: an exception class to raise, or (status, json)."""

    def __init__(self, script):
        self.script = list(script)
        self.requests = []

    def handle_request(self, request):
        self.requests.append((request.url.path, request.read()))
        item = self.script.pop(0) if self.script else (200, {"ok": True})
        if isinstance(item, type) and issubclass(item, Exception):
            raise item("scripted", request=request)
        status, body = item
        return httpx.Response(status, json=body)


def client(script, **kw):
    sleeps = []
    t = Scripted(script)
    return EnvClient(transport=t, sleep=sleeps.append, **kw), t, sleeps


def test_transport_errors_are_retried_with_bounded_backoff():
    c, t, sleeps = client([httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError, (200, {"ok": 1})])
    assert c.health() == {"ok": 1}
    assert len(t.requests) == 4 and c.retries == 3
    for k, s in enumerate(sleeps):
        base = min(0.3 * 2**k, BACKOFF_CAP)
        assert base <= s <= base + JITTER


def test_backoff_is_capped_and_retries_are_bounded():
    c, t, sleeps = client([httpx.ConnectError] * 20)
    with pytest.raises(ConnectionError):
        c.health()
    assert len(t.requests) == MAX_RETRIES + 1 == 9
    assert max(sleeps) <= BACKOFF_CAP + JITTER and min(sleeps[4:]) >= BACKOFF_CAP


@pytest.mark.parametrize("status", [400, 404, 409, 413, 422, 500, 503])
def test_http_status_errors_are_never_retried(status):
    c, t, _ = client([(status, {"detail": "no"})])
    with pytest.raises(EnvServiceError) as err:
        c.health()
    assert err.value.status == status and len(t.requests) == 1


def test_step_id_advances_only_on_success():
    ok = (200, {"ok": True})
    c, t, _ = client([ok, (409, {"detail": "x"}), httpx.ReadError, ok, ok])
    c.reset("a", 3)
    with pytest.raises(EnvServiceError):
        c.step("a", "t")  # 409: not advanced
    c.step("a", "t")  # ReadError then ok: same id re-sent
    c.step("a", "t")
    import json

    ids = [json.loads(b)["step_id"] for p, b in t.requests if p == "/step"]
    assert ids == [0, 0, 0, 1]


def test_session_context_closes_even_when_create_fails():
    c, t, _ = client([(503, {"detail": "busy"}), (200, {"ok": True})])
    with pytest.raises(EnvServiceError):
        with c.session("a"):
            pass
    assert [p for p, _ in t.requests] == ["/create", "/close"]


def test_close_is_retried():
    c, t, _ = client([httpx.ConnectError, httpx.ReadError, (200, {"ok": True, "session_id": "a"})])
    assert c.close("a")["ok"]
    assert [p for p, _ in t.requests] == ["/close"] * 3


def test_needs_exactly_one_address():
    with pytest.raises(ValueError):
        EnvClient()
    with pytest.raises(ValueError):
        EnvClient(uds="/tmp/x", base_url="http://127.0.0.1:1")


def _batch_bodies(t):
    import json

    return [json.loads(b)["items"] for p, b in t.requests if p == "/step_batch"]


def test_step_many_retries_transport_errors_and_advances_only_succeeded_items():
    ok = (200, {"ok": True})
    r = {"turns": 1}
    err = {"error": {"status": 409, "detail": "out of order"}}
    c, t, _ = client([ok, ok, httpx.ReadError, (200, {"results": [r, err]}), (200, {"results": [r, r]})])
    c.reset("a", 0)
    c.reset("b", 0)
    with pytest.raises(EnvBatchError, match="session 'b'.*out of order") as e:
        c.step_many([("a", "x"), ("b", "y")])
    assert e.value.status == 409 and e.value.session_id == "b" and e.value.results == [r, err]
    assert c.step_many([("a", "x2"), ("b", "y")]) == [r, r]
    bodies = _batch_bodies(t)
    assert bodies[0] == bodies[1]  # the retry re-sent the same ids
    assert [(i["session_id"], i["step_id"]) for i in bodies[2]] == [("a", 1), ("b", 0)]
    assert c.retries == 1


def test_step_many_refuses_unreset_and_duplicate_sessions():
    c, t, _ = client([(200, {"ok": True})])
    c.reset("a", 0)
    with pytest.raises(RuntimeError, match="'z'"):
        c.step_many([("a", "x"), ("z", "x")])
    with pytest.raises(ValueError, match="twice"):
        c.step_many([("a", "x"), ("a", "y")])
    assert _batch_bodies(t) == []


def test_step_many_splits_at_the_item_limit():
    n = MAX_BATCH_ITEMS + 3

    class Echo(httpx.BaseTransport):
        def __init__(self):
            self.sizes = []

        def handle_request(self, request):
            import json

            if request.url.path != "/step_batch":
                return httpx.Response(200, json={"ok": True})
            items = json.loads(request.read())["items"]
            self.sizes.append(len(items))
            return httpx.Response(200, json={"results": [{"sid": i["session_id"]} for i in items]})

    t = Echo()
    c = EnvClient(transport=t)
    sids = [f"s{i}" for i in range(n)]
    for sid in sids:
        c.reset(sid, 0)
    assert [r["sid"] for r in c.step_many([(s, "x") for s in sids])] == sids
    assert t.sizes == [MAX_BATCH_ITEMS, 3]
