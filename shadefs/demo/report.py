"""The demo's text output: one line per epoch, the epoch table, the summary table and lines.

This module owns what ``shadefs demo`` prints about its runs (``shadefs.demo.run`` runs them,
``shadefs.demo.plot`` draws them). The first run is the baseline: the same training reading
the emulated remote directly, with no shadefs in between. It has no hit ratio (no cache), so
its cells say ``n/a`` where the other runs show one; every speed-up is against it.

It imports neither torch nor matplotlib: it reads the epoch records through
``shadefs.demo.plot.EpochPoint``, so it can be tested without them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from shadefs.demo.plot import (
    EpochPoint,
    Run,
    final_accuracy,
    later_hit_ratio,
    mean_epoch_time,
    served_without_fetch,
)

log = logging.getLogger(__name__)

#: Width of one figure in the epoch table.
_CELL = 9


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None or math.isnan(value) else format(value, spec)


def has_hit_ratio(run: Run) -> bool:
    """Whether the run read through a shadefs mount (its epochs carry hit counts)."""
    return any(e.hit_ratio is not None for e in run.epochs)


def epoch_line(key: str, rec: EpochPoint) -> str:
    """The line printed as an epoch ends, e.g. '  shade    epoch  2: hit ratio 0.601 ...'."""
    misses = "n/a" if rec.misses is None else str(rec.misses)
    return (
        f"  {key:8s} epoch {rec.epoch + 1:2d}: hit ratio {_fmt(rec.hit_ratio, '.3f'):>5s}  "
        f"accuracy {_fmt(rec.test_accuracy, '.3f'):>6s}  time {rec.epoch_time:5.1f} s  "
        f"misses {misses:>5s}"
    )


def _columns(run: Run) -> list[str]:
    return (["hit ratio"] if has_hit_ratio(run) else []) + ["accuracy", "time (s)"]


def _cells(run: Run, rec: EpochPoint | None) -> list[str]:
    if rec is None:
        return [""] * len(_columns(run))
    cells = [_fmt(rec.hit_ratio, ".3f")] if has_hit_ratio(run) else []
    return [*cells, _fmt(rec.test_accuracy, ".3f"), f"{rec.epoch_time:.1f}"]


def epoch_table(runs: Sequence[Run]) -> list[str]:
    """One row per epoch, the runs side by side under their names; a run's figures in its
    own group of columns (the baseline has no hit ratio column)."""
    runs = [r for r in runs if r.epochs]
    if not runs:
        return []
    groups = [" ".join(f"{c:>{_CELL}s}" for c in _columns(r)) for r in runs]
    names = [f"{r.name or r.key:{len(g)}s}" for r, g in zip(runs, groups, strict=True)]
    lines = ["      " + " | ".join(names).rstrip(), "epoch " + " | ".join(groups)]
    lines.append("-" * len(lines[-1]))
    for e in range(max(len(r.epochs) for r in runs)):
        row = []
        for run in runs:
            rec = run.epochs[e] if e < len(run.epochs) else None
            row.append(" ".join(f"{c:>{_CELL}s}" for c in _cells(run, rec)))
        lines.append(f"{e + 1:5d} " + " | ".join(row))
    return lines


def _all_hit_ratio(epochs: Sequence[EpochPoint]) -> float:
    hits, opens = served_without_fetch(epochs)
    return hits / opens if opens else math.nan


def summary_table(runs: Sequence[Run]) -> list[str]:
    """One row per run: hit ratios (all epochs, epochs 2+), final accuracy, seconds per epoch."""
    lines = [
        f"{'run':48s} {'hit ratio':>9s} {'hit ratio':>9s} {'final':>8s} {'s/epoch':>8s}",
        f"{'':48s} {'all':>9s} {'epochs 2+':>9s} {'accuracy':>8s} {'all':>8s}",
    ]
    for run in runs:
        if not run.epochs:
            continue
        hits = has_hit_ratio(run)
        first = _fmt(_all_hit_ratio(run.epochs), ".3f") if hits else "n/a"
        later = _fmt(later_hit_ratio(run.epochs), ".3f") if hits and len(run.epochs) > 1 else "n/a"
        acc = _fmt(final_accuracy(run.epochs), ".3f")
        mean_t = sum(e.epoch_time for e in run.epochs) / len(run.epochs)
        lines.append(f"{run.label:48s} {first:>9s} {later:>9s} {acc:>8s} {mean_t:8.1f}")
    return lines


def _speed(baseline: float, t: float) -> str:
    if not t > 0 or not baseline > 0:
        return "n/a"
    ratio = baseline / t
    return f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.1f}x slower"


def summary_lines(runs: Sequence[Run]) -> list[str]:
    """The closing lines: ShadeSampler's hit ratio against uniform's, and every run's time per
    epoch after the first against the baseline's (the first run)."""
    by_key = {r.key: r for r in runs if r.epochs}
    lines = []
    uniform, shade = by_key.get("uniform"), by_key.get("shade")
    if uniform and shade and len(uniform.epochs) > 1 and len(shade.epochs) > 1:
        u, s = later_hit_ratio(uniform.epochs), later_hit_ratio(shade.epochs)
        if u > 0:
            lines.append(f"hit ratio after the first epoch: ShadeSampler {s / u:.1f}x uniform")
    done = [r for r in runs if r.epochs]
    if not done:
        return lines
    which = "after the first" if max(len(r.epochs) for r in done) > 1 else "(one epoch)"
    base, others = done[0], done[1:]
    tb = mean_epoch_time(base.epochs)
    parts = [f"{base.name or base.key} {tb:.1f} s"]
    for run in others:
        t = mean_epoch_time(run.epochs)
        parts.append(f"{run.name or run.key} {t:.1f} s ({_speed(tb, t)})")
    lines.append(f"time per epoch {which}: " + ", ".join(parts))
    return lines
