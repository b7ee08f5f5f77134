"""WebShop: search latency (per arm), step latency, and service steps/s vs in-process.

1. Search: median / p90 latency of one BM25 search (``bm25s``) over the synthetic catalogue,
   for the unperturbed top-50 and for every arm at top-200 (the env arms' depth); ratio to
   the unperturbed top-200 search measured in the same run.
2. Step: median latency of in-process ``WebShopEnv.step`` by kind (search / click) over a
   scripted walk (search the goal, open results, items, options, sub-pages, pages, back).
3. Service: steps/s of C sessions (default 64) in the rollout loop's shape through a
   job-scoped ``fedagent serve-env --source webshop`` (one ``/create_batch``, one
   ``/reset_batch`` per episode, one ``/step_batch`` per step, one ``/close_batch``) vs the
   same lockstep walk on C in-process envs from C threads; measured alternately
   (``--repeats``), ratio service / in-process printed.

The walk is the same everywhere: :func:`choose` picks the k-th action from the admissible
list the env returned (a search of the goal text where a search bar is shown), never
"buy now", so every episode runs its ``--steps``.

    python bench/webshop.py [--products 1000] [--concurrency 64] [--episodes 2] [--steps 15]
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
from fedagent.envs.webshop import arms
from fedagent.envs.webshop.build import build_catalog
from fedagent.envs.webshop.source import WebShopTaskSource


def choose(admissible: list[str], task: str, k: int) -> str:
    """The walk's k-th action: search the goal where possible, else a fixed-stride click."""
    if "search[<your query>]" in admissible:
        return f"search[{task}]"
    clicks = [a for a in admissible if a != "click[buy now]"]
    return clicks[(7 * k + 3) % len(clicks)]


def answer(action: str) -> str:
    """A well-formed model answer for ``action``."""
    return f"<think>bench</think><action>{action}</action>"


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_search(products, queries, repeats: int) -> None:
    """Latency table of one search per arm."""
    print(f"\nsearch latency over {len(products)} products, {len(queries)} goal texts")
    print(f"{'view':<34} {'K':>4} {'median ms':>10} {'p90 ms':>8} {'vs none@200':>12}")
    cases = [("none", arms.ArmSpec(search_return_n=50)), ("none", arms.ArmSpec(search_return_n=200))]
    for arm, pool in arms.POOLS.items():
        for k in range(len(pool)):
            if arm in ("lookalike", "rank_wrapper") or k < 4:
                cases.append(
                    (f"{arm}[{k}]", arms.ArmSpec(arm=arm, variant=k, variant_n=len(pool), search_return_n=200))
                )
    cases.append(("catalog_split(0.7)", arms.ArmSpec(arm="catalog_split", env_div=0.7, search_return_n=200)))
    base = None
    for name, spec in cases:
        view = arms.build_view(products, spec, client=1, served_goals=[])
        times = []
        for _ in range(repeats):
            for q in queries:
                t0 = time.perf_counter()
                view.search(q)
                times.append(time.perf_counter() - t0)
        med = statistics.median(times) * 1e3
        if name == "none" and spec.search_return_n == 200:
            base = med
        ratio = f"{med / base:>12.2f}" if base else f"{'':>12}"
        print(f"{name:<34} {spec.search_return_n:>4} {med:>10.2f} {pct(times, 0.9) * 1e3:>8.2f} {ratio}", flush=True)


def bench_steps(source, tasks, episodes: int, steps: int) -> None:
    """In-process step latency by action kind."""
    env = source.make_env(10_000)
    kinds: dict[str, list[float]] = {"search": [], "click": []}
    for e in range(episodes):
        r = env.reset(tasks[e % len(tasks)])
        adm, task = r.admissible_commands, r.task
        for k in range(steps):
            a = choose(adm, task, k)
            t0 = time.perf_counter()
            s = env.step(a)
            kinds[a.split("[", 1)[0]].append(time.perf_counter() - t0)
            adm = s.admissible_commands
    print(f"\nin-process step latency ({episodes} episodes x {steps} steps)")
    for kind, ts in kinds.items():
        if ts:
            print(
                f"  {kind:<7} n={len(ts):>5} median {statistics.median(ts) * 1e3:.3f} ms  p90 {pct(ts, 0.9) * 1e3:.3f} ms"
            )


def run_inprocess_lockstep(source, tasks, conc, episodes, steps) -> float:
    """Steps/s of ``conc`` in-process envs stepped in lockstep from ``conc`` threads."""
    envs = [source.make_env(10_000) for _ in range(conc)]
    total = 0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as ex:
        for e in range(episodes):
            rs = list(ex.map(lambda i: envs[i].reset(task_for_seed(tasks, i * episodes + e, "index")), range(conc)))
            state = [(r.admissible_commands, r.task) for r in rs]
            for k in range(steps):
                outs = list(ex.map(lambda i: envs[i].step(choose(state[i][0], state[i][1], k)), range(conc)))
                state = [(o.admissible_commands, state[i][1]) for i, o in enumerate(outs)]
                total += conc
    return total / (time.perf_counter() - t0)


def run_service_batched(client, conc, episodes, steps) -> float:
    """Steps/s of ``conc`` sessions in lockstep through the batch routes (the rollout loop's shape)."""
    sids = [f"b{i}" for i in range(conc)]
    total = 0
    t0 = time.perf_counter()
    client.create_many(sids)
    try:
        for e in range(episodes):
            rs = client.reset_many([(sid, i * episodes + e) for i, sid in enumerate(sids)])
            state = [(r["admissible_commands"], r["task"]) for r in rs]
            for k in range(steps):
                outs = client.step_many(
                    [(sid, answer(choose(state[i][0], state[i][1], k))) for i, sid in enumerate(sids)]
                )
                state = [(o["admissible_commands"], state[i][1]) for i, o in enumerate(outs)]
                total += conc
    finally:
        client.close_many(sids)
    return total / (time.perf_counter() - t0)


def main() -> None:
    """Build a catalogue, run the three measurements, print tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--products", type=int, default=1000)
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64])
    ap.add_argument("--episodes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fa-bench-ws-"))
    t0 = time.perf_counter()
    build_catalog(work / "games", data_seed=42, n_products=args.products, val_goals=min(500, args.products))
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    source = WebShopTaskSource(work / "games")
    t_source = time.perf_counter() - t0
    tasks = source.task_ids("train")
    print(
        f"catalogue: {args.products} products, {len(source.goals)} goals; build {t_build:.2f} s, "
        f"service source (load + index) {t_source:.2f} s"
    )
    queries = [source.goals[t]["instruction_text"] for t in tasks[: args.queries]]
    bench_search(list(source.view.products.values()), queries, args.repeats)
    bench_steps(source, tasks, 20, args.steps)
    print(f"\nservice vs in-process, lockstep, {args.episodes} episodes x {args.steps} steps per session")
    print(f"{'sessions':>8} {'in-process steps/s':>19} {'service batched steps/s':>24} {'ratio':>6}")
    for conc in args.concurrency:
        inproc, served = [], []
        with env_service(
            work / "games",
            "train",
            tasks,
            work / f"svc{conc}",
            mode="index",
            pool_size=conc,
            max_turns=10_000,
            source="webshop",
        ) as client:
            for _ in range(args.repeats):  # alternate so machine load hits both
                inproc.append(run_inprocess_lockstep(source, tasks, conc, args.episodes, args.steps))
                served.append(run_service_batched(client, conc, args.episodes, args.steps))
        a, b = statistics.median(inproc), statistics.median(served)
        print(f"{conc:>8} {a:>19.1f} {b:>24.1f} {b / a:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
