"""Counters of the data path and their text, JSON-ready and Prometheus forms.

The hot path only increments plain int attributes (no locks: everything runs in the trio
thread). `snapshot()` assembles the stats that the control directory and the CLI show.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from shadefs.common import format_size

if TYPE_CHECKING:
    from shadefs.cache.coordinator import Cache
    from shadefs.fs.namespace import Namespace
    from shadefs.source import Source

log = logging.getLogger(__name__)


class Metrics:
    """Counters. `hits` and `misses` count opens of regular files: one sample = one file."""

    __slots__ = (
        "hits",
        "misses",
        "bytes_served",
        "passthrough_opens",
        "control_errors",
        "started",
    )

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.bytes_served = 0
        self.passthrough_opens = 0
        self.control_errors = 0
        self.started = time.time()


def snapshot(
    metrics: Metrics, cache: Cache, ns: Namespace, source: Source, mountpoint: str
) -> dict[str, object]:
    """Everything `stats.json` reports, as one flat-ish dict (documented in the README)."""
    opens = metrics.hits + metrics.misses
    out: dict[str, object] = {
        "version": 1,
        "pid": os.getpid(),
        "mountpoint": mountpoint,
        "source": os.fsdecode(source.root),
        "uptime_s": round(time.time() - metrics.started, 3),
        "policy": cache.policy.name,
        "policy_state": cache.policy.describe(),
        "hits": metrics.hits,
        "misses": metrics.misses,
        "hit_ratio": metrics.hits / opens if opens else 0.0,
        "bytes_served": metrics.bytes_served,
        "bytes_from_source": source.bytes_read,
        "ram_bytes": cache.used,
        "ram_capacity": cache.capacity,
        "ram_max_entry": cache.max_entry,
        "files_cached": len(cache.entries) + (len(cache.ssd.index) if cache.ssd else 0),
        "tiers": cache.describe(),
        "admitted": cache.admitted,
        "evictions": cache.evictions,
        "refused": cache.refused,
        "passthrough_opens": metrics.passthrough_opens,
        "fetches_shared": cache.shared_fetches,
        "blocked_seconds": round(cache.blocked, 6),
        "revalidations": ns.revalidations,
        "changed_files": ns.changed_files,
        "inodes_known": len(ns.nodes),
        "directories_listed": len(ns.listings),
        "source_healthy": source.healthy,
        "source_timeouts": source.timeouts,
        "source_errors": source.errors,
        "control_errors": metrics.control_errors,
    }
    if cache.ssd is not None:
        ssd = cache.ssd
        out["ssd_bytes"] = ssd.store.disk_bytes
        out["ssd_capacity"] = ssd.capacity
        out["ssd_hits"] = ssd.hits
        out["ssd_entries"] = len(ssd.index)
        out["corrupt_entries"] = ssd.store.corrupt_entries
        out["restore"] = {
            "done": ssd.restore_done,
            "entries": ssd.restore_entries,
            "seconds": round(ssd.restore_seconds, 3),
        }
    return out


def render_text(s: dict[str, object]) -> str:
    """The human-readable `stats` file."""
    lines = [
        f"shadefs {s['source']} -> {s['mountpoint']} (pid {s['pid']}, up {s['uptime_s']:.0f} s)",
        f"policy        {s['policy']}  {_state(s['policy_state'])}",
        f"opens         {s['hits'] + s['misses']}  hits {s['hits']}  misses {s['misses']}  "
        f"hit ratio {s['hit_ratio']:.3f}",
        f"ram           {format_size(s['ram_bytes'])} of {format_size(s['ram_capacity'])} "
        f"in {s['files_cached']} files (max entry {format_size(s['ram_max_entry'])})",
        f"admissions    admitted {s['admitted']}  refused {s['refused']}  "
        f"evicted {s['evictions']}  shared fetches {s['fetches_shared']}",
        f"bytes         served {format_size(s['bytes_served'])}  "
        f"from source {format_size(s['bytes_from_source'])}",
        f"source        {'healthy' if s['source_healthy'] else 'NOT ANSWERING'}  "
        f"timeouts {s['source_timeouts']}  errors {s['source_errors']}",
        f"namespace     {s['inodes_known']} inodes known, {s['directories_listed']} dirs listed",
    ]
    if "ssd_bytes" in s:
        r = s["restore"]
        lines.insert(
            4,
            f"ssd           {format_size(s['ssd_bytes'])} of {format_size(s['ssd_capacity'])} "
            f"in {s['ssd_entries']} files, {s['ssd_hits']} hits, "
            f"{s['corrupt_entries']} corrupt entries, restore "
            f"{'done' if r['done'] else 'running'} ({r['entries']} entries)",
        )
    return "\n".join(lines) + "\n"


def _state(d: object) -> str:
    if not isinstance(d, dict):
        return ""
    return " ".join(f"{k}={v}" for k, v in d.items() if k != "name")
