"""``fedagent drop-client``: what a failed ``train_client`` job leaves when dropout is allowed.

The train_client rule runs ``fedagent train-client ... || fedagent drop-client ...``. On the
job's last attempt (Snakemake's ``retries`` spent) and only when the config allows dropout
(``clients.min_per_round`` below ``clients.per_round``), this writes the client's output
directory with just ``dropped.json`` (round, client, attempts, exit code, the tail of the
job's log) and a manifest, and exits 0: the round goes on and ``fedagent aggregate`` averages
the survivors if at least ``min_per_round`` finished. Otherwise (strict, the default, or
attempts left) it exits 1 and the job fails as before.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DROPPED_JSON = "dropped.json"


class DroppedClient(RuntimeError):
    """A client directory that holds a drop record, read where an update was expected."""


def is_dropped(client_dir: Path) -> bool:
    """Whether a (manifest-checked) client output is a drop record rather than an update."""
    return (Path(client_dir) / DROPPED_JSON).is_file()


def drop_reason(client_dir: Path) -> str:
    """The one-line reason stored in ``dropped.json``."""
    try:
        return str(json.loads((Path(client_dir) / DROPPED_JSON).read_text()).get("reason", "?"))
    except (OSError, ValueError, AttributeError):
        return "unreadable dropped.json"


def _log_tail(log: Path | None, n: int = 20) -> list[str]:
    if log is None:
        return []
    try:
        return Path(log).read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def write_dropped(
    out: Path,
    *,
    round_: int,
    client: int,
    attempts: int,
    exit_code: int,
    log: Path | None = None,
    quarantine: Path | None = None,
) -> dict:
    """Write ``out`` atomically as a drop record; return its content."""
    from fedagent.core.atomic import atomic_dir
    from fedagent.core.provenance import write_provenance

    tail = _log_tail(log)
    last = next((line for line in reversed(tail) if line.strip()), "")
    record = {
        "format": "fedagent-dropped-v1",
        "round": round_,
        "client": client,
        "attempts": attempts,
        "exit_code": exit_code,
        "reason": f"train_client exited {exit_code} after {attempts} attempt(s): {last}".rstrip(": "),
        "log_tail": tail,
    }
    with atomic_dir(Path(out), quarantine) as stage:
        (stage / DROPPED_JSON).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        write_provenance(stage, job="train_client", params={"round": round_, "client": client, "dropped": True})
    return record


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``fedagent drop-client``."""
    parser.add_argument("--out", required=True, type=Path, help="the client's output directory")
    parser.add_argument("--round", required=True, type=int)
    parser.add_argument("--client", required=True, type=int)
    parser.add_argument("--exit-code", required=True, type=int, help="train-client's exit status")
    parser.add_argument("--attempt", required=True, type=int, help="Snakemake's attempt number (1-based)")
    parser.add_argument(
        "--drop-at-attempt",
        required=True,
        type=int,
        help="write the drop record from this attempt on (0: never, strict)",
    )
    parser.add_argument("--log", type=Path, default=None, help="the job's log (its tail is kept)")
    parser.add_argument("--quarantine", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    """0 after writing the drop record; 1 (the job fails) when strict or attempts are left."""
    if args.drop_at_attempt <= 0 or args.attempt < args.drop_at_attempt:
        why = (
            "strict (clients.min_per_round is unset or equals clients.per_round)"
            if args.drop_at_attempt <= 0
            else f"attempt {args.attempt} of {args.drop_at_attempt}: Snakemake retries it"
        )
        print(
            f"drop-client: round {args.round} client {args.client}: train-client failed "
            f"(exit {args.exit_code}); not dropped: {why}",
            file=sys.stderr,
        )
        return 1
    rec = write_dropped(
        args.out,
        round_=args.round,
        client=args.client,
        attempts=args.attempt,
        exit_code=args.exit_code,
        log=args.log,
        quarantine=args.quarantine,
    )
    print(f"drop-client: round {args.round} client {args.client} dropped: {rec['reason']}", file=sys.stderr)
    return 0
