"""Processes and process groups by /proc (Linux): who is alive, and stopping a whole group.

A process is named by its pid *and* its start time (clock ticks after boot, /proc/<pid>/stat field 22):
a pid reused later has another start time, so a recorded process is never confused with a newer one.
Used by the verl engine sets (``fedagent.train.verl.engines.client``) and by a verl job's clean-up of a
killed attempt (``fedagent.train.verl.leftovers``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def proc_start(pid: int) -> str | None:
    """The process's start time; None if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def alive(pid: int, start: str | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, given ``start``, is still the process started then."""
    now = proc_start(pid)
    return now is not None and (start is None or now == start)


def group_members(pgid: int, since: str | None = None) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid`` started at or after ``since`` (clock ticks)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] in ("Z", "X") or int(fields[2]) != pgid:
            continue
        if since is not None and int(fields[19]) < int(since):
            continue
        out.append(int(stat.parent.name))
    return out


def group_alive(pgid: int, since: str | None = None) -> bool:
    return bool(group_members(pgid, since))


def stop_group(pgid: int, since: str | None, grace_s: float = 20.0) -> bool:
    """SIGTERM the process group ``pgid`` (its members started since ``since``), SIGKILL after ``grace_s``;
    True once none is left (at most 30 s after the SIGKILL). Signals nothing when no member started since
    ``since`` is alive (the group is gone, or its id now names newer processes)."""
    if not group_alive(pgid, since):
        return True
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and group_alive(pgid, since):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pgid, os.WNOHANG)  # our own child: reap it
            time.sleep(0.2)
        if not group_alive(pgid, since):
            return True
    return False
