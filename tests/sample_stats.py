"""Typed stats for the consumers' tests, and the schema's field paths read from its types."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import replace
from typing import Any

from shadefs.stats import (
    BlockStats,
    CacheStats,
    Counters,
    HandleStats,
    JobStats,
    NamespaceStats,
    PolicyState,
    PrefetchStats,
    RamStats,
    RestoreStats,
    SamplerStats,
    SourceStats,
    SsdStats,
    Stats,
    TableStats,
)


def full(**top: Any) -> Stats:
    """A snapshot with every section and every optional field set (`top`: Stats fields)."""
    ssd = SsdStats(
        bytes=9000,
        data_bytes=8500,
        capacity=90000,
        entries=8,
        hits=10,
        writes=9,
        write_failures=1,
        dropped_writes=2,
        queued_writes=3,
        evictions=1,
        corrupt_entries=2,
        stale_entries=4,
        disk_free=5 << 30,
        min_free=1 << 30,
        policy=PolicyState(name="epoch", entries=8, epoch=2, epoch_source="inferred"),
        restore=RestoreStats(done=True, entries=8, seconds=0.25),
    )
    table = TableStats(
        samples=100,
        scored=40,
        scored_fraction=0.4,
        mean_score=0.5,
        mean_score_scored=0.6,
        max_seen=2,
        ingested_samples=80,
        ingested_batches=4,
        version=4,
        smoothing=0.5,
    )
    s = Stats(
        version=1,
        pid=4242,
        mountpoint="/mnt/shade",
        uptime_s=12.5,
        counters=Counters(
            hits=30,
            misses=10,
            bytes_served=123456,
            passthrough_opens=2,
            control_errors=0,
            requests={"lookup": 12, "open": 40, "read": 40, "release": 40},
        ),
        source=SourceStats(root="/mnt/nfs", bytes_read=65432, healthy=False, timeouts=3, errors=1),
        namespace=NamespaceStats(
            revalidations=6, changed_files=1, inodes_known=50, directories_listed=5
        ),
        cache=CacheStats(
            ram=RamStats(bytes=1000, capacity=4096, entries=3, hits=20),
            max_entry=512,
            admitted=10,
            evictions=7,
            refused=1,
            fetches_shared=4,
            blocked_seconds=0.125,
            policy=PolicyState(
                name="shade",
                entries=3,
                epoch=2,
                epoch_source="sampler",
                min_score=0.1,
                max_score=0.9,
                kept=2,
            ),
            handles=HandleStats(
                bytes=2048, limit=4096, open=5, passthrough_opens=1, deferred=3, unread=2
            ),
            ssd=ssd,
        ),
        sampler=SamplerStats(
            samples=100,
            epoch=3,
            replay=2.5,
            replay_mode="auto",
            orders_served=6,
            losses_ingested=80,
            reports=2,
            last_report={"train_loss": 1.5},
            table=table,
            nodes=2,
            node=1,
            owned=49,
            orders_elsewhere=3,
        ),
        prefetch=PrefetchStats(
            plans=1,
            plan_positions={"pid=7": (5, 40)},
            fetched=40,
            fetched_bytes=4000,
            served=30,
            wasted=1,
            errors=0,
            skipped=2,
            staged=5,
            staged_bytes=500,
            inflight=2,
            workers_target=4,
            latency_ms=1.5,
            window=1 << 20,
            plans_done=3,
            plans_abandoned=1,
            kept=6,
            late=4,
            unused=1,
        ),
        jobs=(JobStats("pid:4242", "sweep", 3, 12, 4, 160000, 1.5, 1.7e9),),
        blocks=BlockStats(
            block_size=8 << 20,
            threshold=1 << 20,
            passthrough_above=1 << 30,
            opens=3,
            hits=40,
            ssd_loads=2,
            source_loads=5,
            read_ahead=4,
            ahead_bytes=0,
            range_loads=7,
            range_bytes=7 << 15,
            extent_hits=2,
            extent_bytes=5 << 15,
            revalidated=1,
            piece_hits=9,
            pieces_admitted=11,
        ),
    )
    return replace(s, **top)


def minimal() -> Stats:
    """A plain mount before any sampler: no SSD tier, no prefetcher, an LRU policy."""
    s = full(prefetch=None, blocks=None)
    sampler = SamplerStats(0, 0, 1.0, "auto", 0, 0, 0, {}, None)
    policy = PolicyState(name="lru", entries=3)
    return replace(s, cache=replace(s.cache, ssd=None, policy=policy), sampler=sampler, jobs=())


def with_counters(s: Stats, **changes: int) -> Stats:
    return replace(s, counters=replace(s.counters, **changes))


# --- the schema, read from its types ------------------------------------------------------


def _member_type(cls: type, name: str) -> Any:
    """The type of field or property `name` of the dataclass `cls`; KeyError if none."""
    if name in {f.name for f in dataclasses.fields(cls)}:
        return typing.get_type_hints(cls)[name]
    prop = getattr(cls, name, None)
    if isinstance(prop, property) and prop.fget is not None:
        return typing.get_type_hints(prop.fget)["return"]
    raise KeyError(f"{cls.__name__} has no field {name}")


def _unwrap(t: Any) -> Any:
    """`X | None` -> X."""
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return t


def schema_type(path: str) -> Any:
    """The type at the dotted `path` in `Stats`; KeyError when the schema has no such path."""
    t: Any = Stats
    for name in path.split("."):
        if not dataclasses.is_dataclass(t):
            raise KeyError(f"{path}: {name} is inside a leaf")
        t = _unwrap(_member_type(t, name))
    return t


def numeric_leaves(cls: type = Stats, prefix: str = "") -> list[str]:
    """The paths of every int, float or bool field of the schema (properties excluded)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = _unwrap(hints[f.name])
        if dataclasses.is_dataclass(t):
            out += numeric_leaves(t, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        elif t in (int, float, bool):
            out.append(prefix + f.name)
    return out
