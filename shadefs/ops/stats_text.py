"""The human-readable `stats` control file, rendered from the typed stats schema."""

from __future__ import annotations

from shadefs.common import format_size
from shadefs.stats import Stats


def render_text(s: Stats) -> str:
    """The human-readable `stats` file."""
    c, cache, src, ns = s.counters, s.cache, s.source, s.namespace
    state = s.cache.policy.to_json()
    lines = [
        f"shadefs {src.root} -> {s.mountpoint} (pid {s.pid}, up {s.uptime_s:.0f} s)",
        f"policy        {cache.policy.name}  "
        + " ".join(f"{k}={v}" for k, v in state.items() if k != "name"),
        f"opens         {s.opens}  hits {c.hits}  misses {c.misses} (of which kernel hits "
        f"{c.kernel_hits})  hit ratio {s.hit_ratio:.3f}"
        + ("  (kernel hits on: only the files the kernel asked for)" if c.no_open else ""),
        f"ram           {format_size(cache.ram.bytes)} of {format_size(cache.ram.capacity)} "
        f"in {s.files_cached} files (max entry {format_size(cache.max_entry)})",
        f"admissions    admitted {cache.admitted}  refused {cache.refused}  "
        f"evicted {cache.evictions}  shared fetches {cache.fetches_shared}",
        f"handles       {cache.handles.open} open, holding {format_size(cache.handles.bytes)} "
        f"outside the budget (limit {format_size(cache.handles.limit)}, "
        f"{cache.handles.passthrough_opens} opens read through)",
        f"bytes         served {format_size(c.bytes_served)}  "
        f"from source {format_size(src.bytes_read)}",
        f"source        {'healthy' if src.healthy else 'NOT ANSWERING'}  "
        f"timeouts {src.timeouts}  errors {src.errors}  threads busy {src.threads_busy}, "
        f"stuck {src.threads_stuck}",
        f"namespace     {ns.inodes_known} inodes known, {ns.directories_listed} dirs listed",
    ]
    if cache.ssd is not None:
        ssd, r = cache.ssd, cache.ssd.restore
        lines.insert(
            4,
            f"ssd           {format_size(ssd.bytes)} of {format_size(ssd.capacity)} "
            f"in {ssd.entries} files, {ssd.hits} hits, "
            f"{ssd.corrupt_entries} corrupt entries, restore "
            f"{'done' if r.done else 'running'} ({r.entries} entries)",
        )
    for job in s.jobs:
        group = f" (group {job.group})" if job.group else ""
        lines.append(
            f"job           {job.id}{group}: epoch {job.epoch}, {job.hits} hits, "
            f"{job.misses} misses, {format_size(job.bytes_served)} served"
        )
    return "\n".join(lines) + "\n"
