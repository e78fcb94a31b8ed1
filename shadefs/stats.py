"""The stats schema: counters of the data path, each part's typed state, and their forms.

This module owns the one typed description of what the daemon reports. Each part describes
its own section (`SourceStats`, `NamespaceStats`, `CacheStats` with the RAM tier, the
`SsdStats` with its restore and the policies' `PolicyState`, `PrefetchStats`,
`SamplerStats`), the service assembles them into one `Stats`: `to_json()` is `stats.json`
(stable keys), `render_text()` the `stats` file; `ops.prom` and `ops.watch` read it too.

It imports no part (the parts import it): the data flows one way. The hot path increments
plain int attributes of `Metrics` (no locks: all runs in the trio thread)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = logging.getLogger(__name__)

VERSION = 1  # of the stats.json document


class Metrics:
    """Counters. `hits` and `misses` count opens of regular files: one sample = one file."""

    __slots__ = ("hits", "misses", "kernel_hits", "bytes_served", "passthrough_opens",
                 "control_errors", "started", "requests", "no_open")  # fmt: skip

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}  # FUSE requests by handler (fs/operations.py)
        self.hits = self.misses = self.kernel_hits = 0  # (kernel_hits: see Counters)
        self.bytes_served = 0
        self.passthrough_opens = 0
        self.control_errors = 0
        self.started = time.time()
        self.no_open = False  # kernel hits (kernel/no_open.py): see Counters

    def describe(self) -> Counters:
        return Counters(
            hits=self.hits,
            misses=self.misses,
            kernel_hits=self.kernel_hits,
            bytes_served=self.bytes_served,
            passthrough_opens=self.passthrough_opens,
            control_errors=self.control_errors,
            requests=dict(sorted(self.requests.items())),
            no_open=self.no_open,
        )


# --- the sections, one per part -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Counters:
    """`Metrics` at one instant. JSON: top-level fields of the same names."""

    hits: int  # opens served from a tier of the daemon (RAM, SSD, staged)
    misses: int  # opens that no tier held: fetched, or deferred to their first read
    bytes_served: int
    passthrough_opens: int
    control_errors: int
    requests: dict[str, int] = field(default_factory=dict)  # FUSE requests by type
    kernel_hits: int = 0  # misses the kernel served from its own pages: nothing fetched
    no_open: bool = False  # kernel hits: hits, misses: only reads of pages the kernel lacked


@dataclass(frozen=True, slots=True)
class SourceStats:
    """The source tree. JSON: `source`, `bytes_from_source`, `source_<field>`."""

    root: str
    bytes_read: int
    healthy: bool
    timeouts: int
    errors: int
    inline_reads: int = 0  # files read on the event loop, without a thread (source/inline.py)
    threads_busy: int = 0  # worker threads in a source call now, stuck ones included
    threads_stuck: int = 0  # of those, threads whose caller gave up (timed out or cancelled)
    queue_timeouts: int = 0  # calls that timed out waiting for a thread (all were busy)


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    """Inodes and listings. JSON: top-level fields of the same names."""

    revalidations: int
    changed_files: int
    inodes_known: int
    directories_listed: int
    directories_relisted: int = 0  # listed because the kernel looked their names up one by one


@dataclass(frozen=True, slots=True)
class PolicyState:
    """A policy's state. JSON: `policy_state`, `tiers.ssd.policy` (without None fields)."""

    name: str
    entries: int
    epoch: int | None = None  # epoch: the epoch it is in
    epoch_source: str | None = None  # epoch: "sampler" or "inferred"
    min_score: float | None = None  # shade: the lowest and highest resident importance
    max_score: float | None = None
    kept: int | None = None  # shade: entries kept for reads still to come this epoch

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in _dump(self).items() if v is not None}


@dataclass(frozen=True, slots=True)
class RamStats:
    """The RAM tier. JSON: `tiers.ram` (and `ram_bytes`, `ram_capacity`)."""

    bytes: int
    capacity: int
    entries: int
    hits: int


@dataclass(frozen=True, slots=True)
class RestoreStats:
    """The SSD tier's restore after a restart. JSON: `restore`."""

    done: bool
    entries: int
    seconds: float


@dataclass(frozen=True, slots=True)
class SsdStats:
    """The SSD tier. JSON: `tiers.ssd` without `restore` (top-level), and `ssd_<field>`."""

    bytes: int  # on disk, headers and block rounding included
    data_bytes: int
    capacity: int
    entries: int
    hits: int
    writes: int
    write_failures: int
    dropped_writes: int
    queued_writes: int
    evictions: int
    corrupt_entries: int
    stale_entries: int
    disk_free: int
    min_free: int
    policy: PolicyState
    restore: RestoreStats

    def to_json(self) -> dict[str, Any]:
        d = _dump(self)
        del d["restore"]
        d["policy"] = self.policy.to_json()
        return d


@dataclass(frozen=True, slots=True)
class HandleStats:
    """Bytes that open handles keep alive outside the RAM budget. JSON: `handles`."""

    bytes: int  # held by open handles only (evicted or never admitted)
    limit: int  # past it, new opens of uncached files are read through
    open: int  # handles that hold bytes
    passthrough_opens: int  # opens read through because of the limit
    deferred: int = 0  # opens of misses answered before their fetch (the first read fetches)
    unread: int = 0  # of those, released without a read: a fetch the kernel's pages saved


@dataclass(frozen=True, slots=True)
class FetchStats:
    """Whole files fetched from the source (cache/fetchlog.py). JSON: top-level fields."""

    source_fetches: int = 0
    source_fetch_bytes: int = 0
    refetches: int = 0  # of those, files already fetched this epoch
    refetch_bytes: int = 0


@dataclass(frozen=True, slots=True)
class CacheStats:
    """The cache: its tiers, admissions and RAM policy. JSON: `tiers`, `policy(_state)`,
    `ram_max_entry` and top-level fields of the same names."""

    ram: RamStats
    max_entry: int
    admitted: int
    evictions: int
    refused: int
    fetches_shared: int
    blocked_seconds: float  # that opens spent waiting for the source
    policy: PolicyState
    handles: HandleStats
    ssd: SsdStats | None = None
    fetches: FetchStats = field(default_factory=FetchStats)


@dataclass(frozen=True, slots=True)
class BlockStats:
    """Large files cached in blocks. JSON: `blocks`."""

    block_size: int
    threshold: int  # files above this are cached in blocks (the largest cached whole)
    passthrough_above: int  # files above this are read through (0: no limit, the default)
    opens: int
    hits: int  # block reads served from RAM
    ssd_loads: int  # blocks loaded from the SSD tier
    source_loads: int  # blocks loaded from the source
    read_ahead: int  # blocks whose load read-ahead started
    ahead_bytes: int  # read-ahead bytes in flight or staged now
    range_loads: int  # random reads fetched as extents, not whole blocks (cache/extents.py)
    range_bytes: int  # bytes those fetched
    extent_hits: int  # random reads served from kept extents
    extent_bytes: int  # extents kept now (within the read-ahead window)
    revalidated: int  # files whose blocks were dropped because the file changed
    piece_hits: int = 0  # random reads served from pieces kept in the RAM tier
    pieces_admitted: int = 0  # extents the RAM tier's policy admitted as pieces


@dataclass(frozen=True, slots=True)
class PrefetchStats:
    """The prefetcher. JSON: `prefetch`."""

    plans: int
    plan_positions: dict[str, tuple[int, int]]  # plan name -> (cursor, length)
    fetched: int  # files staged, from the source or (an SSD tier's entries) the SSD
    fetched_bytes: int  # their bytes (the source's alone: `source_fetch_bytes`)
    served: int
    wasted: int
    errors: int
    skipped: int
    staged: int
    staged_bytes: int
    inflight: int
    workers_target: int
    latency_ms: float
    window: int
    plans_done: int
    plans_abandoned: int
    kept: int = 0  # files the RAM tier let go that other jobs still read, staged for them
    late: int = 0  # of `served`: opens that took a prefetch's bytes while it was in flight
    unused: int = 0  # fetched files that landed when no plan read them any more
    kernel_held: int = 0  # planned files not fetched: the kernel's own pages serve them

    def to_json(self) -> dict[str, Any]:
        d = _dump(self)
        d["plan_positions"] = {n: list(p) for n, p in self.plan_positions.items()}
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PrefetchStats:
        pos = {str(n): (int(p[0]), int(p[1])) for n, p in d["plan_positions"].items()}
        return _load(cls, d, plan_positions=pos)


@dataclass(frozen=True, slots=True)
class TableStats:
    """The importance table. JSON: `sampler.table`."""

    samples: int
    scored: int
    scored_fraction: float
    mean_score: float | None
    mean_score_scored: float | None  # None while no sample has a loss
    max_seen: int
    ingested_samples: int
    ingested_batches: int
    version: int
    smoothing: float


@dataclass(frozen=True, slots=True)
class SamplerStats:
    """The sampling registry. JSON: `sampler` (`table` is {} before a registration)."""

    samples: int
    epoch: int
    replay: float
    replay_mode: str  # "auto" or "fixed"
    orders_served: int
    losses_ingested: int
    reports: int
    last_report: dict[str, float]
    table: TableStats | None
    unbridged: int = 0  # admissions refused for a sample a known order still reads
    orders_elsewhere: int = 0  # shares asked for ranks of other nodes (not prefetched)
    # A job over several nodes (mounts): how many, this one's index, the samples it owns.
    nodes: int = 0
    node: int = -1
    owned: int = 0

    def to_json(self) -> dict[str, Any]:
        return {**_dump(self), "table": _dump(self.table) if self.table is not None else {}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SamplerStats:
        table = _load(TableStats, d["table"]) if d["table"] else None
        return _load(cls, d, last_report=dict(d["last_report"]), table=table)


@dataclass(frozen=True, slots=True)
class JobStats:
    """One active job (a training run, or a named sampler). JSON: an item of `jobs`."""

    id: str  # "pid:<n>" (the job's topmost process) or the name its sampler gave
    group: str  # its sweep group ("" for none)
    epoch: int  # its own epoch (inferred from its reads, or announced)
    hits: int
    misses: int
    bytes_served: int  # bytes of the files it opened
    idle_seconds: float  # since its last read
    last_seen: float  # Unix time of its last read


# --- the whole --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stats:
    """Everything the daemon reports at one instant."""

    version: int
    pid: int
    mountpoint: str
    uptime_s: float
    counters: Counters
    source: SourceStats
    namespace: NamespaceStats
    cache: CacheStats
    sampler: SamplerStats
    prefetch: PrefetchStats | None = None
    jobs: tuple[JobStats, ...] = ()
    blocks: BlockStats | None = None
    loop_lag_max_ms: float = 0.0  # the worst delay of a 10 ms loop timer since the last read

    @property
    def opens(self) -> int:
        return self.counters.hits + self.counters.misses

    @property
    def hit_ratio(self) -> float:  # opens served without a fetch: tier hits and kernel hits
        return (self.counters.hits + self.counters.kernel_hits) / self.opens if self.opens else 0.0

    @property
    def files_cached(self) -> int:
        ssd = self.cache.ssd
        return self.cache.ram.entries + (ssd.entries if ssd is not None else 0)

    def to_json(self) -> dict[str, Any]:
        """The `stats.json` document (its keys are documented in the README)."""
        c, src, cache = self.counters, self.source, self.cache
        out: dict[str, Any] = {
            "version": self.version,
            "pid": self.pid,
            "mountpoint": self.mountpoint,
            "source": src.root,
            "uptime_s": self.uptime_s,
            "loop_lag_max_ms": self.loop_lag_max_ms,
            "policy": cache.policy.name,
            "policy_state": cache.policy.to_json(),
            **_dump(c),
            "hit_ratio": self.hit_ratio,
            "bytes_from_source": src.bytes_read,
            "ram_bytes": cache.ram.bytes,
            "ram_capacity": cache.ram.capacity,
            "ram_max_entry": cache.max_entry,
            "files_cached": self.files_cached,
            "tiers": {"ram": _dump(cache.ram)},
            "admitted": cache.admitted,
            "evictions": cache.evictions,
            "refused": cache.refused,
            "fetches_shared": cache.fetches_shared,
            "blocked_seconds": cache.blocked_seconds,
            **_dump(cache.fetches),
            "handles": _dump(cache.handles),
            **_dump(self.namespace),
            **{f"source_{k}": v for k, v in _dump(src).items() if k not in ("root", "bytes_read")},
            "sampler": self.sampler.to_json(),
            "jobs": [_dump(job) for job in self.jobs],
        }
        if cache.ssd is not None:
            ssd = cache.ssd
            out["tiers"]["ssd"] = ssd.to_json()
            for k in ("bytes", "capacity", "hits", "entries"):
                out[f"ssd_{k}"] = getattr(ssd, k)
            out["corrupt_entries"] = ssd.corrupt_entries
            out["restore"] = _dump(ssd.restore)
        if self.prefetch is not None:
            out["prefetch"] = self.prefetch.to_json()
        if self.blocks is not None:
            out["blocks"] = _dump(self.blocks)
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Stats:
        """The inverse of `to_json`; KeyError or TypeError when `d` is not such a document."""
        tiers = d["tiers"]
        ssd = None
        if "ssd" in tiers:
            t = tiers["ssd"]
            restore = _load(RestoreStats, d["restore"])
            ssd = _load(SsdStats, t, policy=_load(PolicyState, t["policy"]), restore=restore)
        cache = _load(
            CacheStats,
            d,
            ram=_load(RamStats, tiers["ram"]),
            max_entry=d["ram_max_entry"],
            policy=_load(PolicyState, d["policy_state"]),
            handles=_load(HandleStats, d["handles"]),
            ssd=ssd,
            fetches=_load(FetchStats, d),
        )
        src = {k.removeprefix("source_"): v for k, v in d.items()}  # source_healthy: healthy
        source = _load(SourceStats, src, root=d["source"], bytes_read=d["bytes_from_source"])
        return _load(
            cls,
            d,
            counters=_load(Counters, d),
            source=source,
            namespace=_load(NamespaceStats, d),
            cache=cache,
            sampler=SamplerStats.from_json(d["sampler"]),
            prefetch=PrefetchStats.from_json(d["prefetch"]) if "prefetch" in d else None,
            jobs=tuple(_load(JobStats, j) for j in d.get("jobs", ())),
            blocks=_load(BlockStats, d["blocks"]) if "blocks" in d else None,
        )


_T = TypeVar("_T", bound="DataclassInstance")


def _dump(obj: DataclassInstance) -> dict[str, Any]:
    """The fields of `obj` as a mapping, one level deep (nested sections are the caller's)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _load(cls: type[_T], d: Mapping[str, Any], **given: Any) -> _T:
    """An instance of `cls` from the same-named keys of `d`; `given` fields win."""
    args = dict(given)
    for f in dataclasses.fields(cls):
        if f.name in args:
            continue
        if f.name in d:
            args[f.name] = d[f.name]
        elif f.default is dataclasses.MISSING:
            raise KeyError(f"{cls.__name__}.{f.name}")
    return cls(**args)
