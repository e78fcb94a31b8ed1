"""`shadefs stat MNT --watch`: a live view of a mount's counters.

This module owns turning two snapshots of the typed stats (`shadefs.stats.Stats`, parsed
back from `.shadefs/stats.json`) into rates (opens/s, hits/s, the hit ratio over the
interval and overall, bytes/s served and read from the source) and showing them: a rich
live view redrawn in place on a terminal, or one plain line per interval otherwise, so that
the output can go to a log. Sections the mount does not have (an SSD tier and its restore,
the prefetcher, a registered sampler) are just not shown.

rich is imported here and only here: the daemon never imports this module.

A mount that goes away (unmounted, or its daemon died) ends the watch with a one-line
QuietError and exit code 7 (EXIT_NOT_SHADEFS); Ctrl-C ends it with 0.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from shadefs.common import EXIT_NOT_SHADEFS, EXIT_OK, QuietError, format_size
from shadefs.stats import RamStats, SsdStats, Stats
from shadefs.torch.client import read_stats

log = logging.getLogger(__name__)

BAR = 20  # width of a tier's fill bar, in cells


def watch(
    mountpoint: str,
    interval: float = 1.0,
    *,
    iterations: int | None = None,
    out: IO[str] = sys.stdout,
    ask: Callable[[Callable[[], Stats]], Stats] | None = None,
) -> int:
    """Show the stats of `mountpoint` every `interval` s (`iterations` frames, or forever).
    `ask(read)`: each read of the stats made through it (the command line's time limit on a
    daemon that does not answer)."""
    if interval <= 0:
        raise QuietError(f"the interval must be positive, got {interval}")
    frames = _frames(mountpoint, interval, iterations, ask)
    try:
        if out.isatty():
            # No refresh thread: each frame is drawn once, when its snapshot is read.
            live = Live(
                console=Console(file=out),
                auto_refresh=False,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            with live:
                for prev, cur, dt in frames:
                    live.update(view(prev, cur, dt, interval=interval), refresh=True)
        else:
            for prev, cur, dt in frames:
                out.write(time.strftime("%Y-%m-%dT%H:%M:%S ") + render_line(prev, cur, dt) + "\n")
                out.flush()
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def read(mountpoint: str) -> Stats:
    """The typed stats of `mountpoint`, or QuietError(EXIT_NOT_SHADEFS) saying why not."""
    d = read_stats(mountpoint)
    try:
        return Stats.from_json(d)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise QuietError(
            f"{mountpoint}: stats.json is not in the format this shadefs reads (missing or "
            f"bad field {exc}): is its daemon of another shadefs version?",
            EXIT_NOT_SHADEFS,
        ) from None


def _frames(
    mountpoint: str,
    interval: float,
    iterations: int | None,
    ask: Callable[[Callable[[], Stats]], Stats] | None = None,
) -> Iterator[tuple[Stats | None, Stats, float]]:
    """(previous snapshot or None, snapshot, seconds between them), on a fixed grid."""
    prev: Stats | None = None
    prev_t = 0.0
    frames = 0
    start = time.monotonic()
    while True:
        cur = read(mountpoint) if ask is None else ask(lambda: read(mountpoint))
        now = time.monotonic()
        if prev is not None and cur.pid != prev.pid:
            prev = None  # a remounted daemon: its counters restarted from zero
        yield prev, cur, now - prev_t
        prev, prev_t = cur, now
        frames += 1
        if iterations is not None and frames >= iterations:
            return
        # Ticks on a fixed grid, so that the drawing time does not accumulate as drift.
        time.sleep(max(0.0, start + frames * interval - time.monotonic()))


# --- rates ----------------------------------------------------------------------------------

Getter = Callable[[Stats], float | None]


class _Rates:
    """Per-second deltas between two snapshots; None where there is no previous one, where
    the field is absent from either (a section that appeared), or where a counter went back."""

    def __init__(self, prev: Stats | None, cur: Stats, dt: float) -> None:
        self.prev, self.cur = prev, cur
        self.dt = dt if prev is not None and dt > 0 else None

    def delta(self, get: Getter) -> float | None:
        if self.prev is None or self.dt is None:
            return None
        before, now = get(self.prev), get(self.cur)
        if before is None or now is None or now < before:
            return None
        return now - before

    def rate(self, get: Getter) -> float | None:
        d = self.delta(get)
        return None if d is None or self.dt is None else d / self.dt

    def ratio(self) -> float | None:
        """Opens served without a fetch (the tiers' hits and the kernel's) over opens within
        the interval, None if nothing was opened. A kernel hit is known at its release,
        maybe an interval after its open: the ratio is capped at 1."""
        hits = self.delta(lambda s: s.counters.hits)
        kernel = self.delta(lambda s: s.counters.kernel_hits)
        misses = self.delta(lambda s: s.counters.misses)
        if hits is None or misses is None or hits + misses == 0:
            return None
        return min(1.0, (hits + (kernel or 0)) / (hits + misses))


def _overall(s: Stats) -> float | None:
    return s.hit_ratio if s.opens else None


def _f(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _bps(v: float | None) -> str:
    return "-" if v is None else format_size(v) + "/s"


def _tiers(s: Stats) -> list[tuple[str, RamStats | SsdStats]]:
    tiers: list[tuple[str, RamStats | SsdStats]] = [("ram", s.cache.ram)]
    if s.cache.ssd is not None:
        tiers.append(("ssd", s.cache.ssd))
    return tiers


def _tier_hits(name: str) -> Getter:
    if name == "ram":
        return lambda s: s.cache.ram.hits
    return lambda s: s.cache.ssd.hits if s.cache.ssd is not None else None


def _fill(used: float, capacity: float) -> float:
    """The fraction of the budget in use (over 1 while a tier evicts down to its budget)."""
    return used / capacity if capacity > 0 else 0.0


# --- the live view --------------------------------------------------------------------------


def view(prev: Stats | None, cur: Stats, dt: float, *, interval: float | None = None) -> Group:
    """The live view of `cur`, with rates against `prev` taken `dt` seconds earlier."""
    r = _Rates(prev, cur, dt)
    c = cur.counters
    every = f"every {interval:g} s, " if interval else ""
    header = Text.assemble(
        ("shadefs ", "bold"),
        f"{cur.source.root} -> {cur.mountpoint}  pid {cur.pid}  up {_uptime(cur.uptime_s)}  "
        f"policy {cur.cache.policy.name}   ({every}Ctrl-C quits)",
    )
    hits, misses = r.rate(lambda s: s.counters.hits), r.rate(lambda s: s.counters.misses)
    opens = None if hits is None or misses is None else hits + misses
    counters = Table(box=None, pad_edge=False, show_edge=False)
    counters.add_column("")
    counters.add_column("now", justify="right")
    counters.add_column("total", justify="right")
    counters.add_row("opens", f"{_f(opens)}/s", str(cur.opens))
    counters.add_row("hits", f"{_f(hits)}/s", str(c.hits))
    kernel = r.rate(lambda s: s.counters.kernel_hits)
    counters.add_row("kernel hits", f"{_f(kernel)}/s", str(c.kernel_hits))
    counters.add_row("misses", f"{_f(misses)}/s", str(c.misses))
    counters.add_row("hit ratio", _f(r.ratio(), ".3f"), _f(_overall(cur), ".3f"))
    counters.add_row(
        "served", _bps(r.rate(lambda s: s.counters.bytes_served)), format_size(c.bytes_served)
    )
    counters.add_row(
        "from source",
        _bps(r.rate(lambda s: s.source.bytes_read)),
        format_size(cur.source.bytes_read),
    )
    tiers = Table(box=None, pad_edge=False, show_edge=False)
    for title in ("tier", "used", "of", "fill", "", "files", "hits/s"):
        tiers.add_column(title, justify="left" if title in ("tier", "fill") else "right")
    for name, t in _tiers(cur):
        fill = _fill(t.bytes, t.capacity)
        tiers.add_row(
            name,
            format_size(t.bytes),
            format_size(t.capacity),
            ProgressBar(total=1.0, completed=min(1.0, fill), width=BAR),
            f"{100 * fill:.1f}%",
            str(t.entries),
            _f(r.rate(_tier_hits(name))),
        )
    details = Table(box=None, pad_edge=False, show_edge=False, show_header=False)
    details.add_column(style="bold", min_width=8)
    details.add_column()
    for label, line in _details(r, cur):
        details.add_row(label, line)
    parts: list[RenderableType] = [header, Text(""), counters, Text(""), tiers, Text(""), details]
    if cur.jobs:
        parts += [Text(""), _jobs(prev, cur, dt)]
    return Group(*parts)


def _jobs(prev: Stats | None, cur: Stats, dt: float) -> Table:
    """One row per active job: its epoch, its opens per second and its own hit ratio."""
    before = {j.id: j for j in prev.jobs} if prev is not None else {}
    table = Table(box=None, pad_edge=False, show_edge=False)
    for title in ("job", "group", "epoch", "opens/s", "hit ratio", "served", "idle"):
        table.add_column(title, justify="left" if title in ("job", "group") else "right")
    for job in cur.jobs:
        opens = job.hits + job.misses
        old = before.get(job.id)
        rate = None
        if old is not None and dt > 0 and opens >= old.hits + old.misses:
            rate = (opens - old.hits - old.misses) / dt
        table.add_row(
            job.id,
            job.group or "-",
            str(job.epoch),
            _f(rate),
            f"{job.hits / opens:.3f}" if opens else "-",
            format_size(job.bytes_served),
            f"{job.idle_seconds:.0f} s",
        )
    return table


def _details(r: _Rates, cur: Stats) -> list[tuple[str, RenderableType]]:
    src = cur.source
    if src.healthy:
        health = Text(f"healthy   timeouts {src.timeouts}  errors {src.errors}")
    else:
        new = r.delta(lambda s: s.source.timeouts)
        since = f", {new:.0f} this interval" if new else ""
        health = Text.assemble(
            ("NOT ANSWERING", "bold red"), f"   timeouts {src.timeouts}{since}  errors {src.errors}"
        )
    rows: list[tuple[str, RenderableType]] = [("source", health)]
    ssd = cur.cache.ssd
    if ssd is not None:
        rs = ssd.restore
        state = f"done in {rs.seconds:g} s" if rs.done else "in progress"
        rows.append(("restore", f"{state}, {rs.entries} entries"))
    pf = cur.prefetch
    if pf is not None:
        rate = _bps(r.rate(lambda s: s.prefetch.fetched_bytes if s.prefetch else None))
        rows.append(
            (
                "prefetch",
                f"plans {pf.plans}  staged {pf.staged} ({format_size(pf.staged_bytes)})  "
                f"inflight {pf.inflight}  fetched {pf.fetched} ({rate})  served {pf.served}  "
                f"wasted {pf.wasted}  errors {pf.errors}  latency {pf.latency_ms:g} ms",
            )
        )
    sp = cur.sampler
    if sp.samples:
        rows.append(
            (
                "sampler",
                f"{sp.samples} samples  epoch {sp.epoch}  replay {sp.replay:g} ({sp.replay_mode})"
                f"  orders {sp.orders_served}  losses {sp.losses_ingested}",
            )
        )
    return rows


def _uptime(s: float) -> str:
    s = int(s)
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600:02d}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s"


# --- the plain line -------------------------------------------------------------------------


def render_line(prev: Stats | None, cur: Stats, dt: float) -> str:
    """One compact line per interval, for logs: no escapes, no colour."""
    r = _Rates(prev, cur, dt)
    hits, misses = r.rate(lambda s: s.counters.hits), r.rate(lambda s: s.counters.misses)
    opens = None if hits is None or misses is None else hits + misses
    parts = [
        f"opens/s {_f(opens)}",
        f"hits/s {_f(hits)}",
        f"kernel hits/s {_f(r.rate(lambda s: s.counters.kernel_hits))}",
        f"hit {_f(r.ratio(), '.3f')} (all {_f(_overall(cur), '.3f')})",
        f"served {_bps(r.rate(lambda s: s.counters.bytes_served))}",
        f"source {_bps(r.rate(lambda s: s.source.bytes_read))}",
    ]
    for name, t in _tiers(cur):
        parts.append(f"{name} {100 * _fill(t.bytes, t.capacity):.0f}%")
    parts.append("source ok" if cur.source.healthy else "source NOT ANSWERING")
    ssd = cur.cache.ssd
    if ssd is not None and not ssd.restore.done:
        parts.append(f"restoring {ssd.restore.entries}")
    return "  ".join(parts)
