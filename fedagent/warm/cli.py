"""``fedagent warm-server``: start (foreground or ``--detach``), ``--ping`` or ``--stop`` a warm server.

    fedagent warm-server --socket S --detach          # preload train,eval,env,server; returns once ready
    FEDAGENT_WARM_SOCKET=S snakemake --profile profiles/local ...
    fedagent warm-server --socket S --stop            # kills running jobs' groups first
    fedagent warm-server --socket S --detach --standby 2   # + 2 processes that start CUDA before their job

The socket is ``AF_UNIX``, mode 0600. Starting refuses a path where a server answers (or that is
not a socket) and removes a stale socket file nobody answers on.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import stat
import sys
import time
import traceback
from pathlib import Path

from fedagent.core.atomic import atomic_write_json
from fedagent.commands import WARM_COMMANDS
from fedagent.warm import client, standby

UDS_MAX = 107  # Linux sun_path is 108 bytes with its terminating NUL


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``fedagent warm-server``."""
    parser.add_argument("--socket", required=True, type=Path, help="the server's Unix socket")
    parser.add_argument(
        "--preload",
        default="train,eval,env,server",
        help="comma-separated module groups to import once: train, eval, env, server",
    )
    parser.add_argument("--detach", action="store_true", help="run as a daemon; return once it is ready")
    parser.add_argument("--ready-file", type=Path, default=None, help="JSON written once serving")
    parser.add_argument("--log", type=Path, default=None, help="--detach: the server's log (default SOCKET.log)")
    parser.add_argument(
        "--standby",
        type=int,
        default=0,
        metavar="N",
        help="keep N standby processes that start CUDA before a job asks: train-client and eval "
        "jobs run in one (the CUDA start off their clock); N per card when the node's cards are "
        "known (nvidia-smi or FEDAGENT_GPUS, through CUDA_VISIBLE_DEVICES), each started on its card, "
        "and a job placed on a card runs in a standby of that card; 0 (default): none",
    )
    parser.add_argument(
        "--standby-config",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="with --standby: the run's config files (as snakemake --configfile, over "
        "config/config.yaml of the current directory); each standby then also runs the "
        "run's GPU train and eval calls once on a 1-layer model of its architecture, at its "
        "shapes (fedagent.warm.gpu_warmup), once results/<run>/round_000/model exists",
    )
    parser.add_argument(
        "--standby-refill-delay",
        type=float,
        default=0.0,
        metavar="S",
        help="with --standby: fork the replacement of a standby that took a job S seconds after "
        "the last such hand-over, not at once (its CUDA start and warm-up then run after the "
        "burst of jobs starting together, not against them); default 0",
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--stop", action="store_true", help="stop the server at --socket (its running jobs first)")
    what.add_argument("--ping", action="store_true", help="print the server's state as JSON")
    # Tests only: more files under the stale-code guard (the real check, on files a test may touch).
    parser.add_argument("--watch-extra", action="append", default=[], help=argparse.SUPPRESS)
    # Tests only: a CPU standby kind (fedagent.warm.standby.KINDS) and another set of standby commands.
    parser.add_argument("--standby-kind", choices=standby.KINDS, default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--standby-commands", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent warm-server``."""
    path = os.path.abspath(args.socket)
    if args.ping or args.stop:
        return _ask(path, {"op": "stop" if args.stop else "ping"})
    if args.standby < 0:
        return _fail(f"--standby {args.standby}: a count of standby processes, 0 or more")
    commands = (
        sorted(standby.STANDBY_COMMANDS)
        if args.standby_commands is None
        else [c for c in args.standby_commands.split(",") if c]
    )
    unknown = [c for c in commands if c not in WARM_COMMANDS]
    if unknown:
        return _fail(
            f"--standby-commands: {', '.join(unknown)} not among the warm commands ({', '.join(WARM_COMMANDS)})"
        )
    args.standby_commands = commands
    if not args.standby_refill_delay >= 0:
        return _fail(f"--standby-refill-delay {args.standby_refill_delay}: seconds, 0 or more")
    args.standby_warmup = None
    if args.standby_config:
        if not args.standby:
            return _fail("--standby-config needs --standby N (N >= 1)")
        from fedagent.core.config import ConfigError
        from fedagent.report.config_show import WORKFLOW_CONFIG, effective_config
        from fedagent.warm.gpu_warmup import shapes_from_config

        base = WORKFLOW_CONFIG if WORKFLOW_CONFIG.is_file() else None
        try:
            config, _ = effective_config(base, list(args.standby_config), [])
        except ConfigError as err:
            return _fail(f"--standby-config: {err}")
        args.standby_warmup = shapes_from_config(config)
        if args.standby_warmup.train is None and args.standby_warmup.eval is None:
            return _fail(
                f"--standby-config {' '.join(map(str, args.standby_config))}: neither train nor eval "
                "runs on cuda with the local backend: nothing to warm"
            )
        args.standby_warmup = args.standby_warmup.absolute()
    if len(path.encode()) > UDS_MAX:
        return _fail(f"--socket {path}: longer than the {UDS_MAX}-byte Unix socket limit; use a path under /tmp")
    why = _occupied(path)
    if why is not None:
        return _fail(f"--socket {path}: {why}")
    if args.detach:
        return _detach(args, path)
    return _serve(args, path)


def _fail(message: str) -> int:
    print(f"warm-server: {message}", file=sys.stderr, flush=True)
    return 1


def _ask(path: str, request: dict) -> int:
    try:
        reply = client.ask(path, request, timeout=None if request["op"] == "stop" else 10.0)
    except OSError as err:
        return _fail(f"no warm server answers at {path} ({err.strerror or err})")
    print(json.dumps(reply, sort_keys=True))
    return 0 if reply else 1


def _occupied(path: str) -> str | None:
    """Why ``path`` cannot be bound (None: free, after removing a stale socket file)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(mode):
        return "exists and is not a socket (not removed)"
    try:
        client.connect(path, timeout=5.0).close()
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # stale: nobody answers there
        return None
    except OSError as err:
        return f"cannot tell whether a server answers there ({err})"
    return "a warm server already answers there (fedagent warm-server --socket PATH --stop first)"


def _platform_problem() -> str | None:
    """The server watches each job through a pidfd (Linux >= 5.3)."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError) as err:
        return f"os.pidfd_open is not available here ({err}): the warm server needs Linux >= 5.3"
    return None


def _bind(path: str) -> socket.socket:
    """Listen on ``path``, mode 0600 from the start (umask), not after a window."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(128)
    return sock


def _serve(args: argparse.Namespace, path: str, notify_fd: int | None = None) -> int:
    """Preload, check the process is safe to fork, listen, announce, serve."""
    from fedagent.warm.preload import Guard, fork_problem, parse_groups, preload

    t0 = time.time()
    try:
        groups = parse_groups(args.preload)
    except ValueError as err:
        return _fail(str(err))
    try:
        import_env = preload(groups)
    except ImportError as err:
        return _fail(f"--preload {args.preload}: {err}")
    from fedagent.warm.server import WarmServer, log  # before the guard's table: its files are watched

    problem = fork_problem() or _platform_problem()
    if problem is not None:
        return _fail(f"cannot serve: {problem}")
    if args.standby:  # asked in a forked child: this process starts no CUDA
        why = standby.probe(args.standby_kind, () if notify_fd is None else (notify_fd,))
        if why is not None:
            return _fail(f"--standby {args.standby}: {why}: start the warm server without --standby")
    standby_cards: list[str | None] = [None]
    if args.standby:
        # One set of standbys per card (fedagent.core.placement): a standby's CUDA starts on one card
        # and a job placed on another must not run in it. No cards known: one set, the server's devices.
        from fedagent.core import placement

        try:
            standby_cards = [c.name for c in placement.node_cards()] or [None]
        except placement.PlacementError as err:
            return _fail(f"--standby {args.standby}: {err}")
    listener = _bind(path)
    guard = Guard(path, import_env, [os.path.abspath(p) for p in args.watch_extra])
    info = {
        "pid": os.getpid(),
        "socket": path,
        "inode": os.stat(path).st_ino,
        "preload": groups,
        "preload_s": round(time.time() - t0, 3),
        "watched_files": len(guard.files),
        # OS threads the imports started (numpy/scipy OpenBLAS pools: fork-safe by their own
        # atfork handlers); Python threads are refused above.
        "native_threads": len(os.listdir("/proc/self/task")),
        "executable": sys.executable,
        "standby": args.standby,
        "standby_kind": args.standby_kind,
        "standby_cards": [c for c in standby_cards if c is not None],
        "standby_commands": args.standby_commands,
        "standby_warmup": None if args.standby_warmup is None else args.standby_warmup.describe(),
    }
    line = (
        f"warm-server ready: pid {info['pid']} socket {path} preloaded {','.join(groups)} in "
        f"{info['preload_s']} s ({len(guard.files)} fedagent files watched)"
        + (
            f", {args.standby} standby ({args.standby_kind}) for {','.join(args.standby_commands)}"
            if args.standby
            else ""
        )
    )
    if args.ready_file is not None:
        atomic_write_json(args.ready_file, info)
    if notify_fd is None:
        print(line, flush=True)
    else:  # detached: into the log, and to the waiting parent
        log(line)
        os.write(notify_fd, line.encode())
        os.close(notify_fd)
    try:
        return WarmServer(
            listener,
            guard,
            info,
            args.standby,
            args.standby_kind,
            args.standby_commands,
            args.standby_warmup,
            args.standby_refill_delay,
            standby_cards,
        ).serve()
    finally:
        listener.close()
        if args.ready_file is not None:
            Path(args.ready_file).unlink(missing_ok=True)
        try:
            if os.stat(path).st_ino == info["inode"]:
                os.unlink(path)
        except FileNotFoundError:
            pass


def _detach(args: argparse.Namespace, path: str) -> int:
    """Double fork + setsid; the daemon writes its ready line into a pipe this process reads."""
    log_path = os.path.abspath(args.log or f"{path}.log")
    if args.ready_file is not None:
        args.ready_file = Path(os.path.abspath(args.ready_file))
    args.watch_extra = [os.path.abspath(p) for p in args.watch_extra]
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            os.chdir("/")
            null = os.open(os.devnull, os.O_RDONLY)
            out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            for fd, target in ((null, 0), (out, 1), (out, 2)):
                os.dup2(fd, target)
            os.close(null)
            os.close(out)
            code = _serve(args, path, notify_fd=w)
        except BaseException:  # noqa: BLE001 - into the log, which the parent quotes
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(w)
    os.waitpid(pid, 0)
    chunks = []
    while chunk := os.read(r, 4096):
        chunks.append(chunk)
    os.close(r)
    if chunks:
        print(b"".join(chunks).decode(), flush=True)
        return 0
    try:
        tail = "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-20:])
    except FileNotFoundError:
        tail = "(no log)"
    return _fail(f"the detached server exited before it was ready; log {log_path}:\n{tail}")
