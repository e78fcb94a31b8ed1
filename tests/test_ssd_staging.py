"""The prefetcher stages an SSD tier's entries from the SSD: in batches, whatever the source's
pace, and an open that takes one is a hit of the SSD tier that reads neither disk nor source.
A staged entry carries the version it was written for; an open of another version never
gets it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import trio

from shadefs.cache.coordinator import Cache
from shadefs.cache.ssd.store import SsdStore
from shadefs.file_version import Signature
from shadefs.prefetch.fetching import PrefetchSettings
from shadefs.prefetch.plans import Plan
from shadefs.stats import Metrics

SIZE = 1000


def _stat(key: int, mtime: int = 1) -> SimpleNamespace:
    return SimpleNamespace(st_size=SIZE, st_mtime_ns=mtime, st_ctime_ns=mtime, st_ino=key)


class _Source:
    """A slow source (5 ms per file, as NFS) whose reads are counted."""

    def __init__(self) -> None:
        self.fetches: list[bytes] = []

    async def read_file(self, path: bytes, size: int | None = None):
        self.fetches.append(path)
        return b"s" * SIZE, _stat(int(path[1:]), mtime=2)

    def read_now(self, path, size=None):  # a source that always makes its caller wait
        return None

    async def read_files(self, items):
        return [await self.read_file(path, size) for path, size in items], 0.005


def _on_ssd(tmp_path: Path, keys: list[int]) -> tuple[Cache, _Source]:
    """A cache whose SSD tier holds `keys` (an earlier epoch's write-behind) and whose RAM
    tier holds nothing (a RAM tier far smaller than the data)."""
    source = _Source()
    store = SsdStore(tmp_path / "ssd", 1 << 30, min_free=0)
    cache = Cache(
        source,  # type: ignore[arg-type]
        Metrics(),
        capacity=8 * SIZE,
        ssd=store,
        key_of_ino=int,
        prefetch=PrefetchSettings(window=100 * SIZE),
    )
    assert cache.ssd is not None
    for key in keys:
        assert store.put(b"p%d" % key, bytes([key]) * SIZE, Signature.of(_stat(key)))
        cache.ssd._index(key, b"p%d" % key, SIZE)
    return cache, source


def _plan(keys: list[int]) -> Plan:
    return Plan("speculate:1", np.array(keys, dtype=np.uint64), [b"p%d" % k for k in keys],
                np.full(len(keys), SIZE))  # fmt: skip


def test_ssd_entries_are_staged_in_batches_and_taken_as_ssd_hits(tmp_path: Path) -> None:
    keys = list(range(1, 21))
    cache, source = _on_ssd(tmp_path, keys)
    pf, ssd = cache.prefetcher, cache.ssd
    assert pf is not None and ssd is not None
    pf.file_seconds = 0.005  # the source's pace: one of its files per fetch call
    assert pf.batch_size() == 1

    async def run() -> None:
        pf.add_plan(_plan(keys))
        batch, origins = pf._next_batch()
        # SSD entries fill a batch whatever the source's pace (up to 16 files).
        assert [key for key, _, _ in batch] == keys[:16]
        await pf._fetch(batch, origins)
        assert sorted(pf.staged) == keys[:16]
        assert source.fetches == []  # read from the SSD, not the source

        # Taken: the entry's bytes, a hit of the SSD tier, no read anywhere.
        got = await cache.open(3, b"p3", _stat(3))
        assert got == bytes([3]) * SIZE
        assert (cache.metrics.hits, cache.metrics.misses, ssd.hits) == (1, 0, 1)
        assert 3 not in pf.staged and 3 in cache.entries

        # The file changed since its entry was written: the staged bytes are of the old
        # version, never served; the open reads the new one from the source.
        got = await cache.open(4, b"p4", _stat(4, mtime=2))
        assert got == b"s" * SIZE
        assert source.fetches == [b"p4"]
        assert (cache.metrics.hits, cache.metrics.misses) == (1, 1)
        assert 4 not in pf.staged

    trio.run(run)


def test_a_damaged_ssd_entry_is_not_staged_and_its_open_fetches(tmp_path: Path) -> None:
    cache, source = _on_ssd(tmp_path, [1, 2])
    pf, ssd = cache.prefetcher, cache.ssd
    assert pf is not None and ssd is not None
    entry = ssd.store.key_path(b"p2")
    raw = bytearray(entry.read_bytes())
    raw[-1] ^= 0xFF  # a flipped bit in the data: its checksum fails
    entry.write_bytes(raw)

    async def run() -> None:
        pf.add_plan(_plan([1, 2]))
        await pf._fetch(*pf._next_batch())
        assert sorted(pf.staged) == [1]
        got = await cache.open(2, b"p2", _stat(2, mtime=2))
        assert got == b"s" * SIZE and source.fetches == [b"p2"]
        assert 2 not in ssd.index  # the open's lookup found it bad and dropped it

    trio.run(run)


def test_a_file_in_ram_is_not_staged_and_one_on_the_ssd_only_is(tmp_path: Path) -> None:
    cache, _ = _on_ssd(tmp_path, [1, 2])
    pf = cache.prefetcher
    assert pf is not None

    async def run() -> None:
        await cache.open(1, b"p1", _stat(1))  # now in RAM as well
        assert cache.tier_of(1) == 1 and cache.tier_of(2) == 2
        assert cache.cached_keys(ssd=False) == [1] and cache.cached_keys(ram=False) == [1, 2]
        pf.add_plan(_plan([1, 2]))
        batch, _ = pf._next_batch()
        assert [key for key, _, _ in batch] == [2]

    trio.run(run)


def test_staging_reads_the_cache_directory_the_daemon_opened(tmp_path: Path) -> None:
    # The tier works in its directory through the descriptor opened at mount: a directory
    # re-created at that path (with an entry planted in it) is never read.
    cache, _ = _on_ssd(tmp_path, [1])
    pf, ssd = cache.prefetcher, cache.ssd
    assert pf is not None and ssd is not None
    root = ssd.store.root
    root.rename(tmp_path / "moved")
    with SsdStore(root, 1 << 30, min_free=0) as planted:
        assert planted.put(b"p1", b"x" * SIZE, Signature.of(_stat(1)))

        async def run() -> None:
            pf.add_plan(_plan([1]))
            await pf._fetch(*pf._next_batch())
            assert pf.staged[1][0] == bytes([1]) * SIZE

        trio.run(run)
