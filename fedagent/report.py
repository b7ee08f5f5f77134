"""The run's summary table (pandas) and learning curve (matplotlib) from the eval.json files."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pandas as pd

SUMMARY_COLUMNS = ["round", "model", "n", "success_rate", "ci95_low", "ci95_high", "score_mean", "return_mean"]


def summary_table(eval_files: list[Path]) -> pd.DataFrame:
    """One row per round (sorted numerically), round 0 labelled ``base``."""
    rows = []
    for path in eval_files:
        data = json.loads(Path(path).read_text())
        low, high = data.get("ci95", [None, None])
        rows.append({
            "round": int(data["round"]),
            "model": "base" if int(data["round"]) == 0 else "aggregated",
            "n": data["n"],
            "success_rate": data["success_rate"],
            "ci95_low": low,
            "ci95_high": high,
            "score_mean": data.get("score_mean"),
            "return_mean": data.get("return_mean"),
        })
    table = pd.DataFrame(rows, columns=SUMMARY_COLUMNS).sort_values("round", kind="stable")
    if table["round"].duplicated().any():
        raise ValueError(f"duplicate rounds in eval files: {sorted(table['round'][table['round'].duplicated()])}")
    return table.reset_index(drop=True)


CLIENT_COLUMNS = ["round", "client", "n", "success_rate", "ci95_low", "ci95_high", "score_mean", "return_mean"]


def client_table(eval_files: list[Path]) -> pd.DataFrame:
    """One row per (round, client) from per-client eval files (``eval.clients: true``)."""
    rows = []
    for path in eval_files:
        data = json.loads(Path(path).read_text())
        if data.get("client") is None:
            raise ValueError(f"{path}: not a per-client eval (no 'client')")
        low, high = data.get("ci95", [None, None])
        rows.append({"round": int(data["round"]), "client": int(data["client"]), "n": data["n"],
                     "success_rate": data["success_rate"], "ci95_low": low, "ci95_high": high,
                     "score_mean": data.get("score_mean"), "return_mean": data.get("return_mean")})
    return pd.DataFrame(rows, columns=CLIENT_COLUMNS).sort_values(["round", "client"], kind="stable").reset_index(drop=True)


def plot_curves(table: pd.DataFrame, out: Path, clients: pd.DataFrame | None = None) -> None:
    """Validation success rate per round with its 95 % interval (and client updates as circles)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(table["round"], table["success_rate"], "o-", color="tab:red", label="global model")
    if table["ci95_low"].notna().all():
        ax.fill_between(table["round"], table["ci95_low"], table["ci95_high"], color="tab:red", alpha=0.15,
                        label="95 % interval")
    if clients is not None and len(clients):
        ax.scatter(clients["round"], clients["success_rate"], s=36, facecolors="none", edgecolors="tab:blue",
                   label="client updates", zorder=3)
    ax.set_xlabel("round (0 = base model)")
    ax.set_ylabel("validation success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xticks(list(table["round"]))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    # Fixed metadata so the same table gives the same bytes.
    fig.savefig(out, format="png", metadata={"Software": None})
    plt.close(fig)


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
    parser.add_argument("--client-evals", type=Path, nargs="*", default=[],
                        help="per-client eval files: rows in client_summary.csv beside --summary, circles on the curve")
    parser.add_argument("--link-latest", type=Path, default=None, metavar="RUN_DIR",
                        help="point RUN_DIR/summary.csv and curves.png at these files if newest")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent report``: writes summary.csv and curves.png atomically."""
    from fedagent.atomic import atomic_write_text

    table = summary_table(args.evals)
    atomic_write_text(args.summary, table.to_csv(index=False))
    clients = client_table(args.client_evals) if args.client_evals else None
    if clients is not None:
        atomic_write_text(args.summary.with_name("client_summary.csv"), clients.to_csv(index=False))
    tmp = args.curves.with_name(".partial-" + args.curves.name)
    plot_curves(table, tmp, clients)
    tmp.replace(args.curves)
    if args.link_latest is not None:
        link_latest(args.link_latest, args.summary, args.curves, int(table["round"].max()))
    return 0
