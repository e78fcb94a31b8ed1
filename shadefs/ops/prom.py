"""Prometheus exposition of the daemon's stats, with prometheus-client.

This module owns the mapping from the typed stats (`shadefs.stats.Stats`) to Prometheus
metric families, the text for the `.shadefs/metrics` control file (`render`), and the
optional HTTP endpoint (`start_server`, `--metrics HOST:PORT`). The endpoint only serves
GET of the metrics: nothing in it can change the daemon (control stays in `.shadefs/ctl`).

The mapping is data: `METRICS` lists, for each exported sample, the path of its field in
`Stats` (e.g. `cache.ssd.writes`), its kind, its name and help. A test checks that every
path exists in the schema and that every numeric field of the schema is either exported
or listed in `NOT_EXPORTED`, so a field can be neither invented here nor forgotten.
A path through a section the daemon does not have (no SSD tier, no prefetcher) and a
field that is None (a policy without that state) are skipped.

Metric names (stable): `shadefs_<name>` for gauges, `shadefs_<name>_total` for counters,
with the names in `METRICS`:

- mount-wide: hits, misses, bytes_served, bytes_from_source, admitted, evictions, ...
  and `shadefs_info{mountpoint,source,policy} 1`, `shadefs_up` (1 if the stats could be
  read, else 0);
- `shadefs_policy_<field>` for the RAM policy's state (entries, epoch, min/max score);
- `shadefs_tier_*{tier="ram"|"ssd"}` per cache tier;
- `shadefs_restore_*`, `shadefs_prefetch_*`, `shadefs_sampler_*` per section;
- `shadefs_job_*{job,group}` per active job (`JOB_METRICS`); jobs expire after
  `--job-idle` seconds without reads, so the label values stay bounded.

Every scrape calls the stats callable once, so one scrape is one consistent snapshot. The
collector has no `describe()`, and the registries are built with auto_describe off, so
registering never calls the stats callable (the daemon's callable hops into the trio thread,
which must not happen from the trio thread itself).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shadefs.stats import Stats

log = logging.getLogger(__name__)

PREFIX = "shadefs"
DEFAULT_HOST = "127.0.0.1"

StatsFn = Callable[[], Stats]
Kind = Literal["counter", "gauge"]


@dataclass(frozen=True, slots=True)
class Sample:
    """One exported sample: the field at `path` in `Stats`, as `shadefs_<name>`."""

    path: str
    kind: Kind
    name: str  # without the prefix, and without `_total` (the library adds it to counters)
    doc: str
    labels: tuple[tuple[str, str], ...] = ()


def _c(path: str, name: str, doc: str) -> Sample:
    return Sample(path, "counter", name, doc)


def _g(path: str, name: str, doc: str) -> Sample:
    return Sample(path, "gauge", name, doc)


# field -> (kind, metric name after `tier_`, help), shared by both tiers
_TIER: dict[str, tuple[Kind, str, str]] = {
    "hits": ("counter", "hits", "Opens served from this tier"),
    "evictions": ("counter", "evictions", "Files evicted from this tier"),
    "corrupt_entries": ("counter", "corrupt_entries", "Entries found corrupt and dropped"),
    "stale_entries": ("counter", "stale_entries", "Entries found stale (source changed)"),
    "writes": ("counter", "writes", "Entries written to this tier"),
    "write_failures": ("counter", "write_failures", "Writes to this tier that failed"),
    "dropped_writes": ("counter", "dropped_writes", "Writes dropped (queue or disk full)"),
    "bytes": ("gauge", "bytes", "Bytes held in this tier (on disk for the SSD tier)"),
    "data_bytes": ("gauge", "data_bytes", "Bytes of file data held in this tier"),
    "capacity": ("gauge", "capacity_bytes", "Budget of this tier in bytes"),
    "entries": ("gauge", "entries", "Files held in this tier"),
    "queued_writes": ("gauge", "queued_writes", "Writes waiting for this tier"),
    "disk_free": ("gauge", "disk_free_bytes", "Free space on this tier's disk"),
    "min_free": ("gauge", "min_free_bytes", "Free space this tier leaves on its disk"),
}


def _tier(tier: str, *fields: str) -> list[Sample]:
    return [
        Sample(
            f"cache.{tier}.{f}", _TIER[f][0], f"tier_{_TIER[f][1]}", _TIER[f][2], (("tier", tier),)
        )
        for f in fields
    ]


METRICS: tuple[Sample, ...] = (
    _c("counters.hits", "hits", "Opens of regular files served from the cache"),
    _c("counters.misses", "misses", "Opens of regular files that had to go to the source"),
    _c("counters.bytes_served", "bytes_served", "Bytes returned to readers"),
    _c("counters.passthrough_opens", "passthrough_opens", "Opens served straight from the source"),
    _c("counters.control_errors", "control_errors", "Control writes rejected with EINVAL"),
    _c(
        "counters.kernel_hits",
        "kernel_hits",
        "Misses the kernel served from its own pages (deferred opens released unread)",
    ),
    _g(
        "counters.no_open",
        "kernel_hits_mode",
        "1 when the kernel opens files itself (--kernel-hits): hits and misses count only "
        "the files whose pages the daemon served",
    ),
    _g("hit_ratio", "hit_ratio", "Opens served without a fetch (tier and kernel hits) over opens"),
    _g("uptime_s", "uptime_seconds", "Seconds since the mount"),
    _g("loop_lag_max_ms", "loop_lag_max_ms", "Worst delay of a 10 ms loop timer since last read"),
    _c("source.bytes_read", "bytes_from_source", "Bytes read from the source tree"),
    _c("source.timeouts", "source_timeouts", "Source calls that timed out"),
    _c("source.inline_reads", "source_inline_reads", "Files read without a worker thread"),
    _c("source.errors", "source_errors", "Source calls that failed"),
    _g("source.healthy", "source_healthy", "1 when the source answers, 0 when it does not"),
    _g("source.threads_busy", "source_threads_busy", "Worker threads in a source call now"),
    _g(
        "source.threads_stuck",
        "source_threads_stuck",
        "Worker threads still in a source call that timed out (held until it returns)",
    ),
    _c(
        "source.queue_timeouts",
        "source_queue_timeouts",
        "Source calls that timed out waiting for a worker thread",
    ),
    _c("namespace.revalidations", "revalidations", "Namespace revalidations against the source"),
    _c("namespace.changed_files", "changed_files", "Files found changed in the source"),
    _g("namespace.inodes_known", "inodes_known", "Inodes in the namespace table"),
    _g("namespace.directories_listed", "directories_listed", "Directory listings held"),
    _c(
        "namespace.directories_relisted",
        "directories_relisted",
        "Directories listed because their names were looked up one by one",
    ),
    _c("cache.admitted", "admitted", "Files admitted into the cache"),
    _c("cache.evictions", "evictions", "Files evicted from the cache"),
    _c("cache.refused", "refused", "Files the policy refused to admit"),
    _c("cache.fetches_shared", "fetches_shared", "Fetches that joined one already in flight"),
    _c("cache.blocked_seconds", "blocked_seconds", "Seconds opens spent waiting for the source"),
    _c("cache.fetches.source_fetches", "source_fetches", "Whole files fetched from the source"),
    _c("cache.fetches.source_fetch_bytes", "source_fetch_bytes", "Bytes of whole files fetched"),
    _c("cache.fetches.refetches", "refetches", "Files fetched again within one epoch"),
    _c(
        "cache.fetches.refetch_bytes",
        "refetch_bytes",
        "Bytes of files fetched again within one epoch",
    ),
    _g("cache.handles.bytes", "handle_bytes", "Bytes open handles keep alive outside the budget"),
    _g("cache.handles.limit", "handle_limit_bytes", "Bytes open handles may keep alive"),
    _g("cache.handles.open", "open_handles", "Open file handles that hold bytes"),
    _c(
        "cache.handles.passthrough_opens",
        "handle_passthrough_opens",
        "Opens read through because open handles held too much",
    ),
    _c("cache.handles.deferred", "deferred_opens", "Opens of misses answered before the fetch"),
    _c("cache.handles.unread", "deferred_unread", "Deferred opens released unread: not fetched"),
    _g("cache.ram.bytes", "ram_bytes", "Bytes held in the RAM tier"),
    _g("cache.ram.capacity", "ram_capacity_bytes", "RAM tier budget in bytes"),
    _g("cache.max_entry", "ram_max_entry_bytes", "Largest file the RAM tier caches"),
    _g("files_cached", "files_cached", "Files held in the cache"),
    _g("cache.policy.entries", "policy_entries", "Entries the policy tracks"),
    _g("cache.policy.epoch", "policy_epoch", "Epoch the policy is in"),
    _g("cache.policy.min_score", "policy_min_score", "Lowest importance held"),
    _g("cache.policy.max_score", "policy_max_score", "Highest importance held"),
    _g("cache.policy.kept", "policy_kept", "Entries kept for reads still to come this epoch"),
    *_tier("ram", "bytes", "capacity", "entries", "hits"),
    _g("cache.ssd.bytes", "ssd_bytes", "Bytes held in the SSD tier (on disk)"),
    _g("cache.ssd.capacity", "ssd_capacity_bytes", "SSD tier budget in bytes"),
    _g("cache.ssd.entries", "ssd_entries", "Files held in the SSD tier"),
    _c("cache.ssd.hits", "ssd_hits", "Opens served from the SSD tier"),
    _c("cache.ssd.corrupt_entries", "corrupt_entries", "Cache entries found corrupt and dropped"),
    *_tier(
        "ssd",
        *("bytes", "data_bytes", "capacity", "entries", "hits", "writes", "write_failures"),
        *("dropped_writes", "queued_writes", "evictions", "corrupt_entries", "stale_entries"),
        *("disk_free", "min_free"),
    ),
    _g("cache.ssd.restore.done", "restore_done", "1 once the SSD restore has finished"),
    _g("cache.ssd.restore.entries", "restore_entries", "SSD entries restored so far"),
    _g("cache.ssd.restore.seconds", "restore_seconds", "Seconds the SSD restore has taken"),
    _c("blocks.opens", "blocks_opens", "Opens of files cached in blocks"),
    _c("blocks.hits", "blocks_hits", "Block reads served from RAM"),
    _c("blocks.ssd_loads", "blocks_ssd_loads", "Blocks loaded from the SSD tier"),
    _c("blocks.source_loads", "blocks_source_loads", "Blocks loaded from the source"),
    _c("blocks.read_ahead", "blocks_read_ahead", "Blocks whose load read-ahead started"),
    _g("blocks.ahead_bytes", "blocks_ahead_bytes", "Read-ahead bytes in flight or staged"),
    _c("blocks.range_loads", "blocks_range_loads", "Random reads fetched as extents"),
    _c("blocks.range_bytes", "blocks_range_bytes", "Bytes fetched as extents by random reads"),
    _c("blocks.extent_hits", "blocks_extent_hits", "Random reads served from kept extents"),
    _g("blocks.extent_bytes", "blocks_extent_bytes", "Extents kept for random readers"),
    _c("blocks.piece_hits", "blocks_piece_hits", "Random reads served from RAM pieces"),
    _c("blocks.pieces_admitted", "blocks_pieces_admitted", "Extents admitted to RAM as pieces"),
    _c("blocks.revalidated", "blocks_revalidated", "Files whose blocks were dropped on change"),
    _g("blocks.block_size", "blocks_block_size", "Bytes per block of a large file"),
    _g("blocks.threshold", "blocks_threshold", "Files above this size are cached in blocks"),
    _g("blocks.passthrough_above", "blocks_passthrough_above", "Files above this are read through"),
    _g("prefetch.plans", "prefetch_plans", "Prefetch plans being followed"),
    _c("prefetch.fetched", "prefetch_fetched", "Files fetched by the prefetcher"),
    _c("prefetch.fetched_bytes", "prefetch_fetched_bytes", "Bytes fetched by the prefetcher"),
    _c("prefetch.served", "prefetch_served", "Opens served by a prefetched entry"),
    _c("prefetch.wasted", "prefetch_wasted", "Prefetched entries dropped before use"),
    _c("prefetch.errors", "prefetch_errors", "Prefetches that failed"),
    _c("prefetch.skipped", "prefetch_skipped", "Planned files the prefetcher skipped"),
    _g("prefetch.staged", "prefetch_staged", "Files staged ahead of their reader"),
    _g("prefetch.staged_bytes", "prefetch_staged_bytes", "Bytes staged ahead of readers"),
    _g("prefetch.inflight", "prefetch_inflight", "Prefetches in flight"),
    _g("prefetch.workers_target", "prefetch_workers_target", "Prefetch workers wanted now"),
    _g("prefetch.latency_ms", "prefetch_latency_ms", "Smoothed source latency (ms)"),
    _g("prefetch.window", "prefetch_window", "Bytes the prefetcher may stage ahead"),
    _c("prefetch.plans_done", "prefetch_plans_done", "Prefetch plans followed to the end"),
    _c("prefetch.plans_abandoned", "prefetch_plans_abandoned", "Plans whose reader stopped"),
    _c("prefetch.kept", "prefetch_kept", "Files let go by RAM, staged for jobs still to read"),
    _c("prefetch.late", "prefetch_late", "Opens served by a prefetch still in flight"),
    _c("prefetch.unused", "prefetch_unused", "Prefetched files no plan read when they landed"),
    _c("prefetch.kernel_held", "prefetch_kernel_held", "Planned files left to the kernel's pages"),
    _g("sampler.samples", "sampler_samples", "Samples in the registered dataset"),
    _g("sampler.epoch", "sampler_epoch", "Epoch the training job reported last"),
    _g("sampler.replay", "sampler_replay", "Replay factor r of the PADS order"),
    _c("sampler.orders_served", "sampler_orders_served", "Epoch orders handed to samplers"),
    _c("sampler.losses_ingested", "sampler_losses_ingested", "Per-sample losses received"),
    _c(
        "sampler.unbridged",
        "sampler_unbridged",
        "Admissions refused for samples a known order still reads",
    ),
    _c("sampler.reports", "sampler_reports", "End-of-epoch reports received"),
    _c(
        "sampler.orders_elsewhere",
        "sampler_orders_elsewhere",
        "Shares handed out for ranks of other nodes (not prefetched here)",
    ),
    _g("sampler.nodes", "sampler_nodes", "Nodes of the multi-node job (0: none)"),
    _g("sampler.node", "sampler_node", "This node's index in the multi-node job (-1: none)"),
    _g("sampler.owned", "sampler_owned", "Samples this node owns in the multi-node job"),
)
# JobStats field -> (kind, metric name after `job_`, help), one sample per active job.
JOB_METRICS: dict[str, tuple[Kind, str, str]] = {
    "epoch": ("gauge", "epoch", "Epoch the job is in (inferred or announced)"),
    "hits": ("counter", "hits", "Opens of the job served from the cache"),
    "misses": ("counter", "misses", "Opens of the job that went to the source"),
    "bytes_served": ("counter", "bytes_served", "Bytes of the files the job opened"),
    "idle_seconds": ("gauge", "idle_seconds", "Seconds since the job's last read"),
    "last_seen": ("gauge", "last_seen_seconds", "Unix time of the job's last read"),
}
# The mount's identity, as the labels of `shadefs_info` (value 1).
INFO: dict[str, str] = {
    "mountpoint": "mountpoint",
    "source": "source.root",
    "policy": "cache.policy.name",
}
# Numeric fields of the schema that are deliberately not exported (identity, versions,
# nested detail that stats.json carries for people), with the reason.
NOT_EXPORTED: dict[str, str] = {
    "version": "of the document, not of the daemon",
    "pid": "identity, not a measurement",
    "cache.ssd.policy": "the SSD tier's policy state is detail for stats.json",
    "sampler.table": "the importance table's summary is detail for stats.json",
    "sampler.last_report": "free-form numbers the training job sent",
    "prefetch.plan_positions": "per plan, unbounded label values",
}


def _number(v: object) -> float | None:
    """The value as a float, or None when it is not a number (bools count as 1/0)."""
    if isinstance(v, bool):
        return 1.0 if v else 0.0
    if isinstance(v, int | float):
        return float(v)
    return None


def resolve(stats: Stats, path: str) -> object:
    """The field at `path` (dotted attribute names), or None through an absent section."""
    v: object = stats
    for name in path.split("."):
        if v is None:
            return None
        v = getattr(v, name)
    return v


class StatsCollector(Collector):
    """Turns the stats into `shadefs_*` metric families on every collect.

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
            return [_up(0.0)]
        info = GaugeMetricFamily(
            f"{PREFIX}_info", "Mount identity (value is always 1)", labels=list(INFO)
        )
        info.add_metric([str(resolve(stats, p)) for p in INFO.values()], 1.0)
        fams: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for m in METRICS:
            v = _number(resolve(stats, m.path))
            if v is None:
                continue
            fam = fams.get(m.name)
            if fam is None:
                cls = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
                fam = fams[m.name] = cls(
                    f"{PREFIX}_{m.name}", m.doc, labels=[k for k, _ in m.labels]
                )
            fam.add_metric([value for _, value in m.labels], v)
        return [_up(1.0), info, *fams.values(), *_jobs(stats)]


def _jobs(stats: Stats) -> list[Metric]:
    fams: list[Metric] = []
    for field, (kind, name, doc) in JOB_METRICS.items():
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        fam = cls(f"{PREFIX}_job_{name}", doc, labels=["job", "group"])
        for job in stats.jobs:
            fam.add_metric([job.id, job.group], float(getattr(job, field)))
        fams.append(fam)
    return fams


def _up(value: float) -> Metric:
    up = GaugeMetricFamily(f"{PREFIX}_up", "1 if the stats could be read")
    up.add_metric([], value)
    return up


def render(stats: Stats) -> bytes:
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
