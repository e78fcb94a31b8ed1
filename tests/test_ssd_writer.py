"""The SSD tier's write-behind (cache/ssd/writer.py, SsdTier.writer): queued files land in
batches, one job of the tier's own low-priority thread per batch; the queue is bounded in
bytes as well as in entries; an unmount during a batch waits for it and frees its room; and
once the restore has indexed the directory a miss asks the disk nothing."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from shadefs.cache.policies.lru import LruPolicy
from shadefs.cache.ssd.store import SsdStore
from shadefs.cache.ssd.tier import SsdTier
from shadefs.cache.ssd.writer import WRITER_NICE, WriterThread
from shadefs.file_version import Signature

SIZE = 1000


def _sig(key: int, size: int = SIZE) -> Signature:
    st = SimpleNamespace(st_size=size, st_mtime_ns=1, st_ctime_ns=1, st_ino=key)
    return Signature.of(st)


def _tier(tmp_path: Path, **kw: int) -> SsdTier:
    store = SsdStore(tmp_path / "ssd", 1 << 30, min_free=0)
    return SsdTier(store, LruPolicy(), int, **kw)


def _offer(tier: SsdTier, key: int, size: int = SIZE) -> None:
    tier.offer(key, b"p%d" % key, bytes([key % 256]) * size, _sig(key, size))


async def _landed(tier: SsdTier) -> None:
    """Wait until every batch handed to the writer thread has been taken in: the writer task
    is blocked on its thread's job, and the thread runs jobs in order."""
    await trio.testing.wait_all_tasks_blocked()
    await tier._pending.thread.run_sync(lambda: None)
    await trio.testing.wait_all_tasks_blocked()


async def test_queued_files_land_in_one_batch_in_the_low_priority_thread(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    for key in range(1, 41):
        _offer(tier, key)
    assert tier.queued == 40
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tier.writer)
        await _landed(tier)
        assert tier.queued == 0 and tier.writes == 40 and tier._reserved == 0
        # One job for the 40 entries (and one for _landed's own): one thread hop.
        assert tier._pending.thread.jobs == 2
        assert tier._pending.thread.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, tier._pending.thread.native_id) == WRITER_NICE
        # The loop's own thread keeps its priority.
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < WRITER_NICE
        nursery.cancel_scope.cancel()
    for key in range(1, 41):
        assert key in tier.index
        assert tier.store.get(b"p%d" % key, _sig(key)) == bytes([key]) * SIZE
    tier.store.close()


async def test_the_queue_is_bounded_in_bytes_but_takes_one_large_file(tmp_path: Path) -> None:
    tier = _tier(tmp_path, queue_bytes=3 * SIZE)
    _offer(tier, 1, 5 * SIZE)  # larger than the bound, but the queue is empty
    _offer(tier, 2)  # dropped: the queue holds more than its bound
    assert tier.queued == 1 and tier.dropped_writes == 1
    # The queued file is an entry already: a reopen is served from the queue.
    assert await tier.lookup(1, b"p1", _sig(1, 5 * SIZE)) == bytes([1]) * 5 * SIZE
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tier.writer)
        await _landed(tier)
        assert tier.queued == 0 and tier._pending.bytes == 0
        for key in (2, 3, 4):  # room again, up to the bound
            _offer(tier, key)
        assert tier.queued == 3 and tier.dropped_writes == 1
        _offer(tier, 5)
        assert tier.dropped_writes == 2
        await _landed(tier)
        nursery.cancel_scope.cancel()
    assert sorted(tier.index) == [1, 2, 3, 4] and tier._pending.bytes == 0
    tier.store.close()


async def test_an_unmount_during_a_batch_waits_for_it_and_frees_its_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = _tier(tmp_path)
    gate, writing = threading.Event(), threading.Event()
    put = tier.store.put

    def slow_put(relpath: bytes, data: bytes, sig: Signature) -> bool:
        writing.set()
        gate.wait(10)
        return put(relpath, data, sig)

    monkeypatch.setattr(tier.store, "put", slow_put)
    _offer(tier, 1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tier.writer)
        await trio.testing.wait_all_tasks_blocked()
        await trio.to_thread.run_sync(writing.wait, 10)
        assert tier._reserved > 0  # the room is held while the thread writes
        nursery.cancel_scope.cancel()
        gate.set()  # the cancelled writer still waits for its batch
    assert tier.writes == 1 and 1 in tier.index and tier._reserved == 0 and tier.queued == 0
    assert tier._pending.thread._thread is None  # the writer's thread ended with it
    tier.store.close()


async def test_a_job_that_raises_raises_in_its_task() -> None:
    thread = WriterThread()

    def boom() -> int:
        raise OSError(5, "gone")

    with pytest.raises(OSError, match="gone"):
        await thread.run_sync(boom)
    assert await thread.run_sync(lambda: 7) == 7
    thread.close()


async def test_once_restored_a_miss_asks_the_disk_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = _tier(tmp_path)
    # An earlier run's entry, before the restore: found by path and indexed (invariant 8).
    assert tier.store.put(b"p1", b"a" * SIZE, _sig(1))
    assert await tier.lookup(1, b"p1", _sig(1)) == b"a" * SIZE and 1 in tier.index
    assert tier.store.put(b"p2", b"b" * SIZE, _sig(2))
    await tier.restore()
    assert tier.indexed and 2 in tier.index
    asked: list[bytes] = []
    get = tier.store.get

    def counted(relpath: bytes, sig: Signature, nowait: bool = False) -> bytes | None:
        asked.append(relpath)
        return get(relpath, sig, nowait)

    monkeypatch.setattr(tier.store, "get", counted)
    assert await tier.lookup(3, b"p3", _sig(3)) is None
    assert asked == []  # not indexed: not on the disk
    assert await tier.lookup(2, b"p2", _sig(2)) == b"b" * SIZE
    assert asked == [b"p2"]  # indexed: read, and checked, from the disk
    tier.store.close()


async def test_a_restore_that_stopped_leaves_lookups_asking_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = _tier(tmp_path)
    assert tier.store.put(b"p1", b"a" * SIZE, _sig(1))

    def failing_scan():  # type: ignore[no-untyped-def]
        raise OSError(5, "the cache disk failed")
        yield  # a generator, as the store's scan

    monkeypatch.setattr(tier.store, "scan", failing_scan)
    await tier.restore()
    assert tier.restore_done and not tier.indexed
    # The walk never reached the entry: the lookup by path still finds it.
    assert await tier.lookup(1, b"p1", _sig(1)) == b"a" * SIZE
    tier.store.close()
