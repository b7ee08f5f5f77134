"""``fedagent serve-env``: run one environment service (by hand or from ``lifecycle``).

Binds a Unix socket (``--uds``) or loopback TCP (``--port 0`` = OS-assigned) *before*
uvicorn starts, so the bound address is known; once the server accepts requests it writes
``--ready-file`` atomically (``{"pid", "uds"|"host"+"port", "accelerator_env"}``). The service exits
when its parent process dies (orphaned services must not hold pools or sockets forever).

An env service never touches an accelerator: before anything else it puts
:data:`NO_ACCELERATOR_ENV` into its own environment (:mod:`fedagent.envs.lifecycle` also starts it
with them, so a spawned service has them from its first instruction and a service forked by the
warm server gets them with the job's environment). On a GPU node a library imported by an
environment would otherwise take the card: ``bm25s`` (WebShop's search) imports JAX when it is
installed, and JAX's GPU client preallocates 75 % of device memory in every service.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import signal
import socket
import sys
from pathlib import Path

from fedagent.core import envs
from fedagent.core.atomic import atomic_write_json
from fedagent.core.errors import ConfigError

TOKEN_ENV = "FEDAGENT_ENV_TOKEN"

# What an env service runs with (docs/explanation/architecture.md, "Env services never touch an accelerator"):
NO_ACCELERATOR_ENV = {
    # No CUDA device visible to the CUDA runtime/driver: covers torch, TensorFlow, CuPy, numba and
    # JAX's CUDA plugin alike (read when CUDA initialises, i.e. lazily, after the fork or exec).
    "CUDA_VISIBLE_DEVICES": "",
    # JAX: the CPU backend only, so it never loads its CUDA plugin (read when jax is imported).
    "JAX_PLATFORMS": "cpu",
    # Belt and braces: had a JAX GPU client started anyway, it would not preallocate 75 % of the card.
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
}
# Not set: NVIDIA_VISIBLE_DEVICES is read by the container runtime when a container starts, by
# nothing inside a process (setting it here would hide nothing); HIP/ROCR_VISIBLE_DEVICES are AMD's.


class AcceleratorEnvError(RuntimeError):
    """A library that grabs a device at import was imported before the service could hide the GPU."""


def hide_accelerators() -> dict[str, str]:
    """Put :data:`NO_ACCELERATOR_ENV` into this process's environment; the values now in force.

    Raises :class:`AcceleratorEnvError` when JAX was imported before with other platforms than the
    CPU (only possible in a job forked from a warm server that preloaded it: JAX read
    ``JAX_PLATFORMS`` at its import, under the server's environment, whatever the job's says now).
    """
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            platforms = jax.config.jax_platforms  # what jax read at its import
        except AttributeError:
            platforms = None
        if platforms != NO_ACCELERATOR_ENV["JAX_PLATFORMS"]:
            raise AcceleratorEnvError(
                f"jax was imported before the env service could set JAX_PLATFORMS=cpu (its platforms: "
                f"{platforms!r}; a warm server that preloads jax?): it would take the GPU. Start the warm "
                "server without jax in its preload, or with JAX_PLATFORMS=cpu"
            )
    os.environ.update(NO_ACCELERATOR_ENV)
    return {k: os.environ.get(k) for k in NO_ACCELERATOR_ENV}


def add_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``fedagent serve-env``."""
    parser.add_argument("--games", required=True, type=Path, help="games directory (TextWorld or ALFWorld root)")
    parser.add_argument("--source", choices=envs.kinds(), default=envs.UNNAMED_CATALOGUE_KIND, help="env kind")
    parser.add_argument(
        "--env-params",
        default=None,
        help="JSON object of env knobs (WebShop: the arm, see fedagent.envs.webshop.arms.ArmSpec)",
    )
    parser.add_argument("--split", required=True, help="train/val (TextWorld) or an ALFWorld split")
    tasks = parser.add_mutually_exclusive_group(required=True)
    tasks.add_argument("--tasks-file", type=Path, help='JSON list of task ids (or {"tasks": [...]})')
    tasks.add_argument("--all", action="store_true", help="serve every task of the split")
    parser.add_argument("--mode", choices=["draw", "index"], default="draw")
    parser.add_argument("--pool-size", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=50)
    parser.add_argument(
        "--answer-format",
        choices=["think_action", "action"],
        default="think_action",
        help="what an answer must hold to be a valid turn (rollout.answer_format)",
    )
    parser.add_argument(
        "--projection",
        choices=["reference", "noop"],
        default="reference",
        help="what the env does with an invalid answer (rollout.projection)",
    )
    parser.add_argument("--client-id", default=None)
    parser.add_argument(
        "--expert",
        action="store_true",
        help="envs with their expert and the /expert_batch endpoint (the warm start's demos)",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--uds", type=Path, help="Unix socket path")
    where.add_argument("--port", type=int, help="TCP port on --host (0 = OS-assigned)")
    parser.add_argument("--host", default="127.0.0.1", help="TCP host (loopback by default)")
    parser.add_argument("--ready-file", type=Path, default=None, help="JSON written once serving")
    parser.add_argument("--token", default=None, help=f"shared token (or env {TOKEN_ENV})")
    parser.add_argument("--create-timeout", type=float, default=None)
    parser.add_argument("--log-level", default="warning")
    parser.add_argument(
        "--env-threads",
        type=int,
        choices=[0, 1],
        default=1,
        help="1: env calls in a thread per env; 0: inline on the event loop",
    )
    parser.add_argument(
        "--env-procs",
        type=int,
        default=0,
        help="host the envs in this many worker processes (0: in the service process)",
    )


def load_task_list(path: Path) -> list[str]:
    """Task ids from a JSON file: a list, or an object with a ``tasks`` list."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        data = data.get("tasks")
    if not isinstance(data, list) or not all(isinstance(t, str) for t in data) or not data:
        raise ValueError(f"{path}: expected a non-empty JSON list of task ids")
    return data


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback IP (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_socket(args: argparse.Namespace) -> tuple[socket.socket, dict]:
    """Bind and listen on the requested address; return the socket and its description."""
    if args.uds is not None:
        path = str(args.uds)
        if os.path.exists(path):
            # A stale socket from a killed run is unlinked only if nobody answers on it.
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
                raise RuntimeError(f"{path}: another service is listening there")
            except (ConnectionRefusedError, FileNotFoundError):
                os.unlink(path)
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        where = {"uds": path}
    else:
        if not is_loopback(args.host):
            raise ValueError(
                f"--host {args.host!r} is not a loopback address: the env service binds a Unix "
                "socket or loopback TCP only (it runs environments for whoever connects)"
            )
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((args.host, args.port))
        where = {"host": args.host, "port": sock.getsockname()[1]}
    sock.listen(1024)
    return sock, where


async def _serve(server, sock, ready_file: Path | None, where: dict) -> None:
    """Serve until stopped; the ready file says where, and with which accelerator variables (as this
    process reads them once its sources are built)."""
    task = asyncio.create_task(server.serve(sockets=[sock]))
    parent = os.getppid()
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if ready_file is not None and server.started:
        atomic_write_json(
            ready_file,
            {"pid": os.getpid(), **where, "accelerator_env": {k: os.environ.get(k) for k in NO_ACCELERATOR_ENV}},
        )
    while not task.done():
        if os.getppid() != parent:  # parent died: we were re-parented
            print("serve-env: parent process gone, shutting down", file=sys.stderr, flush=True)
            server.should_exit = True
        await asyncio.wait({task}, timeout=1.0)
    await task


def make_source(
    kind: str, games: Path, split: str, *, tasks=None, env_params: dict | None = None, client_id: str | None = None
):
    """The task source of a service, from the kind's spec (:attr:`fedagent.core.envs.EnvSpec.source`)."""
    return open_source(kind, games, split, tasks=tasks, env_params=env_params, client_id=client_id)[0]


def open_source(
    kind: str, games: Path, split: str, *, tasks=None, env_params: dict | None = None, client_id: str | None = None
):
    """(task source, the split name its tasks carry there) of ``kind`` over ``games``; env params only
    for a kind that takes them (:attr:`fedagent.core.envs.EnvSpec.client_env_params`)."""
    try:
        spec = envs.spec(kind)
    except ConfigError as exc:
        raise ValueError(f"unknown env source {kind!r} (known: {list(envs.kinds())})") from exc
    if env_params and not envs.takes_env_params(spec):
        raise ValueError(f"--env-params is only understood by a source with client env knobs, not {kind!r}")
    return envs.resolve(spec.source)(games, split, tasks=tasks, env_params=env_params, client_id=client_id)


def _exit_on_signal(signum, _frame):
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    """Build the app for the games directory and serve it until SIGTERM/SIGINT."""
    hide_accelerators()  # first: before any environment's library is imported
    import uvicorn

    from fedagent.envs.service import build_app

    if args.uds is None and not is_loopback(args.host):  # before any work: one message naming the flag
        print(
            f"serve-env: --host {args.host!r} is not a loopback address (Unix socket or loopback only)", file=sys.stderr
        )
        return 2
    listed = None if args.all else load_task_list(args.tasks_file)
    env_params = json.loads(args.env_params) if args.env_params else None
    source, split = open_source(
        args.source, args.games, args.split, tasks=listed, env_params=env_params, client_id=args.client_id
    )
    if args.all:
        tasks = source.task_ids(split)
    else:
        tasks = listed
    token = args.token or os.environ.get(TOKEN_ENV) or None
    app = build_app(
        source,
        args.split,
        tasks,
        mode=args.mode,
        pool_size=args.pool_size,
        max_turns=args.max_turns,
        client_id=args.client_id,
        token=token,
        create_timeout=args.create_timeout,
        env_threads=bool(args.env_threads),
        env_procs=args.env_procs,
        answer_format=args.answer_format,
        projection=args.projection,
        expert=args.expert,
    )
    sock, where = bind_socket(args)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False, timeout_graceful_shutdown=3, lifespan="on")
    server = uvicorn.Server(config)
    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown; turn that into a normal
    # exit so the `finally` below removes the socket file.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        asyncio.run(_serve(server, sock, args.ready_file, where))
    finally:
        sock.close()
        if "uds" in where:
            try:
                os.unlink(where["uds"])
            except FileNotFoundError:
                pass
    return 0
