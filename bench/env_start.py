"""How long a train job's env takes to start: the service up, then its first batch reset.

A ``train-client`` job starts its env service (``job_env_service(..., wait=False)``) and, while
it loads the policy, prefetches the first rollout batch (``PrefetchedEnv``: ``/create_batch`` and
``/reset_batch`` of ``--batch`` sessions over ``--groups`` games). Here exactly that, timed from
the service's start, for each ``--env-procs`` value (0: envs in the service's threads; K: in K
worker processes), ``--concurrent`` services at once (a round's jobs start together), medians
of ``--repeats``. With ``FEDAGENT_WARM_SOCKET`` set the services are forked from that warm
server, as a warm run's are.

    python bench/env_start.py --games results/<run>/plan/games [--env-procs 0 2 4] [--concurrent 1 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one_start(games: Path, tasks: list[str], batch: int, groups: int, procs: int, work: Path) -> tuple[float, float]:
    """(service up, first batch reset) seconds after the service's start."""
    from fedagent.envs.lifecycle import job_env_service
    from fedagent.rollout.episode import first_batch
    from fedagent.rollout.prefetch import PrefetchedEnv

    seeds = [g for g in range(groups) for _ in range(batch // groups)]
    t0 = time.time()
    with job_env_service(
        games,
        "train",
        tasks,
        work,
        mode="draw",
        pool_size=batch,
        max_turns=3,
        client_id="0",
        answer_format="action",
        wait=False,
        env_procs=procs,
    ) as pending:
        pre = PrefetchedEnv(pending, *first_batch(seeds, batch, "r1-c0-e0"))
        pre.ready()
    return pre.service_up_at - t0, pre.reset_at - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--games", type=Path, required=True, help="a run's games dir (plan/games)")
    ap.add_argument("--tasks", type=int, default=64, help="the first N train tasks form the shard")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--env-procs", type=int, nargs="+", default=[0, 2, 4])
    ap.add_argument("--concurrent", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    index = json.loads((args.games / "games.json").read_text())
    tasks = list(index["train"])[: args.tasks]
    rows = []
    with tempfile.TemporaryDirectory(prefix="fa-envstart-") as tmp:
        for conc in args.concurrent:
            for procs in args.env_procs:
                ups, resets = [], []
                for rep in range(args.repeats):
                    out: list = [None] * conc

                    def run(k, rep=rep, procs=procs):
                        out[k] = one_start(
                            args.games,
                            tasks,
                            args.batch,
                            args.groups,
                            procs,
                            Path(tmp) / f"c{conc}-p{procs}-r{rep}-{k}" / "job",
                        )

                    threads = [threading.Thread(target=run, args=(k,)) for k in range(conc)]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    ups += [o[0] for o in out]
                    resets += [o[1] for o in out]
                row = {
                    "concurrent": conc,
                    "env_procs": procs,
                    "service_up_s": statistics.median(ups),
                    "first_batch_reset_s": statistics.median(resets),
                    "max_reset_s": max(resets),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'concurrent':>10} {'env_procs':>9} {'service up':>11} {'batch reset':>12} {'worst':>7}")
    for r in rows:
        print(
            f"{r['concurrent']:>10} {r['env_procs']:>9} {r['service_up_s']:>10.3f}s {r['first_batch_reset_s']:>11.3f}s "
            f"{r['max_reset_s']:>6.3f}s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
