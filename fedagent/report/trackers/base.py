"""What a tracker is, and the run record every tracker writes from."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the registry imports this module with the config's: pandas only where a record is made
    import pandas as pd


@dataclass
class RunRecord:
    """One run as the trackers see it: its name, its points (``points.csv``: round, key, value, time),
    its parameters (the config and provenance, flat: ``train.lr`` → ``"1e-06"``), tags, and whether
    its last round is reported."""

    name: str
    points: pd.DataFrame
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    finished: bool = False

    def rounds(self) -> list[int]:
        return sorted({int(r) for r in self.points["round"]})

    def round_time(self, round_: int) -> float:
        """The round's timestamp (its eval's end, epoch seconds); the round number when none was recorded."""
        times = self.points.loc[self.points["round"] == round_, "time"].dropna()
        return float(times.iloc[0]) if len(times) else float(round_)


class Tracker:
    """One sink. ``name``: its ``report.trackers`` name; ``dirname``: its store's directory in the run
    (and the matrix) directory; ``matrix``: whether a matrix gets a store of its own (one experiment,
    a run per arm × seed) — False where the matrix directory already shows every run (TensorBoard's
    logdir holds the runs' own event files)."""

    name: str = ""
    dirname: str = ""
    matrix: bool = False

    def write(self, experiment: str, runs: list[RunRecord], dest: Path, final: Path) -> None:
        """Write the whole store for ``runs`` into the empty directory ``dest``, which is renamed to
        ``final`` afterwards (a store that records its own path records ``final``)."""
        raise NotImplementedError
