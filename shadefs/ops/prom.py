"""Prometheus exposition of the daemon's stats, with prometheus-client.

This module owns the mapping from the `stats.json` dict (`metrics.snapshot()`) to Prometheus
metric families, the text for the `.shadefs/metrics` control file (`render`), and the
optional HTTP endpoint (`start_server`, `--metrics HOST:PORT`). The endpoint only serves
GET of the metrics: nothing in it can change the daemon (control stays in `.shadefs/ctl`).

Every scrape calls the stats callable once, so one scrape is one consistent snapshot. The
collector has no `describe()`, and the registries are built with auto_describe off, so
registering never calls the stats callable (the daemon's callable hops into the trio thread,
which must not happen from the trio thread itself).

Metric names (stable; a field missing from the dict is skipped, so a daemon that does not
have a section yet just does not export it):

counters, from top-level fields (`shadefs_<field>_total`)
    shadefs_hits_total, shadefs_misses_total           opens of regular files (one per sample)
    shadefs_bytes_served_total                          bytes returned to readers
    shadefs_bytes_from_source_total                     bytes read from the source tree
    shadefs_admitted_total, shadefs_evictions_total, shadefs_refused_total
    shadefs_passthrough_opens_total, shadefs_fetches_shared_total
    shadefs_source_timeouts_total, shadefs_source_errors_total
    shadefs_corrupt_entries_total, shadefs_control_errors_total, shadefs_ssd_hits_total
    shadefs_revalidations_total, shadefs_changed_files_total
gauges, from top-level fields
    shadefs_ram_bytes, shadefs_ram_capacity_bytes, shadefs_ram_max_entry_bytes
    shadefs_ssd_bytes, shadefs_ssd_capacity_bytes, shadefs_ssd_entries
    shadefs_files_cached, shadefs_hit_ratio, shadefs_source_healthy (1/0)
    shadefs_inodes_known, shadefs_directories_listed, shadefs_uptime_seconds
    shadefs_info{mountpoint,source,policy} 1
    shadefs_policy_<field> for each numeric field of `policy_state` (e.g. _entries, _epoch)
    shadefs_up                                          1 if the stats could be read, else 0
per tier, from `tiers` = {"ram": {...}, "ssd": {...}}, label `tier`
    counters: shadefs_tier_hits_total, _misses_total, _admitted_total, _evictions_total,
      _corrupt_entries_total, _stale_entries_total, _writes_total, _write_failures_total,
      _dropped_writes_total (all shadefs_tier_...)
    gauges: shadefs_tier_bytes, _data_bytes, _capacity_bytes, _entries, _queued_writes,
      _disk_free_bytes, _min_free_bytes (all shadefs_tier_...)
histogram, from `source_latency` = {"buckets": {"0.001": n, ..., "+Inf": n}, "sum", "count"}
    shadefs_source_latency_seconds (_bucket{le}, _sum, _count; cumulative buckets)
prefetch, from `prefetch` = {...}
    shadefs_prefetch_<field>_total for issued, fetched, bytes, hits, wasted, errors, dropped
    shadefs_prefetch_<field> (gauge) for queued, inflight
restore, from `restore` = {"done": bool, "entries": n, "seconds": s, ...}
    shadefs_restore_done (1/0), shadefs_restore_entries, shadefs_restore_seconds (gauges)
sampler, from `sampler` = {"samples": n, "epoch": n, "replay": r, ...}
    shadefs_sampler_samples, shadefs_sampler_epoch, shadefs_sampler_replay (gauges)
    shadefs_sampler_orders_served_total, shadefs_sampler_losses_ingested_total,
    shadefs_sampler_reports_total
per job, from `jobs` = {"<job>": {"hits": n, "misses": n, ...}}, label `job`
    shadefs_job_hits_total, shadefs_job_misses_total, shadefs_job_bytes_served_total

Unknown fields: a numeric (int, float, bool) field that is not listed above, at the top
level or inside `tiers`, `prefetch`, `restore`, `sampler` or a job, is exported as a gauge
named after it (`shadefs_<field>`, `shadefs_tier_<field>`, `shadefs_prefetch_<field>`, ...),
so a new daemon counter is visible before this module learns about it. Such a name is not
stable: once the field is listed here as a counter it gains `_total`. Strings, lists and
nested mappings that are not listed are ignored, as are `version` and `pid`.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import re
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

log = logging.getLogger(__name__)

PREFIX = "shadefs"
DEFAULT_HOST = "127.0.0.1"

# field -> (metric name without prefix, help). Counter names get `_total` from the library.
_COUNTERS: dict[str, tuple[str, str]] = {
    "hits": ("hits", "Opens of regular files served from the cache"),
    "misses": ("misses", "Opens of regular files that had to go to the source"),
    "bytes_served": ("bytes_served", "Bytes returned to readers"),
    "bytes_from_source": ("bytes_from_source", "Bytes read from the source tree"),
    "admitted": ("admitted", "Files admitted into the cache"),
    "evictions": ("evictions", "Files evicted from the cache"),
    "refused": ("refused", "Files the policy refused to admit"),
    "passthrough_opens": ("passthrough_opens", "Opens served straight from the source"),
    "fetches_shared": ("fetches_shared", "Fetches that joined one already in flight"),
    "source_timeouts": ("source_timeouts", "Source calls that timed out"),
    "source_errors": ("source_errors", "Source calls that failed"),
    "corrupt_entries": ("corrupt_entries", "Cache entries found corrupt and dropped"),
    "control_errors": ("control_errors", "Control writes rejected with EINVAL"),
    "ssd_hits": ("ssd_hits", "Opens served from the SSD tier"),
    "revalidations": ("revalidations", "Namespace revalidations against the source"),
    "changed_files": ("changed_files", "Files found changed in the source on revalidation"),
}
_GAUGES: dict[str, tuple[str, str]] = {
    "ram_bytes": ("ram_bytes", "Bytes held in the RAM tier"),
    "ram_capacity": ("ram_capacity_bytes", "RAM tier budget in bytes"),
    "ram_max_entry": ("ram_max_entry_bytes", "Largest file the RAM tier caches"),
    "files_cached": ("files_cached", "Files held in the cache"),
    "hit_ratio": ("hit_ratio", "Hits over opens since the mount"),
    "source_healthy": ("source_healthy", "1 when the source answers, 0 when it does not"),
    "inodes_known": ("inodes_known", "Inodes in the namespace table"),
    "directories_listed": ("directories_listed", "Directory listings held"),
    "uptime_s": ("uptime_seconds", "Seconds since the mount"),
    "ssd_bytes": ("ssd_bytes", "Bytes held in the SSD tier (on disk)"),
    "ssd_capacity": ("ssd_capacity_bytes", "SSD tier budget in bytes"),
    "ssd_entries": ("ssd_entries", "Files held in the SSD tier"),
}
# Top-level fields handled elsewhere, or not worth a metric.
_SKIP = {"version", "pid", "mountpoint", "source", "policy", "policy_state"}
_SECTIONS = {"tiers", "source_latency", "prefetch", "restore", "jobs", "sampler"}

_TIER_COUNTERS = {
    "hits": "Opens served from this tier",
    "misses": "Lookups this tier could not serve",
    "admitted": "Files admitted into this tier",
    "evictions": "Files evicted from this tier",
    "corrupt_entries": "Entries of this tier found corrupt and dropped",
    "stale_entries": "Entries of this tier found stale (source changed) and dropped",
    "writes": "Entries written to this tier",
    "write_failures": "Writes to this tier that failed",
    "dropped_writes": "Writes to this tier dropped (queue full or disk full)",
}
_TIER_GAUGES = {
    "bytes": ("bytes", "Bytes held in this tier (on disk for the SSD tier)"),
    "data_bytes": ("data_bytes", "Bytes of file data held in this tier"),
    "capacity": ("capacity_bytes", "Budget of this tier in bytes"),
    "entries": ("entries", "Files held in this tier"),
    "queued_writes": ("queued_writes", "Writes waiting for this tier"),
    "disk_free": ("disk_free_bytes", "Free space on this tier's disk"),
    "min_free": ("min_free_bytes", "Free space this tier leaves on its disk"),
}
_PREFETCH_COUNTERS = {
    "issued": "Prefetches issued",
    "fetched": "Files fetched by the prefetcher",
    "bytes": "Bytes fetched by the prefetcher",
    "hits": "Opens served by a prefetched entry",
    "wasted": "Prefetched entries evicted before use",
    "errors": "Prefetches that failed",
    "dropped": "Prefetches dropped (queue full or no longer needed)",
}
_PREFETCH_GAUGES = {
    "queued": "Files waiting to be prefetched",
    "inflight": "Prefetches in flight",
}
_SAMPLER_COUNTERS = {
    "orders_served": "Epoch orders handed to samplers",
    "losses_ingested": "Per-sample losses received from samplers",
    "reports": "End-of-epoch reports received",
}
_SAMPLER_GAUGES = {
    "samples": ("samples", "Samples in the registered dataset"),
    "epoch": ("epoch", "Epoch the training job reported last"),
    "replay": ("replay", "Replay factor r of the PADS order"),
}
_JOB_COUNTERS = {
    "hits": "Opens by this job served from the cache",
    "misses": "Opens by this job that went to the source",
    "bytes_served": "Bytes returned to this job",
}

_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

StatsFn = Callable[[], Mapping[str, Any]]


def _number(v: object) -> float | None:
    """The value as a float, or None when it is not a number (bools count as 1/0)."""
    if isinstance(v, bool):
        return 1.0 if v else 0.0
    if isinstance(v, int | float):
        return float(v)
    return None


class _Families:
    """Families by name, so labelled samples from several sections share one family."""

    def __init__(self) -> None:
        self._by_name: dict[str, Metric] = {}
        self._labels: dict[str, list[str]] = {}

    def add(
        self,
        kind: str,
        name: str,
        doc: str,
        value: float,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        full = f"{PREFIX}_{name}"
        key = full + "_total" if kind == "counter" else full
        fam = self._by_name.get(key)
        label_names = sorted(labels or {})
        if fam is None:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fam = cls(full, doc, labels=label_names)
            self._by_name[key] = fam
            self._labels[key] = label_names
        elif fam.type != kind or self._labels[key] != label_names:
            # An unknown field that collides with a listed name: the first one wins, since
            # one family cannot mix types or label sets.
            log.debug("skipping %s: %s is already exported differently", name, full)
            return
        label_values = [(labels or {})[k] for k in label_names]
        fam.add_metric(label_values, value)  # type: ignore[attr-defined]

    def taken(self, name: str) -> bool:
        full = f"{PREFIX}_{name}"
        return full in self._by_name or full + "_total" in self._by_name

    def extend(self, metric: Metric) -> None:
        self._by_name[metric.name] = metric
        self._labels[metric.name] = []

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._by_name.values())


class StatsCollector(Collector):
    """Turns the stats dict into `shadefs_*` metric families on every collect.

    `stats_fn` is called once per collect, from whatever thread collects (the HTTP server's
    thread for `start_server`); making that safe is the caller's business.
    """

    def __init__(self, stats_fn: StatsFn) -> None:
        self._stats_fn = stats_fn

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self._stats_fn()
        except Exception as exc:
            # A scrape during shutdown (trio loop gone) or of a wedged daemon: say so in a
            # metric instead of a 500 with a traceback in the daemon's log.
            log.warning("metrics: cannot read the stats: %s", exc)
            up = GaugeMetricFamily(f"{PREFIX}_up", "1 if the stats could be read")
            up.add_metric([], 0.0)
            return [up]
        fams = _Families()
        fams.add("gauge", "up", "1 if the stats could be read", 1.0)
        _top_level(fams, stats)
        _tiers(fams, stats.get("tiers"))
        _prefetch(fams, stats.get("prefetch"))
        _restore(fams, stats.get("restore"))
        _jobs(fams, stats.get("jobs"))
        _section(fams, stats.get("sampler"), "sampler", _SAMPLER_COUNTERS, _SAMPLER_GAUGES)
        hist = _latency(stats.get("source_latency"))
        if hist is not None:
            fams.extend(hist)
        # Last, so that an unknown field can never take a documented name.
        _unknown(fams, stats)
        return list(fams)


def _top_level(fams: _Families, stats: Mapping[str, Any]) -> None:
    for field, (name, doc) in _COUNTERS.items():
        v = _number(stats.get(field))
        if v is not None:
            fams.add("counter", name, doc, v)
    for field, (name, doc) in _GAUGES.items():
        v = _number(stats.get(field))
        if v is not None:
            fams.add("gauge", name, doc, v)
    info = {k: str(stats[k]) for k in ("mountpoint", "source", "policy") if k in stats}
    if info:
        fams.add("gauge", "info", "Mount identity (value is always 1)", 1.0, info)
    state = stats.get("policy_state")
    if isinstance(state, Mapping):
        for k, raw in state.items():
            v = _number(raw)
            if v is not None and _NAME_RE.match(str(k)):
                fams.add("gauge", f"policy_{k}", f"Policy state field {k}", v)


def _unknown(fams: _Families, stats: Mapping[str, Any]) -> None:
    known = _COUNTERS.keys() | _GAUGES.keys() | _SKIP | _SECTIONS
    for k, raw in stats.items():
        if k in known or not _NAME_RE.match(str(k)):
            continue
        v = _number(raw)
        if v is not None and not fams.taken(k):
            fams.add("gauge", k, f"stats.json field {k} (not yet documented)", v)


def _section(
    fams: _Families,
    section: object,
    prefix: str,
    counters: Mapping[str, str],
    gauges: Mapping[str, tuple[str, str]],
    labels: Mapping[str, str] | None = None,
) -> None:
    """Export one mapping: listed counters, listed gauges, other numbers as gauges."""
    if not isinstance(section, Mapping):
        return
    for k, raw in section.items():
        v = _number(raw)
        if v is None or not _NAME_RE.match(str(k)):
            continue
        if k in counters:
            fams.add("counter", f"{prefix}_{k}", counters[k], v, labels)
        elif k in gauges:
            name, doc = gauges[k]
            fams.add("gauge", f"{prefix}_{name}", doc, v, labels)
        else:
            fams.add(
                "gauge", f"{prefix}_{k}", f"{prefix} field {k} (not yet documented)", v, labels
            )


def _tiers(fams: _Families, tiers: object) -> None:
    if not isinstance(tiers, Mapping):
        return
    for tier, section in tiers.items():
        _section(fams, section, "tier", _TIER_COUNTERS, _TIER_GAUGES, {"tier": str(tier)})


def _prefetch(fams: _Families, section: object) -> None:
    gauges = {k: (k, doc) for k, doc in _PREFETCH_GAUGES.items()}
    _section(fams, section, "prefetch", _PREFETCH_COUNTERS, gauges)


def _restore(fams: _Families, section: object) -> None:
    gauges = {
        "done": ("done", "1 once the SSD restore after a restart has finished"),
        "entries": ("entries", "SSD entries restored so far"),
        "seconds": ("seconds", "Seconds the SSD restore has taken so far"),
    }
    _section(fams, section, "restore", {}, gauges)


def _jobs(fams: _Families, jobs: object) -> None:
    if not isinstance(jobs, Mapping):
        return
    for job, section in jobs.items():
        _section(fams, section, "job", _JOB_COUNTERS, {}, {"job": str(job)})


def _latency(section: object) -> Metric | None:
    """The source latency histogram, or None when the section is absent or malformed."""
    if not isinstance(section, Mapping) or not isinstance(section.get("buckets"), Mapping):
        return None
    buckets: list[tuple[float, float]] = []
    for le, raw in section["buckets"].items():
        v = _number(raw)
        try:
            bound = float(le)
        except (TypeError, ValueError):
            bound = math.nan
        if v is None or math.isnan(bound):
            log.debug("source_latency: ignoring bucket %r", le)
            continue
        buckets.append((bound, v))
    buckets.sort()
    count = _number(section.get("count"))
    if not buckets or buckets[-1][0] != math.inf:
        # The exposition needs a +Inf bucket; it is the total count by definition.
        if count is None:
            return None
        buckets.append((math.inf, count))
    total = _number(section.get("sum"))
    hist = HistogramMetricFamily(
        f"{PREFIX}_source_latency_seconds", "Latency of source reads in seconds"
    )
    hist.add_metric(
        [], [(floatToGoString(b), v) for b, v in buckets], sum_value=total if total else 0.0
    )
    return hist


def render(stats: Mapping[str, Any]) -> bytes:
    """The Prometheus text exposition of `stats` (the `.shadefs/metrics` control file)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(lambda: stats))
    return generate_latest(registry)


def parse_address(addr: str) -> tuple[str, int]:
    """`HOST:PORT`, `[V6]:PORT`, `:PORT` or `PORT` -> (host, port); ValueError if malformed.

    A bare port listens on loopback only: exposing the endpoint is a decision to write down.
    """
    text = addr.strip()
    if not text:
        raise ValueError("empty metrics address (use HOST:PORT, :PORT or PORT)")
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        if not sep:
            raise ValueError(f"bad metrics address {addr!r} (use [IPV6]:PORT)")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(
                f"bad metrics address {addr!r}: {host!r} is not an IPv6 address"
            ) from None
    elif ":" in text:
        host, _, port_text = text.rpartition(":")
        if ":" in host:
            raise ValueError(f"bad metrics address {addr!r} (write IPv6 hosts as [HOST]:PORT)")
        host = host or DEFAULT_HOST
    else:
        host, port_text = DEFAULT_HOST, text
    if not port_text.isdigit():
        raise ValueError(f"bad metrics address {addr!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"bad metrics address {addr!r}: port {port} is out of range")
    return host, port


def start_server(addr: str, stats_fn_threadsafe: StatsFn) -> tuple[str, int]:
    """Serve /metrics on `addr` from a daemon thread; return the bound (host, port).

    `stats_fn_threadsafe` is called from the server's threads on every scrape. Port 0 binds
    an ephemeral port. ValueError for a malformed or unresolvable address; OSError when the
    address cannot be bound (in use, not local).
    """
    host, port = parse_address(addr)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats_fn_threadsafe))
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except socket.gaierror as exc:
        raise ValueError(f"bad metrics address {addr!r}: {exc.strerror}") from None
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on {addr}: {exc.strerror}") from None
    bound_host, bound_port = server.server_address[:2]
    log.info("serving Prometheus metrics on %s port %d", bound_host, bound_port)
    return str(bound_host), int(bound_port)
