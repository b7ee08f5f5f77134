"""The Ray worker hook that salts verl's IPC socket names with the job tag (FACTS §8)."""

from __future__ import annotations

import pytest

from fedagent.train.verl import ray_hook


def _call_from(module_name: str, fn):
    return eval("fn(None)", {"__name__": module_name, "fn": fn})


def test_only_verl_callers_see_the_salted_id():
    fn = ray_hook.salted_get_job_id(lambda self: "01000000", "fa-r001-c0-9-abc")
    assert _call_from("verl.workers.rollout.vllm_rollout.vllm_rollout", fn) == "01000000-fa-r001-c0-9-abc"
    assert _call_from("verl", fn) == "01000000-fa-r001-c0-9-abc"
    assert _call_from("ray._private.worker", fn) == "01000000"
    assert _call_from("verlish", fn) == "01000000"


def test_install_is_idempotent_and_fails_closed(monkeypatch):
    pytest.importorskip("ray")
    from ray.runtime_context import RuntimeContext

    original = RuntimeContext.get_job_id
    try:
        monkeypatch.delenv(ray_hook.TAG_ENV, raising=False)
        with pytest.raises(RuntimeError, match="unsalted"):
            ray_hook.install()
        assert ray_hook.install("t1") == "t1"
        first = RuntimeContext.get_job_id
        assert ray_hook.install("t1") == "t1" and RuntimeContext.get_job_id is first  # no double wrap
        ray_hook.install("t2")  # re-tag wraps the original
        assert RuntimeContext.get_job_id.__wrapped__ is original
        monkeypatch.setenv(ray_hook.TAG_ENV, "t3")
        ray_hook.setup()
        assert getattr(RuntimeContext.get_job_id, "_fedagent_salted") == "t3"
    finally:
        RuntimeContext.get_job_id = original
