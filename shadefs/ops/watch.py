"""`shadefs stat MNT --watch`: a live view of a mount's counters.

This module owns turning two `stats.json` snapshots into rates (opens/s, hits/s, the hit
ratio over the interval and overall, bytes/s served and read from the source) and drawing
them: a full-screen view redrawn in place on a terminal, or one compact line per interval
otherwise, so that the output can go to a log. It reads only `.shadefs/stats.json`; sections
the daemon does not report yet (`tiers`, `restore`, `prefetch`, `jobs`, `sampler`) are just
not shown.

A mount that goes away (unmounted, or its daemon died) ends the watch with a one-line
QuietError and exit code 7 (EXIT_NOT_SHADEFS); Ctrl-C ends it with 0.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from collections.abc import Mapping
from typing import IO, Any

from shadefs.common import EXIT_OK, QuietError, format_size
from shadefs.torch.client import read_stats

log = logging.getLogger(__name__)

Stats = Mapping[str, Any]

BAR = 20
# Home, then erase-to-end-of-line after each line and erase-below at the end: the same
# result as clearing the screen, without the flicker of a blank frame in between.
_HOME = "\x1b[H"
_EOL = "\x1b[K"
_EOS = "\x1b[J"
_CLEAR = "\x1b[H\x1b[2J"


def watch(
    mountpoint: str,
    interval: float = 1.0,
    *,
    iterations: int | None = None,
    out: IO[str] = sys.stdout,
) -> int:
    """Show the stats of `mountpoint` every `interval` s (`iterations` frames, or forever)."""
    if interval <= 0:
        raise QuietError(f"the interval must be positive, got {interval}")
    tty = out.isatty()
    prev: Stats | None = None
    prev_t = 0.0
    frames = 0
    start = time.monotonic()
    try:
        if tty:
            out.write(_CLEAR)
        while True:
            cur = read_stats(mountpoint)
            now = time.monotonic()
            if prev is not None and cur.get("pid") != prev.get("pid"):
                prev = None  # a remounted daemon: its counters restarted from zero
            dt = now - prev_t
            if tty:
                out.write(_HOME + _fit(render(prev, cur, dt, interval=interval)) + _EOS)
            else:
                out.write(time.strftime("%Y-%m-%dT%H:%M:%S ") + render_line(prev, cur, dt) + "\n")
            out.flush()
            prev, prev_t = cur, now
            frames += 1
            if iterations is not None and frames >= iterations:
                return EXIT_OK
            # Ticks on a fixed grid, so that the drawing time does not accumulate as drift.
            next_tick = start + frames * interval
            time.sleep(max(0.0, next_tick - time.monotonic()))
    except KeyboardInterrupt:
        if tty:
            out.write("\n")
            out.flush()
        return EXIT_OK


def _fit(frame: str) -> str:
    """Clip the frame to the terminal: a wrapped or scrolled line breaks drawing in place."""
    cols, rows = shutil.get_terminal_size((100, 40))
    lines = frame.splitlines()[: max(1, rows - 1)]
    return "".join(line[: max(1, cols - 1)] + _EOL + "\n" for line in lines)


# --- rates ----------------------------------------------------------------------------------


def _num(s: Stats | None, key: str) -> float:
    v = s.get(key) if s is not None else None
    return float(v) if isinstance(v, int | float) else 0.0


_WHOLE: Any = object()  # "the whole snapshot", as opposed to None: "no previous entry"


class _Rates:
    """Per-second deltas between two snapshots; None where there is no previous one.

    The methods take a pair of sub-mappings (one tier, one job) to compare instead of the
    whole snapshots; a previous sub-mapping of None means that entry is new: no rate.
    """

    def __init__(self, prev: Stats | None, cur: Stats, dt: float) -> None:
        self.prev, self.cur = prev, cur
        self.dt = dt if prev is not None and dt > 0 else None

    def delta(self, key: str, prev: Stats | None = _WHOLE, cur: Stats = _WHOLE) -> float | None:
        prev = self.prev if prev is _WHOLE else prev
        cur = self.cur if cur is _WHOLE else cur
        if self.dt is None or prev is None:
            return None
        d = _num(cur, key) - _num(prev, key)
        return d if d >= 0 else None  # a counter that went back: no rate, not a negative one

    def rate(self, key: str, prev: Stats | None = _WHOLE, cur: Stats = _WHOLE) -> float | None:
        d = self.delta(key, prev, cur)
        return None if d is None or self.dt is None else d / self.dt

    def ratio(self, prev: Stats | None = _WHOLE, cur: Stats = _WHOLE) -> float | None:
        """Hits over opens within the interval, None if nothing was opened."""
        hits = self.delta("hits", prev, cur)
        misses = self.delta("misses", prev, cur)
        if hits is None or misses is None or hits + misses == 0:
            return None
        return hits / (hits + misses)


def _overall(s: Stats) -> float | None:
    opens = _num(s, "hits") + _num(s, "misses")
    return _num(s, "hits") / opens if opens else None


def _f(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _bps(v: float | None) -> str:
    return "-" if v is None else format_size(v) + "/s"


def _bar(used: float, capacity: float) -> str:
    frac = min(1.0, used / capacity) if capacity > 0 else 0.0
    n = round(frac * BAR)
    return "[" + "#" * n + "." * (BAR - n) + f"] {100 * frac:5.1f}%"


def _tiers(s: Stats) -> dict[str, Mapping[str, Any]]:
    """`tiers` when the daemon reports it, else the RAM tier from the flat fields."""
    tiers = s.get("tiers")
    if isinstance(tiers, Mapping) and tiers:
        return {str(k): v for k, v in tiers.items() if isinstance(v, Mapping)}
    if "ram_capacity" in s:
        return {
            "ram": {
                "bytes": s.get("ram_bytes", 0),
                "capacity": s.get("ram_capacity", 0),
                "entries": s.get("files_cached", 0),
            }
        }
    return {}


def _sub(s: Stats | None, section: str, key: str) -> Stats | None:
    """One entry of a section (a tier, a job) of a snapshot, or None."""
    if s is None:
        return None
    sec = s.get(section)
    if not isinstance(sec, Mapping):
        return None
    v = sec.get(key)
    return v if isinstance(v, Mapping) else None


# --- drawing --------------------------------------------------------------------------------


def render(prev: Stats | None, cur: Stats, dt: float, *, interval: float | None = None) -> str:
    """The full-screen view (plain text, one item per line) of `cur`, rates against `prev`."""
    r = _Rates(prev, cur, dt)
    opens = r.rate("hits")
    misses = r.rate("misses")
    opens = None if opens is None or misses is None else opens + misses
    every = f"every {interval:g} s, " if interval else ""
    lines = [
        f"shadefs {cur.get('source', '?')} -> {cur.get('mountpoint', '?')}  "
        f"pid {cur.get('pid', '?')}  up {_uptime(_num(cur, 'uptime_s'))}  "
        f"policy {cur.get('policy', '?')}   ({every}Ctrl-C quits)",
        "",
        f"opens     {_f(opens):>9}/s   hits {_f(r.rate('hits')):>9}/s   misses {_f(misses):>9}/s",
        f"hit ratio {_f(r.ratio(), '.3f'):>9} now  {_f(_overall(cur), '.3f'):>9} overall   "
        f"({int(_num(cur, 'hits'))} hits, {int(_num(cur, 'misses'))} misses)",
        f"served    {_bps(r.rate('bytes_served')):>12}   from source "
        f"{_bps(r.rate('bytes_from_source')):>12}   "
        f"(total {format_size(_num(cur, 'bytes_served'))} / "
        f"{format_size(_num(cur, 'bytes_from_source'))})",
        "",
    ]
    for name, t in _tiers(cur).items():
        used, cap = _num(t, "bytes"), _num(t, "capacity")
        line = (
            f"{name:<9} {format_size(used):>10} of {format_size(cap):<10} {_bar(used, cap)}  "
            f"{int(_num(t, 'entries'))} files"
        )
        hits = r.rate("hits", _sub(prev, "tiers", name), t)
        if hits is not None:
            line += f"  {hits:.1f} hits/s"
        lines.append(line)
    lines.append(_source(r, cur))
    extra = [x for x in (_restore(cur), _prefetch(r, cur), _sampler(cur)) if x]
    jobs = cur.get("jobs")
    if isinstance(jobs, Mapping) and jobs:
        extra.append("jobs")
        for job in sorted(jobs, key=str):
            j = jobs[job]
            if not isinstance(j, Mapping):
                continue
            pj = _sub(prev, "jobs", job)
            hits, miss = r.rate("hits", pj, j), r.rate("misses", pj, j)
            extra.append(
                f"  {str(job):<16} hits {_f(hits):>8}/s  misses {_f(miss):>8}/s  "
                f"hit ratio {_f(r.ratio(pj, j), '.3f')} now, {_f(_overall(j), '.3f')} overall"
            )
    if extra:
        lines += ["", *extra]
    return "\n".join(lines) + "\n"


def render_line(prev: Stats | None, cur: Stats, dt: float) -> str:
    """One compact line per interval, for logs."""
    r = _Rates(prev, cur, dt)
    hits, misses = r.rate("hits"), r.rate("misses")
    opens = None if hits is None or misses is None else hits + misses
    parts = [
        f"opens/s {_f(opens)}",
        f"hits/s {_f(hits)}",
        f"hit {_f(r.ratio(), '.3f')} (all {_f(_overall(cur), '.3f')})",
        f"served {_bps(r.rate('bytes_served'))}",
        f"source {_bps(r.rate('bytes_from_source'))}",
    ]
    for name, t in _tiers(cur).items():
        cap = _num(t, "capacity")
        used = 100 * _num(t, "bytes") / cap if cap else 0.0
        parts.append(f"{name} {used:.0f}%")
    healthy = cur.get("source_healthy", True)
    parts.append("source ok" if healthy else "source NOT ANSWERING")
    restore = cur.get("restore")
    if isinstance(restore, Mapping) and not restore.get("done", True):
        parts.append(f"restoring {int(_num(restore, 'entries'))}")
    return "  ".join(parts)


def _uptime(s: float) -> str:
    s = int(s)
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600:02d}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s"


def _source(r: _Rates, cur: Stats) -> str:
    timeouts, errors = int(_num(cur, "source_timeouts")), int(_num(cur, "source_errors"))
    if cur.get("source_healthy", True):
        return f"source    healthy   timeouts {timeouts}  errors {errors}"
    new = r.delta("source_timeouts")
    since = f", {new:.0f} this interval" if new else ""
    return f"source    NOT ANSWERING   timeouts {timeouts}{since}  errors {errors}"


def _restore(cur: Stats) -> str:
    rs = cur.get("restore")
    if not isinstance(rs, Mapping):
        return ""
    entries = int(_num(rs, "entries"))
    if rs.get("done"):
        return f"restore   done, {entries} entries"
    total = _num(rs, "total")
    if total:
        return f"restore   in progress: {entries} of {int(total)} entries {_bar(entries, total)}"
    return f"restore   in progress: {entries} entries so far"


def _prefetch(r: _Rates, cur: Stats) -> str:
    pf = cur.get("prefetch")
    if not isinstance(pf, Mapping):
        return ""
    prev = r.prev.get("prefetch") if r.prev is not None else None
    prev = prev if isinstance(prev, Mapping) else None
    fields = []
    for k, v in pf.items():
        if isinstance(v, bool) or not isinstance(v, int | float):
            continue
        if "bytes" in k:
            fields.append(f"{k} {format_size(v)}")
        else:
            fields.append(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}")
    rate = r.rate("bytes", prev, pf) if prev is not None else None
    if rate is not None:
        fields.append(f"({_bps(rate)})")
    return "prefetch  " + "  ".join(fields)


def _sampler(cur: Stats) -> str:
    sp = cur.get("sampler")
    if not isinstance(sp, Mapping) or not sp.get("samples"):
        return ""
    return (
        f"sampler   {int(_num(sp, 'samples'))} samples  epoch {sp.get('epoch', '?')}  "
        f"replay {_num(sp, 'replay'):g}  orders {int(_num(sp, 'orders_served'))}"
    )
