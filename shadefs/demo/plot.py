"""The demo's figure: hit ratio, test accuracy and epoch time per epoch, one line per run.

This module owns the PNG that ``shadefs demo`` writes. It draws with matplotlib's Agg
canvas directly (no pyplot, no display, no global backend state), so it works on a headless
training node and inside a test. matplotlib comes with the ``torch`` extra; only the demo
imports this module, never the daemon.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

#: Width and height of the PNG in pixels (the figure is 14 x 4.8 inches at this DPI).
DPI = 100
SIZE = (1400, 480)
#: One colour per run key; a run the demo does not know gets matplotlib's next colour.
COLOURS = {"uniform": "tab:red", "shade": "tab:blue"}


class EpochPoint(Protocol):
    """What the figure reads from an epoch record (``shadefs.demo.digits.EpochRecord``)."""

    @property
    def epoch(self) -> int: ...
    @property
    def hit_ratio(self) -> float | None: ...
    @property
    def test_accuracy(self) -> float: ...
    @property
    def epoch_time(self) -> float: ...
    @property
    def hits(self) -> int | None: ...
    @property
    def misses(self) -> int | None: ...


@dataclass(frozen=True)
class Run:
    """One line in every panel: the run's key (its colour), its legend label and its epochs."""

    key: str
    label: str
    epochs: Sequence[EpochPoint]


def _later(epochs: Sequence[EpochPoint]) -> Sequence[EpochPoint]:
    """Epochs 2.. (the cold first epoch only when it is alone): the steady state."""
    return epochs[1:] or epochs


def mean_epoch_time(epochs: Sequence[EpochPoint]) -> float:
    """Mean seconds per epoch over epochs 2.. (epoch 1 when it is the only one)."""
    later = _later(epochs)
    return sum(e.epoch_time for e in later) / len(later) if later else math.nan


def later_hit_ratio(epochs: Sequence[EpochPoint]) -> float:
    """Hits over opens of epochs 2.. (epoch 1 when alone), as the demo's summary counts them."""
    later = _later(epochs)
    hits = sum(e.hits or 0 for e in later)
    opens = hits + sum(e.misses or 0 for e in later)
    return hits / opens if opens else math.nan


def final_accuracy(epochs: Sequence[EpochPoint]) -> float:
    return epochs[-1].test_accuracy if epochs else math.nan


def _series(
    epochs: Sequence[EpochPoint], value: Callable[[EpochPoint], float | None]
) -> tuple[list[int], list[float]]:
    """(1-based epoch numbers, values), leaving out epochs without a value."""
    xs, ys = [], []
    for e in epochs:
        v = value(e)
        if v is not None and not math.isnan(v):
            xs.append(e.epoch + 1)
            ys.append(v)
    return xs, ys


@dataclass(frozen=True)
class _Panel:
    title: str
    unit: str
    value: Callable[[EpochPoint], float | None]
    fraction: bool  # a ratio in [0, 1]: fixed y range, so runs and panels compare at a glance
    #: The title's second line: one figure per run, and the format of that figure.
    summary: str
    figure: Callable[[Sequence[EpochPoint]], float]
    spec: str


PANELS = (
    _Panel(
        "cache hit ratio", "hits / opens", lambda e: e.hit_ratio, True,
        "epochs 2+", later_hit_ratio, ".2f",
    ),
    _Panel(
        "test accuracy", "accuracy", lambda e: e.test_accuracy, True,
        "last epoch", final_accuracy, ".3f",
    ),
    _Panel(
        "time per epoch", "seconds", lambda e: e.epoch_time, False,
        "mean of epochs 2+", mean_epoch_time, ".1f",
    ),
)  # fmt: skip


def _summary_line(panel: _Panel, runs: Sequence[Run], last_epoch: int) -> str:
    """E.g. 'mean of epochs 2+: uniform 7.2 s, shade 1.2 s'; runs without a figure left out."""
    which = panel.summary if last_epoch > 1 else panel.summary.replace("epochs 2+", "epoch 1")
    unit = " s" if panel.unit == "seconds" else ""
    parts = []
    for run in runs:
        v = panel.figure(run.epochs)
        if not math.isnan(v):
            parts.append(f"{run.key} {format(v, panel.spec)}{unit}")
    return f"{which}: {', '.join(parts)}" if parts else "not measured"


def write_plot(runs: Sequence[Run], path: Path, title: str) -> None:
    """Write the three-panel PNG to ``path``; raises OSError when it cannot be written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(SIZE[0] / DPI, SIZE[1] / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title)
    axes = fig.subplots(1, len(PANELS))
    last_epoch = max((len(r.epochs) for r in runs), default=1)
    for ax, panel in zip(axes, PANELS, strict=True):
        ax.set_title(f"{panel.title}\n{_summary_line(panel, runs, last_epoch)}", fontsize="medium")
        ax.set_xlabel("epoch")
        ax.set_ylabel(panel.unit)
        ax.set_xlim(0.5, last_epoch + 0.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        drawn = False
        for run in runs:
            xs, ys = _series(run.epochs, panel.value)
            if xs:
                ax.plot(xs, ys, marker="o", color=COLOURS.get(run.key), label=run.label)
                drawn = True
        if panel.fraction:
            ax.set_ylim(0, 1.05)
        else:
            ax.set_ylim(bottom=0)
        if not drawn:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
    # Every run has epoch times, not always hit ratios or accuracies (no mount, no test set).
    handles, labels = axes[-1].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=len(handles))
    fig.savefig(path, dpi=DPI)
    log.debug("plot written to %s", path)
