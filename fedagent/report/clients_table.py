"""``fedagent clients-table``: every train job of a matrix's runs side by side, one row per (arm, seed, round, client).

Each run's last ``points.csv`` (:mod:`fedagent.report.points`) holds every round's client metrics as
``client/<c>/<name>`` keys: success, ``group_wins.*``, KL, entropy, ``by_epoch.*``, time, memory. Where a
matrix's arms share the seed, the partition, the selection and ``train.groups_per_epoch`` (an algorithm,
learning-rate or loss arm), a (seed, round, client) row is the same client drawing the same tasks in every
arm: a client's epoch draws its groups from seeds of (seed, round, client, epoch) alone
(:func:`fedagent.train.params.epoch_task_seeds`). So the arms' rows of one (seed, round, client) differ by
their policies only, while rows of different rounds also differ by the tasks drawn — on ALFWorld those
draws set the clients' success far more than any arm did (docs/results/learning.md, "ALFWorld: GRPO and
GiGPO without the entropy bonus"). Arms that change the partition or the selection draw different tasks.

- ``clients.csv``: ``arm``, ``seed``, ``round``, ``client``, then every metric name the runs logged (sorted;
  empty where a run has none), rows ordered by seed, round, client and then the runs' order.
- ``clients.md``: per (seed, round, client) the arms' ``success_rate`` and ``kl`` side by side.

A pure function of the points files: the same files give the same bytes. pandas does the reshaping.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

ID_COLUMNS = ["arm", "seed", "round", "client"]
CLIENT_KEY = r"^client/(\d+)/(.+)$"
MARKDOWN_METRICS = ("success_rate", "kl")


def client_metrics(points: Path | str) -> pd.DataFrame:
    """One run's client rows from its ``points.csv``: ``round``, ``client`` and one column per metric."""
    from fedagent.report.points import read_points

    table = read_points(Path(points))
    parts = table["key"].str.extract(CLIENT_KEY)
    keep = parts[0].notna()
    long = pd.DataFrame(
        {
            "round": table.loc[keep, "round"].astype(int),
            "client": parts.loc[keep, 0].astype(int),
            "metric": parts.loc[keep, 1],
            "value": table.loc[keep, "value"],
        }
    )
    if long.empty:
        return pd.DataFrame(columns=["round", "client"])
    wide = long.pivot(index=["round", "client"], columns="metric", values="value")
    wide.columns.name = None
    return wide.reset_index()


def build_table(runs: list[dict]) -> pd.DataFrame:
    """Every run's client rows (``runs``: ``{"arm", "seed", "points"}`` each), keyed and ordered as the module
    docstring says."""
    if not runs:
        raise ValueError("no runs")
    frames = []
    for order, run in enumerate(runs):
        rows = client_metrics(run["points"])
        rows.insert(0, "arm", str(run["arm"]))
        rows.insert(1, "seed", int(run["seed"]))
        rows["_order"] = order
        frames.append(rows)
    table = pd.concat(frames, ignore_index=True, sort=False)
    metrics = sorted(c for c in table.columns if c not in ID_COLUMNS and c != "_order")
    table = table.sort_values(["seed", "round", "client", "_order"], kind="stable")
    return table[ID_COLUMNS + metrics].reset_index(drop=True)


def markdown(table: pd.DataFrame, name: str) -> str:
    """The arms' success and KL per (seed, round, client), one table each."""
    arms = list(dict.fromkeys(table["arm"]))
    lines = [
        f"# {name}: the train jobs side by side",
        "",
        "One row per (seed, round, client): where the arms share the partition and the selection, the same",
        "client drawing the same tasks in every arm (fedagent.report.clients_table). Every metric: clients.csv.",
    ]
    for metric in MARKDOWN_METRICS:
        if metric not in table.columns:
            continue
        wide = table.pivot(index=["seed", "round", "client"], columns="arm", values=metric)
        lines += ["", f"## {metric}", "", "| seed | round | client | " + " | ".join(arms) + " |"]
        lines.append("|---" * (3 + len(arms)) + "|")
        for (seed, rnd, client), row in wide.iterrows():
            cells = ["" if pd.isna(row.get(a)) else f"{float(row[a]):.4f}" for a in arms]
            lines.append(f"| {seed} | {rnd} | {client} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--matrix", required=True, help="the matrix's name (the title of clients.md)")
    parser.add_argument(
        "--runs",
        required=True,
        help='JSON list of {"arm", "seed", "points": path to the run\'s last points.csv}, or @FILE holding it',
    )
    parser.add_argument("--csv", required=True, type=Path)
    parser.add_argument("--md", required=True, type=Path)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent clients-table``: clients.csv and clients.md, each written atomically."""
    from fedagent.core.atomic import atomic_write_text

    text = args.runs
    try:
        if text.startswith("@"):
            text = Path(text[1:]).read_text()
        runs = json.loads(text)
        table = build_table(runs)
    except OSError as exc:
        print(f"fedagent clients-table: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, TypeError) as exc:  # not JSON, a run without arm/seed/points, a bad points file
        print(f"fedagent clients-table: --runs: {exc!r}", file=sys.stderr)
        return 2
    atomic_write_text(args.csv, table.to_csv(index=False))
    atomic_write_text(args.md, markdown(table, args.matrix))
    print(f"fedagent clients-table: {len(table)} train jobs of {table['arm'].nunique()} arms -> {args.csv}")
    return 0
