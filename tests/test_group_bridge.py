"""A sweep group's members that start apart fetch each file once (readers/pending.py's
ahead counts, the prefetcher's `hold`)."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from shadefs.cache.coordinator import Cache
from shadefs.file_version import Signature
from shadefs.prefetch.fetching import PrefetchSettings
from shadefs.prefetch.prefetcher import Prefetcher
from shadefs.readers.jobs import JobTable, ProcInfo
from shadefs.readers.part import Readers
from shadefs.readers.pending import PendingReads
from shadefs.sampling import wire
from shadefs.stats import Metrics
from tests.test_pending import SIZE, _cache, _Source, registered
from tests.test_prefetch import _CountingSource, _plan


def test_the_first_request_counts_the_order_for_the_members_still_to_ask() -> None:
    pending = PendingReads(lambda key: key)
    pending.reset(4)
    order = np.array([0, 1, 1, 2])
    pending.expect(0, order, job=0, group="g", members=3)
    assert pending.left.tolist() == [3, 6, 3, 0]  # its own reads, and two members' more
    pending.read(1, 0)
    pending.read(1, 1)  # a member that has not asked yet takes nothing off the others'
    assert pending.left.tolist() == [3, 5, 3, 0]
    pending.expect(0, order, job=1, group="g", members=3)  # it asks: its copy moves to it
    assert pending.left.tolist() == [3, 5, 3, 0]
    pending.read(1, 1)
    assert pending.left.tolist() == [3, 4, 3, 0]
    pending.ended(2, "g")  # the third member never asked: its copy goes when it ends
    assert pending.left.tolist() == [2, 2, 2, 0]
    pending.expect(0, order, job=2, group="g", members=3)  # a member that joins late
    assert pending.left.tolist() == [3, 4, 3, 0]  # counts for itself only
    pending.ended(2, "g")
    assert pending.left.tolist() == [2, 2, 2, 0]
    # Another group's first request of epoch 2 releases its copies of epoch 0 that no
    # member claimed (two epochs behind: too far to bridge).
    pending.expect(0, np.array([3]), job=3, group="h", members=3)
    assert pending.reads_left(3) == 3
    pending.expect(2, np.array([3]), job=3, group="h", members=3)
    assert pending.reads_left(3) == 3 and pending.left.tolist() == [2, 2, 2, 3]
    assert pending.reads_left(-1) == 0


@pytest.mark.parametrize("policy", ["shade", "epoch"])
def test_a_member_that_asks_for_the_order_later_finds_the_first_members_files(
    policy: str,
) -> None:
    # Room for 10 files, full of files no order reads. The second member of a group asks
    # for the same order 6 reads after the first: the 6 files it missed meanwhile were
    # counted for it at the first request, so the cache keeps them until it reads them.
    n, lag = 40, 6
    source, pending, cache = _cache([0.5] * (n + 10), slots=10, policy=policy, jobs=True)
    rows = [cache.readers.name_job(pid, f"member{pid}", "sweep") for pid in (1, 2)]
    order = np.random.default_rng(5).permutation(n)

    async def run() -> None:
        for key in range(n, n + 10):  # an earlier job's files fill the cache
            cache.unpin(await cache.open(key, b"/%d" % key, source.stat(key), pid=9))
        source.fetches.clear()
        for t in range(n + lag):
            for member, row in enumerate(rows):
                i = t - member * lag
                if not 0 <= i < n:
                    continue
                if i == 0:
                    pending.expect(0, order, row, group="sweep", members=2)
                    cache.begin_epoch(0, row)
                key = int(order[i])
                data = await cache.open(key, b"/%d" % key, source.stat(key), pid=member + 1)
                assert data is not None
                cache.unpin(data)

    trio.run(run)
    assert sorted(source.fetches) == sorted(order.tolist())  # each file once
    assert cache.readers.jobs.jobs[rows[1]].misses == 0 and not pending.left.any()


def test_a_refused_file_is_held_in_staging_for_the_members_behind() -> None:
    # Room for 8 files, all of them read again by the group: the first member's misses
    # cannot be admitted, and without staging each member behind would fetch them again.
    async def run() -> None:
        source = _CountingSource(delay=0.01)
        pending = PendingReads(lambda key: key if 0 <= key < 20 else -1)
        pending.reset(20)
        # (the parts keep trio's time, virtual here as the source's delays are)
        readers = Readers(JobTable(proc=ProcInfo("/nonexistent"), clock=trio.current_time), pending)
        cache = Cache(source, Metrics(), capacity=8000, prefetch=PrefetchSettings(10_000),  # type: ignore[arg-type]
                      readers=readers, clock=trio.current_time)  # fmt: skip
        pf = cache.prefetcher
        assert pf is not None
        kept, misses = list(range(8)), list(range(8, 14))
        for key in kept:  # another job's reads
            cache.unpin(await cache.open(key, b"/%d" % key, source.stat(key), pid=9))
        rows = [readers.name_job(pid, f"member{pid}", "sweep") for pid in (1, 2, 3)]
        plan = _plan("group", misses + kept, size=1000)
        plan.readers = 3
        pf.add_plan(plan)  # no scheduler runs: what is staged is what the cache held
        for row in rows:
            pending.expect(1, np.array(misses + kept), row, group="sweep", members=3)
        source.fetches.clear()
        for pid in (1, 2, 3):  # one member after another
            for key in misses:
                data = await cache.open(key, b"/%d" % key, source.stat(key), pid=pid)
                assert data == bytes(1000)
                cache.unpin(data)
        assert sorted(source.fetches) == sorted(b"/%d" % k for k in misses)  # once each
        assert sorted(cache.entries) == kept and pending.unbridged == 0
        assert not pf.staged and pf.staged_bytes == 0  # the last reads took them out

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_groups_prefetched_replay_stays_staged_for_every_read() -> None:
    # A group of two reads an order that replays sample 1: four reads of it to come, not
    # one per member.
    sig = Signature(size=3, mtime_ns=1, ctime_ns=1, ino=1)

    async def fetch(items):
        return [(b"abc", sig) for _ in items], 1e-5

    async def run() -> None:
        pending = PendingReads(lambda key: key)
        pending.reset(4)
        pending.expect(0, np.array([1, 2, 1]), job=0, group="g", members=2)
        pf = Prefetcher(fetch, lambda key: 0, pending.reads_left, window=10_000)
        plan = _plan("group", [1, 2, 1])
        plan.readers = 2
        pf.add_plan(plan)
        pf._inflight[1] = 3  # as the scheduler does before it starts a fetch
        await pf._fetch([(1, b"p1", 3)], [(plan, 0)])
        for _ in range(4):
            pf.observe(1)
            assert pf.take(1, sig) == b"abc"  # served from staging, every time
        assert not pf.staged

    trio.run(run)


def test_nothing_is_held_without_a_group_reading() -> None:
    source = _Source()
    pending = PendingReads(lambda key: key)
    pending.reset(4)
    pending.expect(0, np.array([1, 1]), job=0)  # a job of no group: the policies decide
    sig = Signature(size=SIZE, mtime_ns=1, ctime_ns=1, ino=1)
    pf = Prefetcher(source.read_files, lambda key: 0, pending.group_reads_left, window=10_000)
    assert not pf.hold(1, bytes(SIZE), sig)
    pending.expect(0, np.array([1]), job=1, group="sweep", members=2)
    assert not pf.hold(2, bytes(SIZE), sig)  # no read of 2 to come
    assert pf.hold(1, bytes(SIZE), sig) and pf.staged_bytes == SIZE
    assert pf.holds.left == {1: 4}  # its reads to come, over every job
    pending.ended(1, "sweep")
    assert not pf.hold(3, bytes(SIZE), sig)


def test_a_groups_order_is_counted_for_its_members_at_the_first_request() -> None:
    n = 30
    s = registered(n)
    request = wire.OrderRequest(0, 0, 1, 7)
    share = s.order(request, lambda keys: np.zeros(n, bool), "sweep", job=0, members=3)
    assert int(s.pending.left.sum()) == 3 * len(share)  # its reads and two members' more
    again = trio.run(s.order_async, request, lambda: [], "sweep", 1, 3)
    assert np.array_equal(again, share) and int(s.pending.left.sum()) == 3 * len(share)
