"""Steps/s through the env service vs in-process stepping of the same TextWorld env.

For each concurrency C (default 1, 16, 64) both variants run C sessions at once from C
threads; every session plays ``--episodes`` episodes of ``--steps`` steps over the same
games (seed → task exactly as the service maps it, index mode), with the same action cycle.
In-process: each thread owns a ``TextWorldEnv``. Service: a job-scoped ``fedagent
serve-env`` on a Unix socket with pool C, one shared ``EnvClient``, in two modes:
per-request (C threads, one ``/step`` each) and batched (the rollout loop's shape: all C
sessions in lockstep, one ``/create_batch``, one ``/reset_batch`` per episode, one
``/step_batch`` per step, one ``/close_batch``, all from one thread).
The variants are measured alternately (``--repeats`` times) in the same run, and the ratios
service/in-process printed. The batched mode is also compared with in-process stepping of
the same lockstep shape (``ex.map`` over the C envs per step), because the per-step barrier
costs in-process stepping too and the rollout loop cannot avoid it.

    python bench/env_service.py [--games DIR] [--concurrency 1 16 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fedagent.envs.lifecycle import env_service
from fedagent.envs.service import task_for_seed
from fedagent.envs.textworld.games import TextWorldTaskSource, generate_games

ACTIONS = ["look", "inventory", "go north", "go south", "go east", "go west", "examine room"]


def answer(action: str) -> str:
    """A well-formed model answer for ``action``."""
    return f"<think>bench</think><action>{action}</action>"


def run_inprocess(source, tasks, conc, episodes, steps, max_turns) -> float:
    """Steps/s with ``conc`` threads each stepping its own env instance directly."""
    envs = [source.make_env(max_turns) for _ in range(conc)]

    def session(i):
        env, n = envs[i], 0
        for e in range(episodes):
            env.reset(task_for_seed(tasks, i * episodes + e, "index"))
            for k in range(steps):
                env.step(ACTIONS[k % len(ACTIONS)])
                n += 1
        return n

    for i in range(conc):  # warm the per-instance game caches
        for t in tasks:
            envs[i].reset(t)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as ex:
        total = sum(ex.map(session, range(conc)))
    dt = time.perf_counter() - t0
    for env in envs:
        env.close()
    return total / dt


def run_inprocess_lockstep(source, tasks, conc, episodes, steps, max_turns) -> float:
    """Steps/s with ``conc`` envs stepped in lockstep from ``conc`` threads (one map per step)."""
    envs = [source.make_env(max_turns) for _ in range(conc)]
    for env in envs:  # warm the per-instance game caches
        for t in tasks:
            env.reset(t)
    total = 0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as ex:
        for e in range(episodes):
            list(ex.map(lambda i: envs[i].reset(task_for_seed(tasks, i * episodes + e, "index")), range(conc)))
            for k in range(steps):
                list(ex.map(lambda env: env.step(ACTIONS[k % len(ACTIONS)]), envs))
                total += conc
    dt = time.perf_counter() - t0
    for env in envs:
        env.close()
    return total / dt


def run_service(client, tasks, conc, episodes, steps) -> float:
    """Steps/s with ``conc`` threads each driving one session through the service."""

    def session(i):
        sid, n = f"bench-{i}", 0
        with client.session(sid):
            for e in range(episodes):
                client.reset(sid, i * episodes + e)
                for k in range(steps):
                    client.step(sid, answer(ACTIONS[k % len(ACTIONS)]))
                    n += 1
        return n

    # warm: every pool env loads every game once (as the in-process variant does)
    with ThreadPoolExecutor(conc) as ex:
        list(
            ex.map(
                lambda i: [
                    client.create(f"w{i}"),
                    *[client.reset(f"w{i}", s) for s in range(len(tasks))],
                    client.close(f"w{i}"),
                ],
                range(conc),
            )
        )
    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as ex:
        total = sum(ex.map(session, range(conc)))
    return total / (time.perf_counter() - t0)


def run_service_batched(client, tasks, conc, episodes, steps) -> float:
    """Steps/s with ``conc`` sessions in lockstep: one batch call per phase, as the rollout loop."""
    sids = [f"batch-{i}" for i in range(conc)]
    total = 0
    t0 = time.perf_counter()
    client.create_many(sids)
    try:
        for e in range(episodes):
            client.reset_many([(sid, i * episodes + e) for i, sid in enumerate(sids)])
            for k in range(steps):
                client.step_many([(sid, answer(ACTIONS[k % len(ACTIONS)])) for sid in sids])
                total += conc
    finally:
        client.close_many(sids)
    return total / (time.perf_counter() - t0)


def main() -> None:
    """Parse arguments, run both variants per concurrency, print a table with ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--games", type=Path, default=None, help="games dir (default: generate 4 games)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--episodes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=50)
    ap.add_argument("--env-threads", type=int, choices=[0, 1], default=1)
    ap.add_argument("--env-procs", type=int, default=0, help="service env worker processes")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fa-bench-"))
    games = args.games
    if games is None:
        games = work / "games"
        generate_games(games, base_seed=0, n_train=4, n_val=0, jobs=2, quarantine_root=work / "_failed")
    source = TextWorldTaskSource(games)
    tasks = source.task_ids("train")
    print(f"games {games} ({len(tasks)} tasks), episodes/session {args.episodes}, steps/episode {args.steps}")
    print(
        f"{'sessions':>8} {'in-process steps/s':>19} {'service steps/s':>16} {'ratio':>6}"
        f" {'batched steps/s':>16} {'ratio':>6} {'in-proc lockstep':>17} {'batched/lockstep':>17}"
    )
    for conc in args.concurrency:
        inproc, served, batched, lockstep = [], [], [], []
        with env_service(
            games,
            "train",
            tasks,
            work / f"svc{conc}",
            mode="index",
            pool_size=conc,
            max_turns=args.max_turns,
            env_threads=bool(args.env_threads),
            env_procs=args.env_procs,
        ) as client:
            for _ in range(args.repeats):  # alternate so machine load hits both
                inproc.append(run_inprocess(source, tasks, conc, args.episodes, args.steps, args.max_turns))
                served.append(run_service(client, tasks, conc, args.episodes, args.steps))
                batched.append(run_service_batched(client, tasks, conc, args.episodes, args.steps))
                lockstep.append(run_inprocess_lockstep(source, tasks, conc, args.episodes, args.steps, args.max_turns))
        a, b, c, d = (statistics.median(x) for x in (inproc, served, batched, lockstep))
        print(
            f"{conc:>8} {a:>19.1f} {b:>16.1f} {b / a:>6.2f} {c:>16.1f} {c / a:>6.2f} {d:>17.1f} {c / d:>17.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
