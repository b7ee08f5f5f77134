"""The run's summary table (pandas) and learning curve (matplotlib) from the eval.json files."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pandas as pd

SUMMARY_COLUMNS = [
    "round",
    "model",
    "n",
    "success_rate",
    "ci95_low",
    "ci95_high",
    "score_mean",
    "return_mean",
    "clients_dropped",
]
# model: random:<architecture>: its evals carry random_weights, and the tables get this last
# column (only then: every other run's files stay as they were) and the curve a warning title.
WEIGHTS_COLUMN = "weights"


def _weights_note(data: dict) -> str | None:
    """eval.json's note on random weights (None: the model's weights are not random)."""
    rw = data.get("random_weights")
    return f"{rw['note']} ({rw['source']})" if rw else None


def _with_weights_column(table: pd.DataFrame, notes: list) -> pd.DataFrame:
    if any(notes):
        table[WEIGHTS_COLUMN] = [n or "" for n in notes]
    return table


def _with_round_notes(table: pd.DataFrame, notes: list[dict]) -> pd.DataFrame:
    """eval.json's ``round_notes`` (the aggregation rule's and the Byzantine clients' scalars: DP's
    ``dp_epsilon``, ``byzantine_clients``), one column each in name order, only when some round has
    them (every other run's table stays as it was); a round without one is empty there."""
    for key in sorted({k for n in notes for k in n}):
        table[key] = [n.get(key) for n in notes]
    return table


# Row order within a round: the base model before the warm start made from it.
_MODEL_ORDER = {"base": 0, "warm_start": 1, "aggregated": 2}


def summary_table(eval_files: list[Path]) -> pd.DataFrame:
    """One row per round (sorted numerically), round 0 labelled ``base``.

    With the expert warm start (``warm_start.enabled``) round 0 has two rows: ``base`` (the base
    model, ``round_000/base_eval.json``) and ``warm_start`` (round 0's model), as each eval.json's
    ``label`` says."""
    rows, notes, round_notes = [], [], []
    for path in eval_files:
        data = json.loads(Path(path).read_text())
        notes.append(_weights_note(data))
        round_notes.append(data.get("round_notes") or {})
        low, high = data.get("ci95", [None, None])
        rows.append(
            {
                "round": int(data["round"]),
                "model": data.get("label") or ("base" if int(data["round"]) == 0 else "aggregated"),
                "n": data["n"],
                "success_rate": data["success_rate"],
                "ci95_low": low,
                "ci95_high": high,
                "score_mean": data.get("score_mean"),
                "return_mean": data.get("return_mean"),
                # clients dropped in this round (clients.min_per_round), space-separated ids
                "clients_dropped": " ".join(map(str, data.get("dropped_clients", []))),
            }
        )
    table = _with_round_notes(_with_weights_column(pd.DataFrame(rows, columns=SUMMARY_COLUMNS), notes), round_notes)
    table = (
        table.assign(_order=table["model"].map(_MODEL_ORDER).fillna(3))
        .sort_values(["round", "_order"], kind="stable")
        .drop(columns="_order")
    )
    dup = table[["round", "model"]].duplicated()
    if dup.any():
        raise ValueError(f"duplicate rounds in eval files: {sorted(table['round'][dup])}")
    return table.reset_index(drop=True)


TIMING_COLUMNS = [
    "round",
    "train_jobs",
    "train_job_s",
    "cold_start_s",
    "cold_start_share",
    "generation_s",
    "training_s",
    "aggregate_s",
    "merge_s",
    "eval_s",
    "eval_cold_start_s",
    "eval_generation_s",
    "generation_env_s",
    "generation_prompt_s",
    "generation_sample_s",
    "eval_env_s",
    "eval_prompt_s",
    "eval_sample_s",
    "train_gpu_peak_mib",
    "eval_gpu_peak_mib",
    "round_wall_s",
    "upload_bytes_per_client",
    "full_update_bytes",
    "upload_reduction",
]


def _bench_seconds(path: Path) -> float:
    """Wall seconds of one job from its Snakemake benchmark file (first row's ``s``)."""
    table = pd.read_csv(path, sep="\t")
    return float(table["s"].iloc[0])


def round_timings(round_: int, eval_timings: Path, benchmarks: list[Path], clients: list[Path]) -> dict:
    """One row of the per-round time split, summed over the round's jobs (seconds).

    Train jobs: cold start (process start → first sampled token) and generation / training
    phases from each client's ``metrics.json``; every job's wall time from its Snakemake
    benchmark file; eval's split from ``eval_timings.json``. Wall clock, informational only. On the GPU
    also the peak memory the allocator reserved: the largest train job's and the eval's (empty on the CPU).
    ``round_wall_s``: the round's span, from its first train job's process start to the end of its
    eval (``started_at`` + ``total_s`` of the jobs' timings); empty for round 0 (no train jobs) and for
    files written before the jobs recorded ``started_at``. What a client sent the server: the mean of
    the updates' ``upload_bytes`` (every file of the model update), what a full-model update of the same
    model weighs (a LoRA update's ``lora.full_model_bytes``, its fp32 parameters; a full update's own
    bytes) and their ratio (``upload_reduction``: 1 for full updates). The rollout loop's split of the
    generation phases (``generation_*``: the train jobs', summed; ``eval_*``: the eval's): the env
    service's calls (``env``), building and tokenizing the prompts (``prompt``) and the sampler's calls
    (``sample``), :func:`fedagent.rollout.episode.run_episodes`; empty for jobs that did not record it.
    """
    by_name = {Path(b).stem: _bench_seconds(Path(b)) for b in benchmarks}
    ev = json.loads(Path(eval_timings).read_text())
    # A dropped client (clients.min_per_round) left dropped.json, no metrics: it trained nothing.
    trained = [Path(c) for c in clients if (Path(c) / "metrics.json").is_file()]
    metrics = [json.loads((c / "metrics.json").read_text()) for c in trained]
    train = [m.get("timings", {}) for m in metrics]
    peaks = [m["gpu_peak_reserved_mib"] for m in metrics if "gpu_peak_reserved_mib" in m]
    train_job_s = sum(v for k, v in by_name.items() if k.startswith("train_client_"))
    cold = sum(t.get("cold_start_s") or 0.0 for t in train)
    sent = [m["upload_bytes"] for m in metrics if "upload_bytes" in m]
    full = [(m.get("lora") or {}).get("full_model_bytes", m.get("upload_bytes")) for m in metrics]
    upload = round(sum(sent) / len(sent)) if sent and len(sent) == len(metrics) else None
    full_bytes = max(full) if full and None not in full else None
    return {
        "round": int(round_),
        "train_jobs": len(trained),
        "train_job_s": round(train_job_s, 3),
        "cold_start_s": round(cold, 3),
        "cold_start_share": round(cold / train_job_s, 4) if train_job_s else None,
        "generation_s": round(sum(t.get("phases", {}).get("rollout", 0.0) for t in train), 3),
        "training_s": round(sum(t.get("phases", {}).get("train", 0.0) for t in train), 3),
        "aggregate_s": by_name.get("aggregate"),
        "merge_s": by_name.get("merge"),
        "eval_s": by_name.get("eval"),
        "eval_cold_start_s": ev.get("cold_start_s"),
        "eval_generation_s": ev.get("phases", {}).get("rollout"),
        **{f"generation_{k}_s": _summed(train, f"rollout_{k}") for k in ("env", "prompt", "sample")},
        **{f"eval_{k}_s": ev.get("phases", {}).get(f"rollout_{k}") for k in ("env", "prompt", "sample")},
        "train_gpu_peak_mib": max(peaks) if peaks else None,
        "eval_gpu_peak_mib": ev.get("gpu_peak_reserved_mib"),
        "round_wall_s": _round_wall(train, ev),
        "upload_bytes_per_client": upload,
        "full_update_bytes": full_bytes,
        "upload_reduction": round(full_bytes / upload, 1) if upload and full_bytes else None,
    }


def _summed(timings: list[dict], phase: str) -> float | None:
    """``phase`` summed over the jobs' timings, or None when a job did not record it."""
    xs = [t.get("phases", {}).get(phase) for t in timings]
    return round(sum(xs), 3) if xs and None not in xs else None


def _round_wall(train: list[dict], ev: dict) -> float | None:
    """First train job's start → the eval's end (seconds), or None when a start is not recorded."""
    starts = [t.get("started_at") for t in train]
    if not starts or None in starts or ev.get("started_at") is None or ev.get("total_s") is None:
        return None
    return round(ev["started_at"] + ev["total_s"] - min(starts), 3)


def timings_table(row: dict, prev: Path | None) -> pd.DataFrame:
    """The previous round's table (rounds < r) plus this round's row."""
    rows = pd.read_csv(prev).to_dict("records") if prev is not None else []
    rows = [r for r in rows if int(r["round"]) != int(row["round"])] + [row]
    return pd.DataFrame(rows, columns=TIMING_COLUMNS).sort_values("round", kind="stable").reset_index(drop=True)


CLIENT_COLUMNS = ["round", "client", "n", "success_rate", "ci95_low", "ci95_high", "score_mean", "return_mean"]


def client_table(eval_files: list[Path]) -> pd.DataFrame:
    """One row per (round, client) from per-client eval files (``eval.clients: true``)."""
    rows, notes = [], []
    for path in eval_files:
        data = json.loads(Path(path).read_text())
        if data.get("client") is None:
            raise ValueError(f"{path}: not a per-client eval (no 'client')")
        notes.append(_weights_note(data))
        low, high = data.get("ci95", [None, None])
        rows.append(
            {
                "round": int(data["round"]),
                "client": int(data["client"]),
                "n": data["n"],
                "success_rate": data["success_rate"],
                "ci95_low": low,
                "ci95_high": high,
                "score_mean": data.get("score_mean"),
                "return_mean": data.get("return_mean"),
            }
        )
    table = _with_weights_column(pd.DataFrame(rows, columns=CLIENT_COLUMNS), notes)
    return table.sort_values(["round", "client"], kind="stable").reset_index(drop=True)


def plot_curves(table: pd.DataFrame, out: Path, clients: pd.DataFrame | None = None) -> None:
    """Validation success rate per round with its 95 % interval (and client updates as circles)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    # warm_start.enabled: round 0's base row is a separate point; the curve starts at the warm start
    base = table[(table["model"] == "base") & table["round"].duplicated(keep=False)]
    table = table.drop(index=base.index)
    ax.plot(table["round"], table["success_rate"], "o-", color="tab:red", label="global model")
    if table["ci95_low"].notna().all():
        ax.fill_between(
            table["round"], table["ci95_low"], table["ci95_high"], color="tab:red", alpha=0.15, label="95 % interval"
        )
    if len(base):
        ax.errorbar(
            base["round"],
            base["success_rate"],
            yerr=[base["success_rate"] - base["ci95_low"], base["ci95_high"] - base["success_rate"]],
            fmt="s",
            color="tab:gray",
            capsize=3,
            label="base model (before the warm start)",
        )
    if clients is not None and len(clients):
        ax.scatter(
            clients["round"],
            clients["success_rate"],
            s=36,
            facecolors="none",
            edgecolors="tab:blue",
            label="client updates",
            zorder=3,
        )
    ax.set_xlabel("round (0 = warm start)" if len(base) else "round (0 = base model)")
    ax.set_ylabel("validation success rate")
    if WEIGHTS_COLUMN in table.columns and table[WEIGHTS_COLUMN].astype(bool).any():
        ax.set_title("RANDOM WEIGHTS: for speed and memory only, not results", color="tab:red", fontsize=9)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xticks(list(table["round"]))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    # Fixed metadata so the same table gives the same bytes.
    fig.savefig(out, format="png", metadata={"Software": None})
    plt.close(fig)


def summary_html(table: pd.DataFrame, curves: Path, timings: pd.DataFrame | None = None, title: str = "") -> str:
    """One self-contained page: the learning curve (the PNG inline) above the summary table (and the
    time split): what ``snakemake --report`` shows for a round, readable without the report too."""
    import base64
    import html

    png = base64.b64encode(Path(curves).read_bytes()).decode()
    parts = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8">',
        f"<title>{html.escape(title or 'fedagent summary')}</title>",
        "<style>body{font-family:sans-serif;margin:1em}table{border-collapse:collapse;font-size:13px}"
        "th,td{border:1px solid #bbb;padding:2px 8px;text-align:right}th{background:#eee}</style>",
        "</head><body>",
        f"<h2>{html.escape(title or 'fedagent summary')}</h2>",
        f'<img id="curves" alt="validation success rate per round" src="data:image/png;base64,{png}">',
        "<h3>Validation per round</h3>",
        table.to_html(index=False, na_rep="", table_id="summary", border=0),
    ]
    if timings is not None:
        parts += [
            "<h3>Time split per round (s)</h3>",
            timings.to_html(index=False, na_rep="", table_id="timings", border=0),
        ]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def link_latest(run_dir: Path, summary: Path, curves: Path, round_: int) -> bool:
    """Point ``run_dir/summary.csv`` and ``curves.png`` at this round's files if it is the newest.

    Relative symlinks, replaced atomically; a link to a later round is left alone (re-running
    an earlier round's report must not hide later rounds). Returns whether links were updated.
    """
    run_dir = Path(run_dir)
    current = run_dir / "summary.csv"
    if current.is_symlink():
        target = Path(os.readlink(current))
        try:
            if int(target.parent.name.removeprefix("round_")) > round_:
                return False
        except ValueError:
            pass
    for name, path in (("summary.csv", summary), ("curves.png", curves)):
        rel = os.path.relpath(Path(path).resolve(), run_dir.resolve())
        tmp = run_dir / f".partial-{name}.link"
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(rel, tmp)
        os.replace(tmp, run_dir / name)
    return True


def add_args(parser: argparse.ArgumentParser) -> None:
    """CLI flags of ``fedagent report``."""
    parser.add_argument("--evals", type=Path, nargs="+", required=True)
    parser.add_argument("--summary", type=Path, required=True)
    parser.add_argument("--curves", type=Path, required=True)
    parser.add_argument("--round", type=int, default=None, help="this report's round (with --timings)")
    parser.add_argument("--eval-timings", type=Path, default=None, help="this round's eval_timings.json")
    parser.add_argument("--benchmarks", type=Path, nargs="*", default=[], help="this round's Snakemake benchmark files")
    parser.add_argument("--clients", nargs="*", default=[], help="this round's client update dirs ('none': round 0)")
    parser.add_argument("--prev-timings", default="none", help="previous round's timings.csv ('none': round 0)")
    parser.add_argument("--timings", type=Path, default=None, help="timings.csv to write (rounds 0..r)")
    parser.add_argument(
        "--client-evals",
        type=Path,
        nargs="*",
        default=[],
        help="per-client eval files: rows in --client-summary, circles on the curve",
    )
    parser.add_argument(
        "--client-summary",
        type=Path,
        default=None,
        help="client_summary.csv to write (eval.clients; header only before any client eval)",
    )
    parser.add_argument(
        "--html", type=Path, default=None, help="summary.html to write: the curve and the tables, one page"
    )
    parser.add_argument("--points", type=Path, default=None, help="points.csv to write (rounds 0..r; with --timings)")
    parser.add_argument("--prev-points", default="none", help="previous round's points.csv ('none': round 0)")
    parser.add_argument(
        "--trackers",
        default="none",
        help="comma-separated report.trackers: stores rebuilt from --points when this round is the newest",
    )
    parser.add_argument(
        "--link-latest",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="point RUN_DIR/summary.csv and curves.png at these files if newest",
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent report``: writes summary.csv and curves.png atomically."""
    from fedagent.core.atomic import atomic_write_text
    from fedagent.report.points import eval_end, points_table, round_points
    from fedagent.report.tracking import parse_trackers, publish_run

    table = summary_table(args.evals)
    atomic_write_text(args.summary, table.to_csv(index=False))
    clients = client_table(args.client_evals) if args.client_evals else None
    client_summary = getattr(args, "client_summary", None)
    if clients is not None and client_summary is None:
        raise SystemExit("fedagent report: --client-evals needs --client-summary (the file to write)")
    if client_summary is not None:
        table_c = clients if clients is not None else pd.DataFrame(columns=CLIENT_COLUMNS)
        atomic_write_text(client_summary, table_c.to_csv(index=False))
    tmp = args.curves.with_name(".partial-" + args.curves.name)
    plot_curves(table, tmp, clients)
    tmp.replace(args.curves)
    trackers = parse_trackers(getattr(args, "trackers", "none"))
    points = getattr(args, "points", None)
    if trackers and (points is None or args.link_latest is None):
        raise SystemExit("fedagent report: --trackers needs --points and --link-latest")
    if points is not None and getattr(args, "timings", None) is None:
        raise SystemExit("fedagent report: --points needs --timings (and its --round, --eval-timings)")
    if getattr(args, "timings", None) is not None:
        if args.round is None or args.eval_timings is None:
            raise SystemExit("fedagent report: --timings needs --round and --eval-timings")
        clients = [Path(c) for c in args.clients if c != "none"]
        prev = None if args.prev_timings == "none" else Path(args.prev_timings)
        row = round_timings(args.round, args.eval_timings, args.benchmarks, clients)
        atomic_write_text(args.timings, timings_table(row, prev).to_csv(index=False))
        if points is not None:
            found = round_points(args.round, args.evals, clients, row, args.client_evals)
            prev_points = None if args.prev_points == "none" else Path(args.prev_points)
            table_p = points_table(args.round, found, eval_end(args.eval_timings), prev_points)
            atomic_write_text(points, table_p.to_csv(index=False))
    html_out = getattr(args, "html", None)
    if html_out is not None:
        timings_df = pd.read_csv(args.timings) if getattr(args, "timings", None) is not None else None
        title = (
            f"{args.link_latest.name if args.link_latest is not None else 'run'}: rounds 0..{int(table['round'].max())}"
        )
        atomic_write_text(html_out, summary_html(table, args.curves, timings_df, title))
    newest = False
    if args.link_latest is not None:
        newest = link_latest(args.link_latest, args.summary, args.curves, int(table["round"].max()))
    if trackers and newest:  # an earlier round's report re-run leaves the newer round's stores alone
        publish_run(args.link_latest, points, trackers)
    return 0
