"""The stats schema: the stats.json keys scripts rely on, the round trip, the text form."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import trio
import trio.testing

from shadefs import stats as stats_module
from shadefs.ops.looplag import LoopLag
from shadefs.ops.stats_text import render_text
from shadefs.stats import Stats
from tests.conftest import make_tree
from tests.sample_stats import full, minimal
from tests.test_fs_api import lookup_path, make_fs, read_all

# The stats.json keys as they were when the schema became typed: scripts and tools read them.
TOP = {
    "version", "pid", "mountpoint", "source", "uptime_s", "policy", "policy_state", "hits",
    "misses", "hit_ratio", "bytes_served", "bytes_from_source", "ram_bytes", "ram_capacity",
    "ram_max_entry", "files_cached", "tiers", "admitted", "evictions", "refused",
    "passthrough_opens", "fetches_shared", "blocked_seconds", "handles", "revalidations",
    "changed_files", "inodes_known", "directories_listed", "directories_relisted",
    "source_healthy", "source_timeouts",
    "source_errors", "source_inline_reads", "control_errors", "sampler", "jobs", "source_fetches",
    "source_fetch_bytes", "refetches", "refetch_bytes", "loop_lag_max_ms", "requests",
    "kernel_hits", "source_threads_busy", "source_threads_stuck", "source_queue_timeouts",
    "no_open",
}  # fmt: skip
SSD_TOP = {"ssd_bytes", "ssd_capacity", "ssd_hits", "ssd_entries", "corrupt_entries", "restore"}
RAM = {"bytes", "capacity", "entries", "hits"}
SSD = {
    "bytes", "data_bytes", "capacity", "entries", "hits", "writes", "write_failures",
    "dropped_writes", "queued_writes", "evictions", "corrupt_entries", "stale_entries",
    "disk_free", "min_free", "policy",
}  # fmt: skip
RESTORE = {"done", "entries", "seconds"}
PREFETCH = {
    "plans", "plan_positions", "fetched", "fetched_bytes", "served", "wasted", "errors",
    "skipped", "staged", "staged_bytes", "inflight", "workers_target", "latency_ms", "window",
    "plans_done", "plans_abandoned", "kept", "late", "unused", "kernel_held",
}  # fmt: skip
BLOCKS = {
    "block_size", "threshold", "passthrough_above", "opens", "hits", "ssd_loads", "source_loads",
    "read_ahead", "ahead_bytes", "range_loads", "range_bytes", "extent_hits", "extent_bytes",
    "revalidated", "piece_hits", "pieces_admitted",
}  # fmt: skip
SAMPLER = {
    "samples", "epoch", "replay", "replay_mode", "orders_served", "losses_ingested", "reports",
    "last_report", "table", "nodes", "node", "owned", "unbridged", "orders_elsewhere",
}  # fmt: skip
TABLE = {
    "samples", "scored", "scored_fraction", "mean_score", "mean_score_scored", "max_seen",
    "ingested_samples", "ingested_batches", "version", "smoothing",
}  # fmt: skip


def check_keys(d: dict, *, ssd: bool, prefetch: bool, table: bool, blocks: bool = False) -> None:
    optional = (SSD_TOP if ssd else set()) | ({"prefetch"} if prefetch else set())
    assert set(d) == TOP | optional | ({"blocks"} if blocks else set())
    if blocks:
        assert set(d["blocks"]) == BLOCKS
    assert set(d["tiers"]) == ({"ram", "ssd"} if ssd else {"ram"})
    assert set(d["tiers"]["ram"]) == RAM
    assert {"name", "entries"} <= set(d["policy_state"])
    assert d["policy"] == d["policy_state"]["name"]
    if ssd:
        assert set(d["tiers"]["ssd"]) == SSD and set(d["restore"]) == RESTORE
    if prefetch:
        assert set(d["prefetch"]) == PREFETCH
    assert set(d["sampler"]) == SAMPLER
    assert set(d["sampler"]["table"]) == (TABLE if table else set())


def test_the_document_keeps_its_keys_and_meanings() -> None:
    d = full().to_json()
    check_keys(d, ssd=True, prefetch=True, table=True, blocks=True)
    assert d["hit_ratio"] == 0.75 and d["files_cached"] == 3 + 8
    assert d["source"] == "/mnt/nfs" and d["bytes_from_source"] == 65432
    assert d["ram_bytes"] == d["tiers"]["ram"]["bytes"] == 1000
    assert d["ssd_bytes"] == d["tiers"]["ssd"]["bytes"] and d["ssd_hits"] == 10
    assert d["restore"] == {"done": True, "entries": 8, "seconds": 0.25}
    assert d["prefetch"]["plan_positions"] == {"pid=7": [5, 40]}
    assert d["policy_state"]["max_score"] == 0.9
    assert d["handles"] == {
        "bytes": 2048,
        "limit": 4096,
        "open": 5,
        "passthrough_opens": 1,
        "deferred": 3,
        "unread": 2,
    }
    check_keys(minimal().to_json(), ssd=False, prefetch=False, table=False)
    # A policy leaves out the state it does not have, as before.
    assert minimal().to_json()["policy_state"] == {"name": "lru", "entries": 3}


def test_the_document_parses_back_into_the_same_stats() -> None:
    for s in (full(), minimal()):
        text = json.dumps(s.to_json(), sort_keys=True)
        assert Stats.from_json(json.loads(text)) == s


def test_the_text_form() -> None:
    text = render_text(full())
    assert text.startswith("shadefs /mnt/nfs -> /mnt/shade (pid 4242, up 12 s)\n")
    assert "policy        shade  entries=3 epoch=2 epoch_source=sampler min_score=0.1" in text
    assert "opens         40  hits 30  misses 10 (of which kernel hits 0)  hit ratio 0.750" in text
    assert "ssd           8.8 KiB of 87.9 KiB in 8 files, 10 hits, 2 corrupt entries" in text
    assert "source        NOT ANSWERING  timeouts 3  errors 1" in text
    assert "ssd " not in render_text(minimal())
    assert "job           pid:4242 (group sweep): epoch 3, 12 hits, 4 misses" in text
    assert "job " not in render_text(minimal())


async def test_a_built_daemon_describes_every_part(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {f"d/{i}.bin": bytes(100) for i in range(5)})
    ops, svc = make_fs(src, ssd=str(tmp_path / "ssd"), ssd_size=1 << 20, policy="shade")
    await read_all(ops, await lookup_path(ops, "d/1.bin"))
    await read_all(ops, await lookup_path(ops, "d/1.bin"))
    s = svc.stats()
    assert isinstance(s, Stats)
    assert (s.counters.hits, s.counters.misses) == (1, 1)
    assert s.source.bytes_read == 100 and s.cache.ram.entries == 1
    assert s.cache.ssd is not None and s.cache.ssd.policy.name == "shade"
    assert s.prefetch is not None and s.sampler.table is None
    d = json.loads(json.dumps(s.to_json()))
    check_keys(d, ssd=True, prefetch=True, table=False, blocks=True)
    # Per request type, as the handlers were called (read: data, then EOF, per open).
    assert d["requests"] == {"lookup": 4, "open": 2, "read": 4, "release": 2}
    assert Stats.from_json(d) == s


def test_the_schema_imports_no_part() -> None:
    """Parts import the schema for their dataclasses; the schema imports nothing of the
    project, so that no part can ever form a cycle through it."""
    tree = ast.parse(Path(stats_module.__file__).read_text())
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    assert {m for m in imported if m.startswith("shadefs")} == set()


def test_loop_lag_is_the_worst_timer_delay_since_the_last_take() -> None:
    clock = trio.testing.MockClock(autojump_threshold=0)
    lag = LoopLag()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lag.run)
            await trio.testing.wait_all_tasks_blocked()
            clock.jump(0.05)  # the loop was held: the 10 ms timer fires 40 ms late
            await trio.sleep(0.02)
            assert lag.take() == pytest.approx(40.0, abs=1.0)
            await trio.sleep(0.2)  # on time since then
            assert lag.take() == 0.0
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
