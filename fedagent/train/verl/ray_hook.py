"""Ray ``worker_process_setup_hook`` of a fedagent verl job: salt verl's IPC socket names.

verl 0.9.1 names the weight-transfer socket between the FSDP trainer and vLLM
``/tmp/rl-colocate-zmq-<ray job id>-replica-<r>-rank-<k>.sock``. The Ray job id of the
first driver of a fresh cluster is always ``01000000``, so two isolated jobs on one host
would bind the same path (FACTS §8: a reused id deadlocked weight sync and stale sockets
killed later rounds). This hook runs in every Ray worker of the job before any task and
makes ``RuntimeContext.get_job_id()`` answer ``<ray job id>-<job tag>`` to callers in the
``verl`` package only (Ray's own callers keep the real id). vLLM's worker process reads
the salted id from ``VERL_RAY_JOB_ID``, which verl's server sets from the same call.

Fail closed: a missing tag or a Ray without ``RuntimeContext.get_job_id`` is an error
(the worker dies; an unsalted run would be the collision this prevents).
"""

from __future__ import annotations

import os
import sys

TAG_ENV = "FEDAGENT_VERL_JOB_TAG"
_MARK = "_fedagent_salted"


def salted_get_job_id(original, tag: str):
    """A ``get_job_id`` that appends ``-<tag>`` when called from a ``verl.*`` module."""

    def get_job_id(self):
        real = original(self)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller == "verl" or caller.startswith("verl."):
            return f"{real}-{tag}"
        return real

    setattr(get_job_id, _MARK, tag)
    get_job_id.__wrapped__ = original
    return get_job_id


def install(tag: str | None = None) -> str:
    """Patch ``ray.runtime_context.RuntimeContext.get_job_id`` (idempotent); returns the tag."""
    tag = tag or os.environ.get(TAG_ENV, "")
    if not tag:
        raise RuntimeError(f"{TAG_ENV} is not set: refusing to run verl with unsalted IPC socket names")
    from ray.runtime_context import RuntimeContext

    current = getattr(RuntimeContext, "get_job_id", None)
    if current is None:
        raise RuntimeError("ray.runtime_context.RuntimeContext.get_job_id is missing: cannot salt verl's IPC names")
    if getattr(current, _MARK, None) == tag:
        return tag
    RuntimeContext.get_job_id = salted_get_job_id(getattr(current, "__wrapped__", current), tag)
    return tag


def setup() -> None:
    """The hook Ray calls in each worker process (``runtime_env.worker_process_setup_hook``).

    A PPO job also sets ``FEDAGENT_VERL_CRITIC_LOSS`` (fedagent.train.verl.critic_loss): its critic
    loss is armed here, in the process that will import verl's trainer (fails closed), and so is its
    critic's attention implementation (fedagent.train.verl.critic_attn: the model config's, not verl's
    hard-coded flash_attention_2). A job whose KL reference is another model than its start
    (``train.ref_anchor: base``, rounds ≥ 2) sets ``FEDAGENT_VERL_REF_MODEL`` (fedagent.train.verl.ref_model): verl's reference workers are armed
    here to load it (the backend refuses a log without their loaded line). A ``train.verl.warm_refit``
    job sets ``FEDAGENT_VERL_WARM_REFIT`` (fedagent.train.verl.refit): verl's actor worker gets the reset
    its second fit needs."""
    install()
    from fedagent.train.verl import critic_attn, critic_loss, ref_model, refit

    mode = os.environ.get(critic_loss.CRITIC_LOSS_ENV)
    if mode:
        critic_loss.arm(mode)
        critic_attn.arm()
    ref_dir = os.environ.get(ref_model.REF_MODEL_ENV)
    if ref_dir is not None:
        ref_model.arm(ref_dir)
    if os.environ.get(refit.REFIT_ENV):
        refit.arm()
