"""``fedagent matrix-table``: a matrix's comparison table and picture from its runs' ``summary.csv`` files.

One row per arm (``table.csv``, ``table.md``), from each run's last ``summary.csv`` (it has every round):

- ``final_mean`` — the last round's validation success, mean over the arm's seeds, with a 95 % interval
  across seeds (Student's t on the per-seed values, k − 1 degrees of freedom, clipped to [0, 1]; none for
  one seed: with two seeds t = 12.7, so such an interval says little) and the
  pooled binomial interval (Wilson, all seeds' episodes together: ``pooled_wins`` / ``pooled_n``). The
  seeds share one validation set (``data_seed`` drives plan/), so the pooled interval treats repeated
  tasks as independent draws: it is the narrower, optimistic one; the across-seed one carries the
  seeds' spread.
- ``final_per_seed`` — ``seed:value`` for each seed.
- ``auc`` — the area under the success curve over rounds 0..R divided by R (trapezoids; 1 = won
  everything from round 0), mean over seeds.
- ``rounds_to_half_best`` — the first round at which the arm's mean curve reaches half of its best
  value (empty when the best is 0).
- against the matrix's reference arm: ``diff`` (final_mean − the reference's), its 95 % interval
  across seeds (Welch's t) and the pooled one (Newcombe's hybrid score interval for a difference of
  two proportions); ``significant`` is ``higher``/``lower`` only when both intervals exclude 0, else
  ``no`` (``-`` for the reference itself and where an interval cannot be formed).

- paired, when every run gives its eval files (``eval``: the last round's eval.json, ``start_eval``: round
  0's; the workflow passes both): the arms are scored on one fixed validation set, so each validation episode
  (its seed and task) is a pair. ``start_gained`` / ``start_lost``: the episodes the last round won and round 0
  lost, and the reverse, summed over the arm's seeds; ``start_p``: the exact two-sided McNemar test of that
  split (the binomial test at ½ on the discordant pairs, scipy's). ``ref_gained`` / ``ref_lost`` / ``ref_p``:
  the same against the reference arm's last round, seed by seed. Pairing removes the tasks' own difficulty
  from the comparison, so it tells a rise apart where two intervals of the rates still overlap.

Round 0 is the run's round-0 model: the base model, or the warm start when there is one (its
``base`` row is kept as ``base_mean``). ``curves.png``: every arm's mean curve with its band (the
across-seed interval; one seed: that run's own Wilson interval). Everything is a pure function of
the summary files: the same files give the same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

TABLE_COLUMNS = [
    "arm",
    "reference",
    "seeds",
    "rounds",
    "final_mean",
    "final_ci_low",
    "final_ci_high",
    "pooled_wins",
    "pooled_n",
    "pooled_rate",
    "pooled_ci_low",
    "pooled_ci_high",
    "final_per_seed",
    "auc",
    "rounds_to_half_best",
    "base_mean",
    "diff",
    "diff_ci_low",
    "diff_ci_high",
    "diff_pooled_ci_low",
    "diff_pooled_ci_high",
    "significant",
]


# The paired columns (module docstring), present when every run gives its eval files.
PAIRED_COLUMNS = ["start_gained", "start_lost", "start_p", "ref_gained", "ref_lost", "ref_p"]


def episode_outcomes(eval_json: Path | str) -> dict[str, bool]:
    """Won or not per validation episode of an eval.json, keyed ``<seed>:<task_id>`` (its samples)."""
    samples = json.loads(Path(eval_json).read_text()).get("samples") or []
    try:
        out = {f"{x['seed']}:{x['task_id']}": bool(x["won"]) for x in samples}
    except KeyError as exc:
        raise ValueError(
            f"{eval_json}: a sample without {exc}: pairing needs each episode's seed, task_id and won"
        ) from None
    if not out or len(out) != len(samples):
        raise ValueError(f"{eval_json}: no per-episode samples with distinct (seed, task_id) to pair")
    return out


def discordant(new: dict[str, bool], old: dict[str, bool], where: str) -> tuple[int, int]:
    """(episodes ``new`` won and ``old`` lost, episodes ``old`` won and ``new`` lost) on one validation set."""
    if new.keys() != old.keys():
        raise ValueError(f"{where}: the two evals scored different episodes: pairing needs one validation set")
    return sum(new[k] and not old[k] for k in new), sum(old[k] and not new[k] for k in new)


def mcnemar_p(gained: int, lost: int) -> float:
    """Two-sided exact McNemar p-value: the binomial test of ``gained`` of the discordant pairs at ½
    (scipy's); 1 when there are none."""
    from scipy.stats import binomtest

    n = gained + lost
    return 1.0 if n == 0 else float(binomtest(int(gained), n, 0.5).pvalue)


def wilson(wins: int, n: int) -> tuple[float, float]:
    """95 % Wilson score interval of wins/n (scipy's)."""
    from scipy.stats import binomtest

    if n == 0:
        return (0.0, 1.0)
    ci = binomtest(int(wins), int(n)).proportion_ci(confidence_level=0.95, method="wilson")
    return (float(ci.low), float(ci.high))


def t_interval(values: list[float]) -> tuple[float, float]:
    """95 % Student-t interval of the mean of ``values``, clipped to [0, 1] where a success rate can lie
    (NaNs for fewer than two)."""
    from scipy import stats

    if len(values) < 2:
        return (math.nan, math.nan)
    a = np.asarray(values, dtype=float)
    half = stats.t.ppf(0.975, len(a) - 1) * a.std(ddof=1) / math.sqrt(len(a))
    return (max(0.0, float(a.mean() - half)), min(1.0, float(a.mean() + half)))


def welch_interval(a: list[float], b: list[float]) -> tuple[float, float]:
    """95 % Welch interval of mean(a) − mean(b) (NaNs when either has fewer than two values; zero
    spread on both sides gives the point itself)."""
    from scipy import stats

    if len(a) < 2 or len(b) < 2:
        return (math.nan, math.nan)
    diff = float(np.mean(a) - np.mean(b))
    if np.std(a) == 0 and np.std(b) == 0:
        return (diff, diff)
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    return (max(-1.0, float(ci.low)), min(1.0, float(ci.high)))  # a difference of rates lies in [-1, 1]


def newcombe_interval(w1: int, n1: int, w2: int, n2: int) -> tuple[float, float]:
    """95 % interval of p1 − p2 (Newcombe 1998, method 10: hybrid score from the two Wilson intervals)."""
    p1, p2 = w1 / n1, w2 / n2
    l1, u1 = wilson(w1, n1)
    l2, u2 = wilson(w2, n2)
    d = p1 - p2
    return (d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2))


def run_curve(summary: Path) -> tuple[pd.DataFrame, float | None]:
    """(round → success_rate, n) of a run's round-0 model and every round; the base model's success when
    round 0 is a warm start (else None)."""
    table = pd.read_csv(summary)
    base = None
    if (table["round"] == 0).sum() > 1:  # warm start: round 0 has a base row and a warm_start row
        base = float(table[(table["round"] == 0) & (table["model"] == "base")]["success_rate"].iloc[0])
        table = table[~((table["round"] == 0) & (table["model"] == "base"))]
    curve = table[["round", "success_rate", "n"]].sort_values("round").reset_index(drop=True)
    if curve["round"].duplicated().any():
        raise ValueError(f"{summary}: more than one row for a round")
    return curve, base


# Round notes (the aggregation rule's summary columns) the table carries as the last round's value,
# per arm, when some run has them: client-level DP's ε and δ (fedagent.server.dp_fedavg).
NOTE_COLUMNS = ("dp_epsilon", "dp_delta")


def final_notes(summary: Path) -> dict:
    """The last round's values of :data:`NOTE_COLUMNS` in a run's summary.csv (absent or empty: left out)."""
    table = pd.read_csv(summary)
    last = table[table["round"] == table["round"].max()].iloc[-1]
    return {k: float(last[k]) for k in NOTE_COLUMNS if k in table.columns and not pd.isna(last[k])}


def auc(curve: pd.DataFrame) -> float:
    """Area under success(round) over rounds 0..R, divided by R (the value itself when R = 0)."""
    r, s = curve["round"].to_numpy(float), curve["success_rate"].to_numpy(float)
    if len(r) < 2:
        return float(s[0])
    return float(np.sum((s[1:] + s[:-1]) / 2 * np.diff(r)) / (r[-1] - r[0]))


def _fmt(x, pct=True) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{100 * x:.1f}" if pct else f"{x}"


def build_table(runs: list[dict], reference: str) -> tuple[pd.DataFrame, dict]:
    """The table (one row per arm, in the order arms first appear in ``runs``) and each arm's curves."""
    arms: dict[str, list[dict]] = {}
    for run in runs:
        curve, base = run_curve(Path(run["summary"]))
        last = curve.iloc[-1]
        arms.setdefault(run["arm"], []).append(
            {
                "seed": int(run["seed"]),
                "curve": curve,
                "base": base,
                "final": float(last["success_rate"]),
                "n": int(last["n"]),
                "wins": int(round(float(last["success_rate"]) * int(last["n"]))),
                "rounds": int(last["round"]),
                "notes": final_notes(Path(run["summary"])),
                "outcomes": episode_outcomes(run["eval"]) if run.get("eval") else None,
                "start_outcomes": episode_outcomes(run["start_eval"]) if run.get("start_eval") else None,
            }
        )
    if reference not in arms:
        raise ValueError(f"reference arm {reference!r} has no runs")
    paired = all(s["outcomes"] is not None and s["start_outcomes"] is not None for v in arms.values() for s in v)

    def stats_of(arm: str) -> dict:
        seeds = sorted(arms[arm], key=lambda s: s["seed"])
        finals = [s["final"] for s in seeds]
        wins, n = sum(s["wins"] for s in seeds), sum(s["n"] for s in seeds)
        curves = pd.concat([s["curve"].set_index("round")["success_rate"].rename(s["seed"]) for s in seeds], axis=1)
        mean_curve = curves.mean(axis=1)
        best = float(mean_curve.max())
        reach = mean_curve[mean_curve >= best / 2].index.min() if best > 0 else math.nan
        bases = [s["base"] for s in seeds if s["base"] is not None]
        return {
            "seeds": seeds,
            "finals": finals,
            "wins": wins,
            "n": n,
            "curves": curves,
            "mean_curve": mean_curve,
            "auc": float(np.mean([auc(s["curve"]) for s in seeds])),
            "reach": reach,
            "base": float(np.mean(bases)) if bases else math.nan,
        }

    ref = stats_of(reference)
    rows, curves = [], {}
    for arm in arms:
        st = ref if arm == reference else stats_of(arm)
        curves[arm] = st
        lo, hi = t_interval(st["finals"])
        plo, phi = wilson(st["wins"], st["n"])
        row = {
            "arm": arm,
            "reference": arm == reference,
            "seeds": " ".join(str(s["seed"]) for s in st["seeds"]),
            "rounds": max(s["rounds"] for s in st["seeds"]),
            "final_mean": float(np.mean(st["finals"])),
            "final_ci_low": lo,
            "final_ci_high": hi,
            "pooled_wins": st["wins"],
            "pooled_n": st["n"],
            "pooled_rate": st["wins"] / st["n"] if st["n"] else math.nan,
            "pooled_ci_low": plo,
            "pooled_ci_high": phi,
            "final_per_seed": " ".join(f"{s['seed']}:{s['final']:.4f}" for s in st["seeds"]),
            "auc": st["auc"],
            "rounds_to_half_best": st["reach"],
            "base_mean": st["base"],
        }
        if arm == reference:
            row.update(
                diff=0.0,
                diff_ci_low=math.nan,
                diff_ci_high=math.nan,
                diff_pooled_ci_low=math.nan,
                diff_pooled_ci_high=math.nan,
                significant="-",
            )
        else:
            dlo, dhi = welch_interval(st["finals"], ref["finals"])
            qlo, qhi = newcombe_interval(st["wins"], st["n"], ref["wins"], ref["n"])
            if math.isnan(dlo):
                sig = "-"
            elif dlo > 0 and qlo > 0:
                sig = "higher"
            elif dhi < 0 and qhi < 0:
                sig = "lower"
            else:
                sig = "no"
            row.update(
                diff=row["final_mean"] - float(np.mean(ref["finals"])),
                diff_ci_low=dlo,
                diff_ci_high=dhi,
                diff_pooled_ci_low=qlo,
                diff_pooled_ci_high=qhi,
                significant=sig,
            )
        if paired:
            row.update(_paired(arm, st["seeds"], {s["seed"]: s for s in ref["seeds"]}, arm == reference))
        for key in NOTE_COLUMNS:  # the largest over the seeds (DP's ε is the same for each)
            values = [s["notes"][key] for s in st["seeds"] if key in s["notes"]]
            row[key] = max(values) if values else math.nan
        rows.append(row)
    present = [k for k in NOTE_COLUMNS if any(not math.isnan(r[k]) for r in rows)]
    return pd.DataFrame(rows, columns=TABLE_COLUMNS + (PAIRED_COLUMNS if paired else []) + present), curves


def _paired(arm: str, seeds: list[dict], ref_by_seed: dict[int, dict], is_reference: bool) -> dict:
    """An arm's paired columns: its last round against its round 0 and against the reference's last round
    (the same seed's), discordant episodes summed over seeds."""
    up = down = 0
    for s in seeds:
        g, lost = discordant(s["outcomes"], s["start_outcomes"], f"arm {arm}, seed {s['seed']}: round 0")
        up, down = up + g, down + lost
    row = {"start_gained": up, "start_lost": down, "start_p": mcnemar_p(up, down)}
    no_ref = {"ref_gained": math.nan, "ref_lost": math.nan, "ref_p": math.nan}
    if is_reference or any(s["seed"] not in ref_by_seed for s in seeds):
        return {**row, **no_ref}
    up = down = 0
    for s in seeds:
        other = ref_by_seed[s["seed"]]
        g, lost = discordant(s["outcomes"], other["outcomes"], f"arm {arm}, seed {s['seed']}: the reference arm")
        up, down = up + g, down + lost
    return {**row, "ref_gained": up, "ref_lost": down, "ref_p": mcnemar_p(up, down)}


def markdown(table: pd.DataFrame, name: str, reference: str) -> str:
    """table.md: success in %, intervals in brackets."""
    lines = [
        f"# Matrix {name}",
        "",
        f"Validation success after the last round, in % (reference arm: `{reference}`). Across seeds: mean and "
        "95 % t-interval; pooled: all seeds' episodes, Wilson interval. Difference against the reference: "
        "Welch (seeds) and Newcombe (pooled) 95 % intervals; significant only when both exclude 0.",
        "",
        "| arm | seeds | rounds | final (mean) | 95 % across seeds | pooled | 95 % pooled | per seed | AUC | "
        "rounds to ½ best | diff vs ref | 95 % (seeds) | 95 % (pooled) | significant |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, r in table.iterrows():
        per_seed = ", ".join(
            f"{s.split(':')[0]}: {100 * float(s.split(':')[1]):.1f}" for s in r["final_per_seed"].split()
        )
        reach = "–" if pd.isna(r["rounds_to_half_best"]) else str(int(r["rounds_to_half_best"]))
        diff = "(reference)" if r["reference"] else f"{100 * r['diff']:+.1f}"
        lines.append(
            f"| {r['arm']} | {r['seeds']} | {r['rounds']} | {_fmt(r['final_mean'])} | "
            f"[{_fmt(r['final_ci_low'])}, {_fmt(r['final_ci_high'])}] | {r['pooled_wins']}/{r['pooled_n']} | "
            f"[{_fmt(r['pooled_ci_low'])}, {_fmt(r['pooled_ci_high'])}] | {per_seed} | {_fmt(r['auc'])} | {reach} | "
            f"{diff} | [{_fmt(r['diff_ci_low'])}, {_fmt(r['diff_ci_high'])}] | "
            f"[{_fmt(r['diff_pooled_ci_low'])}, {_fmt(r['diff_pooled_ci_high'])}] | {r['significant']} |"
        )
    if "start_p" in table.columns:
        lines += [
            "",
            "Paired on the validation episodes (one validation set: each episode's seed and task is a pair; summed "
            "over seeds): the episodes the last round won and the other lost (+) and the reverse (−), exact "
            "McNemar p (two-sided).",
            "",
            "| arm | vs round 0 | p | vs reference | p |",
            "|---|---|---|---|---|",
        ]
        for _, r in table.iterrows():
            if r["reference"]:
                vs_ref = ("(reference)", "")
            elif pd.isna(r["ref_p"]):  # a seed the reference arm does not have
                vs_ref = ("–", "")
            else:
                vs_ref = (f"+{int(r['ref_gained'])} / −{int(r['ref_lost'])}", f"{r['ref_p']:.2g}")
            lines.append(
                f"| {r['arm']} | +{int(r['start_gained'])} / −{int(r['start_lost'])} | {r['start_p']:.2g} | "
                f"{vs_ref[0]} | {vs_ref[1]} |"
            )
    if "dp_delta" in table.columns:
        lines += ["", "Client-level DP (fedagent.server.dp_fedavg), ε after the last round (dp-accounting):"]
        lines += [
            f"- {r['arm']}: "
            + ("no finite ε (no noise)" if pd.isna(r.get("dp_epsilon", math.nan)) else f"ε = {r['dp_epsilon']:.3g}")
            + f" at δ = {r['dp_delta']:g}"
            for _, r in table.iterrows()
            if not pd.isna(r["dp_delta"])
        ]
    return "\n".join(lines) + "\n"


def plot(curves: dict, out: Path, name: str) -> None:
    """Every arm's mean curve with its band (across seeds; one seed: the run's Wilson interval)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for i, (arm, st) in enumerate(curves.items()):
        color = f"C{i % 10}"
        mean = st["mean_curve"]
        ax.plot(mean.index, mean.values, "o-", ms=3, color=color, label=f"{arm} ({len(st['seeds'])} seeds)")
        if len(st["seeds"]) >= 2:
            band = np.array([t_interval(list(st["curves"].loc[r].dropna())) for r in mean.index])
        else:
            only = st["seeds"][0]["curve"]
            band = np.array([wilson(int(round(s * n)), int(n)) for s, n in zip(only["success_rate"], only["n"])])
        ax.fill_between(mean.index, np.clip(band[:, 0], 0, 1), np.clip(band[:, 1], 0, 1), color=color, alpha=0.12)
    ax.set_xlabel("round (0 = round 0's model)")
    ax.set_ylabel("validation success rate")
    ax.set_title(f"matrix {name}: mean over seeds, 95 % band")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, format="png", metadata={"Software": None})  # fixed metadata: same table, same bytes
    plt.close(fig)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--matrix", required=True, help="the matrix's name (titles)")
    parser.add_argument(
        "--runs",
        required=True,
        help='JSON list of {"arm", "seed", "summary": path to the run\'s last summary.csv, and optionally "eval" '
        "/ \"start_eval\": its last round's and round 0's eval.json (the paired columns)}, or @FILE holding it",
    )
    parser.add_argument("--reference", required=True, help="the arm every other is compared with")
    parser.add_argument("--csv", required=True, type=Path)
    parser.add_argument("--md", required=True, type=Path)
    parser.add_argument("--curves", required=True, type=Path)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent matrix-table``: table.csv, table.md and curves.png, each written atomically."""
    from fedagent.core.atomic import atomic_write_text

    text = args.runs
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            print(f"fedagent matrix-table: --runs {args.runs}: {exc.strerror}", file=sys.stderr)
            return 2
    try:
        runs = json.loads(text)
    except ValueError as exc:
        print(
            f"fedagent matrix-table: --runs: not a JSON list of runs ({exc}); give the JSON itself or @FILE",
            file=sys.stderr,
        )
        return 2
    try:
        table, curves = build_table(runs, args.reference)
    except (ValueError, OSError, KeyError) as exc:  # a missing reference arm, unpairable evals, an unreadable file
        print(f"fedagent matrix-table: {exc}", file=sys.stderr)
        return 2
    atomic_write_text(args.csv, table.to_csv(index=False))
    atomic_write_text(args.md, markdown(table, args.matrix, args.reference))
    tmp = args.curves.with_name(".partial-" + args.curves.name)
    plot(curves, tmp, args.matrix)
    tmp.replace(args.curves)
    print(table.to_string(index=False))
    return 0
