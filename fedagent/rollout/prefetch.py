"""The first rollout batch's sessions, created and reset while the job is still starting.

A train job knows its first batch before it has a model: the seeds of local epoch 0
(:func:`fedagent.train.local.epoch_task_seeds`) and the session ids
:func:`fedagent.rollout.episode.run_episodes_batched` gives them. Resetting those sessions
(TextWorld loads each game file) took 1.3–1.6 s between the rollout's start and its first sampled
token on a GPU node, after the job had loaded its model and warmed its sampler. Here a thread
waits for the job's env service, creates the batch's sessions and resets them while the main
thread loads the model; the rollout then gets exactly the answers it would have asked for.

Nothing about the results changes: a reset is a function of its session's seed, the calls are the
same calls in the same order per session, and any other call goes to the env as before. The
prefetched answers are served once, and only to the identical request (same session ids, same
(session, seed) pairs); anything else is sent to the service.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence


class PrefetchedEnv:
    """Wraps a pending env (an object with ``ready()``) and prefetches one batch in a thread.

    ``ready()`` joins the thread (re-raising its error) and returns the env client wrapped so
    that the first ``create_many(sids)`` / ``reset_many(pairs)`` of exactly that batch are
    answered from the prefetch.
    """

    def __init__(self, pending, sids: Sequence[str], seeds: Sequence[int]):
        if len(sids) != len(seeds):
            raise ValueError(f"{len(sids)} session ids for {len(seeds)} seeds")
        self._pending = pending
        self._sids = list(sids)
        self._pairs = [(sid, int(seed)) for sid, seed in zip(sids, seeds)]
        self._env = self._resets = self._error = None
        self._created = False
        # Wall-clock times (for the job's timing marks): the service answered; the batch was reset.
        self.service_up_at: float | None = None
        self.reset_at: float | None = None
        self._thread = threading.Thread(target=self._run, name="env-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            env = self._pending.ready()
            self._env = env
            self.service_up_at = time.time()
            if not hasattr(env, "create_many") or not hasattr(env, "reset_many"):
                return  # an env without the batch calls: nothing prefetched, all passed on
            env.create_many(self._sids)
            self._created = True
            self._resets = env.reset_many(self._pairs)
            self.reset_at = time.time()
        except BaseException as exc:  # handed to the main thread by ready()
            self._error = exc

    def ready(self):
        """The env client (served-first wrapper); the prefetch's error, if it failed."""
        self._thread.join()
        if self._error is not None:
            if self._env is not None:  # sessions may exist: the caller's close_many cleans them up
                self._error.add_note("(raised while prefetching the first rollout batch's resets)")
            raise self._error
        if not self._created:
            return self._env
        return _ServedFirst(self._env, self._sids, self._pairs, self._resets)


class _ServedFirst:
    """An env client whose first matching create/reset batch was already done (then plain)."""

    def __init__(self, env, sids, pairs, resets):
        self._env = env
        self._created = list(sids)
        self._pairs = list(pairs)
        self._resets = resets

    def create_many(self, sids):
        if self._created is not None:
            prefetched, self._created = self._created, None
            if list(sids) == prefetched:
                return None
            # Not the batch that was prefetched: give its sessions (and their envs) back first,
            # or a full pool would leave this create waiting for ever.
            self._resets = None
            self._env.close_many(prefetched)
        return self._env.create_many(sids)

    def reset_many(self, pairs):
        pairs = [(sid, int(seed)) for sid, seed in pairs]
        if self._resets is not None and pairs == self._pairs:
            out, self._resets = self._resets, None
            return out
        return self._env.reset_many(pairs)

    def __getattr__(self, name):
        return getattr(self._env, name)
