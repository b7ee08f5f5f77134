"""Per-job phase timings (informational: wall clock never changes a plan, shard or model).

A job's clock starts at its *process* start (Linux ``/proc/self/stat``; the interpreter's and
torch's imports count as cold start, as they do for the user), marks named moments as
seconds since then, and sums named phases that may repeat (one rollout and one training
phase per local epoch). ``summary()`` is what a job writes under ``"timings"`` in its metrics:

    {"marks": {"job_ready": s, "weights_loaded": s, "model_loaded": s, "sampler_warm": s,
               "env_ready": s, "rollout_start": s, "first_token": s, "rollout_done": s,
               "train_done": s, "saved": s},
     "phases": {"rollout": s, "train": s}, "cold_start_s": s, "total_s": s}

Through the warm server (:mod:`fedagent.warm`) three earlier marks say where a job's first
moments went: ``request_sent`` (the light client sent its request), ``job_taken`` (the job's
process — a fresh fork or a standby — took it) and ``command_start`` (``fedagent.commands.dispatch``
began the command; also without the server). ``job_ready``: the imports are done and the job's env service is starting (in its own
process, while this one loads); ``weights_loaded``: the policy is on its device;
``model_loaded``: reference, rollout copy and sampler too; ``sampler_warm`` (GPU, compiled):
the decode step is compiled and captured; ``env_ready``: the env service answered its health
check (a train job that prefetched its first batch also marks ``env_service_up``, when the
service answered, and ``first_batch_reset``, when that batch was reset). ``cold_start_s`` =
process start → first sampled token (where the sampler reports it; else → the start of the
first rollout).

A job forked by the warm server (:mod:`fedagent.warm`) is not a fresh process: the user's job
started when its light client did. The server sets ``FEDAGENT_JOB_START`` (the client's own
process start, epoch seconds) in the forked job's environment, and :func:`process_start_time`
returns it when set, so cold start still counts from the moment the job was started — the
imports the warm server did once are simply not paid. Processes the job starts inherit it (their
clocks start at the job's start too); the warm client reads its own start with
:func:`proc_start_time`, never the inherited value.
"""

from __future__ import annotations

import contextlib
import json
import os
import time


JOB_START_ENV = "FEDAGENT_JOB_START"
# Set by the warm server's job process: {"request_sent": epoch s, "job_taken": epoch s}.
JOB_MARKS_ENV = "FEDAGENT_JOB_MARKS"
_COMMAND_START: float | None = None


def mark_command_start() -> None:
    """``fedagent.commands.dispatch`` calls this as it starts the command (the ``command_start`` mark)."""
    global _COMMAND_START
    _COMMAND_START = time.time()


def process_start_time() -> float:
    """When this job started: ``FEDAGENT_JOB_START`` if set (a job forked by the warm server),
    else :func:`proc_start_time`."""
    value = os.environ.get(JOB_START_ENV)
    if value:
        return float(value)
    return proc_start_time()


def proc_start_time() -> float:
    """Wall-clock time this process started (Linux), else the time this module was imported.

    stat(5)'s ``starttime`` counts clock ticks since boot (the kernel's boot-time clock); the
    boot's wall-clock time is now minus ``CLOCK_BOOTTIME``. (``/proc/stat``'s ``btime`` is whole
    seconds: it put every start up to 1 s too early — the fractional part of the boot time, the
    same for every job of a node — and every mark and cold start after it that much too late.)
    """
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5): starttime, in clock ticks
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


_IMPORTED = time.time()


class PhaseClock:
    """Marks and summed phases of one job, in seconds since the process started."""

    def __init__(self, start: float | None = None):
        self.start = process_start_time() if start is None else float(start)
        self.marks: dict[str, float] = {}
        self.phases: dict[str, float] = {}
        try:
            early = json.loads(os.environ.get(JOB_MARKS_ENV) or "{}")
        except ValueError:
            early = {}
        for name in ("request_sent", "job_taken"):
            if isinstance(early.get(name), (int, float)):
                self.mark(name, float(early[name]))
        if _COMMAND_START is not None:
            self.mark("command_start", _COMMAND_START)

    def mark(self, name: str, when: float | None = None) -> None:
        """Record ``name`` at ``when`` (now by default); the first record of a name wins."""
        self.marks.setdefault(name, (time.time() if when is None else float(when)) - self.start)

    def set(self, name: str, when: float) -> None:
        """Record ``name`` at the absolute time ``when`` (overwrites)."""
        self.marks[name] = float(when) - self.start

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a block: adds to ``phases[name]``, marks ``<name>_start`` once and ``<name>_done`` last."""
        t = time.time()
        self.mark(f"{name}_start", t)
        try:
            yield
        finally:
            now = time.time()
            self.phases[name] = self.phases.get(name, 0.0) + (now - t)
            self.marks[f"{name}_done"] = now - self.start

    def summary(self) -> dict:
        """The JSON-able timings block (3 decimals)."""
        first = self.marks.get("first_token", self.marks.get("rollout_start"))
        return {
            "marks": {k: round(v, 3) for k, v in sorted(self.marks.items(), key=lambda kv: kv[1])},
            "phases": {k: round(v, 3) for k, v in sorted(self.phases.items())},
            "cold_start_s": round(first, 3) if first is not None else None,
            "total_s": round(time.time() - self.start, 3),
            # the process start as epoch seconds: where the job sits in its round (the report's
            # round_wall_s); informational only, like every field here
            "started_at": round(self.start, 3),
        }
