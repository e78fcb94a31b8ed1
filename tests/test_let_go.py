"""A file the RAM tier lets go while another job still reads it this epoch is staged for that
job, not fetched again: several jobs in their own orders evict each other's files."""

from __future__ import annotations

import trio

from shadefs.cache.deferred import Deferred
from tests.test_prefetch import _CountingSource
from tests.test_speculate import SIZE, FakeListing, _cache, _listings

# Two readers' pids that no process has (a live one would resolve to its job's root).
_A, _B = 4_190_001, 4_190_002


async def _open(cache, source, key: int, pid: int) -> None:
    data = await cache.open(key, b"p%d" % key, source.stat(key), pid)
    assert data is not None
    cache.unpin(data)


async def _setup(other_job: bool):
    """A cache of 8 files over one directory of 12 (and, with `other_job`, a 13th that job B
    opened first, so that B's universe is the whole directory): (source, keys, cache, pf)."""
    source = _CountingSource(delay=0)
    keys = list(range(1, 13))
    cache = _cache(
        source, _listings(FakeListing(b"d", [*keys, 50] if other_job else keys)), 20 * SIZE
    )
    pf = cache.prefetcher
    assert pf is not None
    if other_job:
        await _open(cache, source, 50, pid=_B)  # job B joins
        cache.readers.tracker.settle()  # its directory joins its universe: every file
    return source, keys, cache, pf


def test_an_evicted_file_another_job_still_reads_is_staged_for_it() -> None:
    async def run() -> None:
        source, keys, cache, pf = await _setup(other_job=True)
        for key in keys:  # job A reads 12 files into a cache of 8: 4 or more evicted
            await _open(cache, source, key, pid=_A)
        assert cache.evictions + cache.refused >= 4 and pf.kept == cache.evictions + cache.refused
        assert len(source.fetches) == 13
        for key in keys:  # B reads them too: from RAM or from staging, never the source
            await _open(cache, source, key, pid=_B)
        assert len(source.fetches) == 13 and pf.served == pf.kept
        assert not pf.staged and pf.staged_bytes == 0  # each held for its one reader

    trio.run(run)


def test_a_file_no_other_job_reads_is_let_go() -> None:
    async def run() -> None:
        source, keys, cache, pf = await _setup(other_job=False)
        for key in keys:  # one job: what it evicts it has read this epoch
            await _open(cache, source, key, pid=_A)
        assert cache.evictions + cache.refused >= 4 and pf.kept == 0 and not pf.staged

    trio.run(run)


def test_a_lazy_open_of_a_kept_file_is_deferred_and_counts_a_kernel_hit() -> None:
    # Issue 36: a kept file the kernel may still hold pages of was handed the staged bytes at
    # open, a miss; the kernel then served every read from its pages. Deferred instead, it
    # is a kernel hit when released unread, and a read that does come takes the staged
    # bytes, never the source.
    async def run() -> None:
        source, keys, cache, pf = await _setup(other_job=True)
        for key in keys:
            await _open(cache, source, key, pid=_A)
        kept = [key for key in keys if key in pf.staged]
        assert len(kept) >= 2
        unread, read = kept[:2]
        for key in (unread, read):
            got = await cache.open_entry(key, b"p%d" % key, source.stat(key), _B, lazy=True)
            assert isinstance(got, Deferred)
            got.answered()
            if key == read:
                view = await got.read()  # its first read: the staged bytes
                assert len(view) == SIZE
                cache.unpin(view.obj)
            else:
                got.drop()  # released unread: the kernel served it
        assert cache.metrics.kernel_hits == 1
        assert len(source.fetches) == 13  # nothing fetched again

    trio.run(run)
