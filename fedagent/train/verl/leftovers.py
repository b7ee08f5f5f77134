"""A killed verl attempt's leftovers outside its work dir, recorded so that the next attempt removes them.

A SIGKILL of a ``train_client`` job gives it no chance to clean up: its trainer runs on in its own
session (Ray, vLLM, the GPU memory), its Ray temp dir stays in the temp root when the work dir's path is
too long for Ray's sockets, and so do the IPC sockets named by its tag. The work dir's :data:`LEFTOVERS`
record (written atomically by :func:`record`) names all three; :func:`remove`, run by the next attempt
before it clears the work dir, stops the group and removes the rest — only what an attempt of ours names.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
from pathlib import Path

from fedagent.core import tempdirs

LEFTOVERS = "leftovers.json"  # in the work dir: what a killed attempt leaves outside it
IPC_SOCKET_GLOB = "/tmp/rl-colocate-zmq-*{tag}*"  # verl's weight-transfer sockets, salted by the job tag
TAG_PATTERN = r"fa-r\d{3}-c\d+-\d+-[0-9a-f]{16}"  # launch.job_tag's names


def record(workdir: Path, **fields) -> None:
    """Add ``fields`` to the work dir's :data:`LEFTOVERS` record (written whole, atomically)."""
    from fedagent.core.atomic import atomic_write_json

    path = Path(workdir) / LEFTOVERS
    rec = {}
    with contextlib.suppress(OSError, ValueError):
        rec = json.loads(path.read_text())
    atomic_write_json(path, {**rec, **fields})


def remove_ipc_sockets(tag: str) -> None:
    """verl's IPC sockets of the job (or engine set) tagged ``tag`` (:data:`IPC_SOCKET_GLOB`)."""
    for sock in glob.glob(IPC_SOCKET_GLOB.format(tag=tag)):
        with contextlib.suppress(OSError):
            os.unlink(sock)


def remove(workdir: Path, tmp_root: Path | None, *, grace_s: float) -> None:
    """What a killed attempt left outside its work dir, by its :data:`LEFTOVERS` record: its trainer's
    process group, stopped if any of it still runs (an attempt that can no longer commit), then its Ray
    temp dir and IPC sockets. Only a temp dir ``fa-ray-*`` directly under the temp root (not a link),
    and sockets of a tag of :data:`TAG_PATTERN`'s form."""
    try:
        rec = json.loads((Path(workdir) / LEFTOVERS).read_text())
    except (OSError, ValueError):
        return
    if rec.get("pgid") and rec.get("start"):
        from fedagent.core import procs

        procs.stop_group(int(rec["pgid"]), str(rec["start"]), grace_s)
    if rec.get("ray_tmp"):
        tempdirs.remove_own(rec["ray_tmp"], "fa-ray-", tmp_root)
    tag = str(rec.get("tag") or "")
    if re.fullmatch(TAG_PATTERN, tag):
        remove_ipc_sockets(tag)
