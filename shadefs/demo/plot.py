"""The demo's figure: hit ratio, test accuracy and epoch time per epoch, one line per run.

The baseline run (key ``remote``: the training reading the emulated remote directly) is
drawn grey and dashed, under the others: its accuracy matches the uniform run's (same model,
seed and order), and the uniform line must stay visible on top of it. It has no hit ratio,
so it has no line in that panel.

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
COLOURS = {"remote": "tab:gray", "uniform": "tab:red", "shade": "tab:blue"}
#: How the baseline is drawn; other runs get solid lines with round markers.
BASELINE = "remote"


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
    @property
    def kernel_hits(self) -> int | None: ...


def served_without_fetch(epochs: Sequence[EpochPoint]) -> tuple[int, int]:
    """(opens served without a fetch: the tiers' hits and the kernel's, opens) of `epochs`."""
    hits = sum((e.hits or 0) + (e.kernel_hits or 0) for e in epochs)
    return hits, sum((e.hits or 0) + (e.misses or 0) for e in epochs)


@dataclass(frozen=True)
class Run:
    """One line in every panel: the run's key (its colour), its legend label, its epochs, and
    the short name that the printed tables and summary lines use (the key when empty)."""

    key: str
    label: str
    epochs: Sequence[EpochPoint]
    name: str = ""


def _later(epochs: Sequence[EpochPoint]) -> Sequence[EpochPoint]:
    """Epochs 2.. (the cold first epoch only when it is alone): the steady state."""
    return epochs[1:] or epochs


def mean_epoch_time(epochs: Sequence[EpochPoint]) -> float:
    """Mean seconds per epoch over epochs 2.. (epoch 1 when it is the only one)."""
    later = _later(epochs)
    return sum(e.epoch_time for e in later) / len(later) if later else math.nan


def later_hit_ratio(epochs: Sequence[EpochPoint]) -> float:
    """Hits (the tiers' and the kernel's) over opens of epochs 2.. (epoch 1 when alone), as
    the demo's summary counts them."""
    hits, opens = served_without_fetch(_later(epochs))
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
    #: Why a run has no line here, said in the panel so that it does not look lost.
    absent: str


PANELS = (
    _Panel(
        "cache hit ratio", "hits / opens", lambda e: e.hit_ratio, True,
        "epochs 2+", later_hit_ratio, ".2f", "no cache, no hit ratio",
    ),
    _Panel(
        "test accuracy", "accuracy", lambda e: e.test_accuracy, True,
        "last epoch", final_accuracy, ".3f", "no test set",
    ),
    _Panel(
        "time per epoch", "seconds", lambda e: e.epoch_time, False,
        # Not "mean of epochs 2+": three runs' figures must fit the panel's width.
        "epochs 2+", mean_epoch_time, ".1f", "not measured",
    ),
)  # fmt: skip


def _summary_line(panel: _Panel, runs: Sequence[Run], last_epoch: int) -> str:
    """E.g. 'epochs 2+: uniform 7.2 s, shade 1.2 s'; runs without a figure left out."""
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
        drawn, absent = False, []
        for run in runs:
            xs, ys = _series(run.epochs, panel.value)
            if not xs:
                absent.append(run.key)
                continue
            if run.key == BASELINE:
                style = {"linestyle": "--", "marker": "s", "linewidth": 3, "markersize": 8}
            else:
                style = {"marker": "o", "zorder": 3}
            ax.plot(xs, ys, color=COLOURS.get(run.key), label=run.label, **style)
            drawn = True
        if panel.fraction:
            ax.set_ylim(0, 1.05)
        else:
            ax.set_ylim(bottom=0)
        if not drawn:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        elif absent:
            note = f"{', '.join(absent)}: {panel.absent}"
            ax.text(
                0.98, 0.02, note, ha="right", va="bottom", color="dimgray", transform=ax.transAxes
            )
    # Every run has epoch times, not always hit ratios or accuracies (no mount, no test set).
    handles, labels = axes[-1].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=len(handles))
    fig.savefig(path, dpi=DPI)
    log.debug("plot written to %s", path)
