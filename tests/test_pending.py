"""Reads still to come this epoch: `shade` keeps what the known order reads again."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import trio
import trio.testing

from shadefs.cache.coordinator import Cache
from shadefs.readers.jobs import JobTable, ProcInfo
from shadefs.readers.part import Readers
from shadefs.readers.pending import PendingReads
from shadefs.sampling import builds, wire
from shadefs.sampling.registry import Sampling, SamplingError
from shadefs.stats import Metrics

SIZE = 1000


def registered(n: int) -> Sampling:
    """A sampling part with n samples f0..f(n-1) registered, keys 100.., SIZE bytes each."""
    s = Sampling()

    async def resolve(paths: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        return np.arange(100, 100 + n, dtype=np.uint64), np.full(n, SIZE, dtype=np.int64)

    trio.run(s.register, [f"f{i}" for i in range(n)], resolve)
    return s


class _Source:
    """1000-byte files named b"/<key>"; every fetch is counted."""

    def __init__(self) -> None:
        self.fetches: list[int] = []

    @staticmethod
    def stat(key: int) -> SimpleNamespace:
        return SimpleNamespace(st_size=SIZE, st_mtime_ns=1, st_ctime_ns=1, st_ino=key)

    async def read_file(self, path: bytes, size: int | None = None):
        key = int(path[1:])
        self.fetches.append(key)
        return bytes(SIZE), self.stat(key)

    def read_now(self, path, size=None):  # a source that always makes its caller wait
        return None

    async def read_files(self, items):  # the prefetcher's batches
        return [await self.read_file(path, size) for path, size in items], 1e-5


def _total(pending: PendingReads) -> int:
    """Reads still to come, over every sample."""
    return int(pending.left.sum())


def test_pending_reads_count_down_and_a_later_epoch_starts_afresh() -> None:
    pending = PendingReads(lambda key: key - 10 if 10 <= key < 15 else -1)
    pending.reset(5)
    assert not pending.pending(10)
    pending.read(10)  # no order yet: nothing to count
    pending.expect(1, np.array([0, 0, 3]))
    assert pending.pending(10) and pending.pending(13) and not pending.pending(11)
    pending.read(10)
    assert pending.pending(10)
    pending.read(10)
    pending.read(10)  # a read beyond the order's does not go negative
    assert not pending.pending(10) and _total(pending) == 1
    assert not pending.pending(99) and not pending.pending(-5)  # outside the dataset
    pending.expect(1, np.array([0, 0, 3]))  # the same share again: counted once
    assert _total(pending) == 1
    pending.expect(1, np.array([1]), share=(2, 1))  # another rank's share of the epoch adds
    assert _total(pending) == 2
    pending.expect(2, np.array([4]))  # a later epoch replaces
    assert _total(pending) == 1 and pending.pending(14) and not pending.pending(13)


def test_each_job_counts_its_own_reads_and_epochs() -> None:
    # Two members of a sweep group read one order each, at their own pace: the one that
    # starts the next epoch first keeps what the other still reads of this one.
    pending = PendingReads(lambda key: key)
    pending.reset(4)
    pending.expect(0, np.array([0, 1, 2]), job=0)
    pending.expect(0, np.array([0, 1, 2]), job=1)
    assert int(pending.left[0]) == 2
    pending.read(0, 0)
    pending.read(0, 0)  # job 0 reads no sample 0 beyond its own order's
    assert int(pending.left[0]) == 1 and pending.pending(0)
    pending.expect(1, np.array([3]), job=0)  # job 0 moves on; 1 and 2 it skipped
    assert pending.pending(0) and pending.pending(3)
    assert [int(x) for x in pending.left] == [1, 1, 1, 1]
    pending.expect(0, np.array([0, 1, 2]), job=0)  # a stale request counts nothing
    assert int(pending.left.sum()) == 4
    pending.read(0, 1)
    assert not pending.pending(0)
    pending.drop(1)  # job 1 ended
    assert [int(x) for x in pending.left] == [0, 0, 0, 1]


def test_an_order_counts_every_entry_of_every_rank() -> None:
    n = 50
    s = registered(n)
    s.set_replay(2.0)
    resident = np.zeros(n, dtype=bool)
    resident[:10] = True
    share = s.order(wire.OrderRequest(1, 0, 2, 7), lambda keys: resident)
    other = s.order(wire.OrderRequest(1, 1, 2, 7), lambda keys: resident)
    assert _total(s.pending) == len(share) + len(other) == n  # built once, counted once
    assert int(s.pending.left[:10].sum()) == 20  # each resident sample is read twice


def test_orders_are_built_off_the_loop_once_and_only_for_the_current_dataset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = Sampling()
    n = 50
    release = threading.Event()
    built: list[int] = []
    build = builds.build

    def slow_build(*args: object) -> np.ndarray:
        built.append(1)
        release.wait(10)  # until the event loop has done what the test does meanwhile
        return build(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(builds, "build", slow_build)

    async def resolve(paths: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        return np.arange(100, 100 + len(paths), dtype=np.uint64), np.full(len(paths), SIZE)

    async def run() -> None:
        await s.register([f"f{i}" for i in range(n)], resolve)
        shares: list[np.ndarray] = []

        async def ask(rank: int) -> None:
            request = wire.OrderRequest(1, rank, 2, 7)
            shares.append(await s.order_async(request, lambda: np.zeros(0, np.uint64)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, 0)
            nursery.start_soon(ask, 1)
            await trio.testing.wait_all_tasks_blocked()
            assert s.describe().samples == n  # the loop answers while the order is built
            release.set()
        assert len(built) == 1 and sorted(np.concatenate(shares).tolist()) == list(range(n))
        # A dataset registered anew while an order is built: that order is not installed.
        release.clear()

        async def stale() -> None:
            with pytest.raises(SamplingError, match="registered anew"):
                await s.order_async(wire.OrderRequest(2, 0, 1, 7), lambda: np.zeros(0, np.uint64))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stale)
            await trio.testing.wait_all_tasks_blocked()
            await s.register([f"g{i}" for i in range(n)], resolve)
            release.set()

    trio.run(run)


def _epoch(cache: Cache, source: _Source, order: list[int]) -> list[bool]:
    """Open every key of `order` as a reader would; whether each open was a hit."""

    async def run() -> list[bool]:
        hits = []
        for key in order:
            before = cache.metrics.hits
            data = await cache.open(key, b"/%d" % key, source.stat(key))
            hits.append(cache.metrics.hits > before)
            assert data is not None
            cache.unpin(data)  # the handle is released
        return hits

    return trio.run(run)


def _cache(
    scores: list[float], slots: int, policy: str = "shade", kept: bool = True, jobs: bool = False
) -> tuple[_Source, PendingReads, Cache]:
    """A cache with room for `slots` files; key k is sample k, of score scores[k]. `jobs`:
    a job table that reads no /proc, for tests that name their jobs."""
    n = len(scores)
    pending = PendingReads(lambda key: key if 0 <= key < n else -1)
    pending.reset(n)
    source = _Source()
    cache = Cache(
        source,  # type: ignore[arg-type]
        Metrics(),
        capacity=slots * SIZE,
        max_entry=SIZE,
        policy=policy,
        score_of=lambda key: scores[key],
        readers=Readers(
            JobTable(proc=ProcInfo("/nonexistent")) if jobs else None,
            pending if kept else None,
        ),
    )
    return source, pending, cache


@pytest.mark.parametrize("kept", [True, False])
def test_shade_keeps_a_resident_sample_until_the_epochs_last_read_of_it(kept: bool) -> None:
    # Room for 8 files. Samples 0-7 are resident and unimportant; the epoch reads each of
    # them twice (replays), with 8 more important misses (8-15) read in between. Evicting
    # a resident sample for a miss would fetch it again for its second read.
    source, pending, cache = _cache([0.1] * 8 + [0.9] * 8, slots=8, kept=kept)
    _epoch(cache, source, list(range(8)))  # epoch 0 makes 0-7 resident
    assert sorted(cache.entries) == list(range(8))
    order = [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7]
    pending.expect(1, np.array(order))
    cache.begin_epoch(1)
    source.fetches.clear()
    hits = _epoch(cache, source, order)
    if kept:
        # Each sample crossed the link once: the misses, and no resident sample again.
        assert sorted(source.fetches) == list(range(8, 16))
        assert cache.fetchlog.refetches == 0 and all(
            h for h, k in zip(hits, order, strict=True) if k < 8
        )
        assert cache.describe().policy.kept == 0  # the epoch read them all
    else:
        # Without it the important misses push out resident samples still to be read.
        assert cache.fetchlog.refetches > 0
    # What stays for the next epoch is still chosen by importance once nothing is pending:
    # the next miss of an important sample takes the place of an unimportant one.
    _epoch(cache, source, [15, 14])
    assert 15 in cache.entries and 14 in cache.entries


def test_a_new_order_releases_what_the_old_one_did_not_read() -> None:
    source, pending, cache = _cache([0.1, 0.1, 0.9, 0.9], slots=2)
    _epoch(cache, source, [0, 1])
    pending.expect(1, np.array([0, 1, 2, 0, 1]))
    cache.begin_epoch(1)
    _epoch(cache, source, [0, 1, 2])  # the job stops before its replays
    assert sorted(cache.entries) == [0, 1] and cache.describe().policy.kept == 2
    pending.expect(2, np.array([3]))  # the next epoch's order reads neither again
    cache.begin_epoch(2)  # shade checks the kept entries again as admissions need room
    _epoch(cache, source, [3])
    assert 3 in cache.entries  # more important, and nothing is kept any more
    assert cache.describe().policy.kept == 0


@pytest.mark.parametrize("policy", ["shade", "epoch"])
def test_a_sweep_group_fetches_each_file_once_when_its_members_run_apart(policy: str) -> None:
    # Two members of one group read one order per epoch, the second 4 files behind the
    # first: room for 10 files bridges that. The first starts epoch 1 while the second
    # still reads epoch 0, which must keep what the second has still to read.
    n, lag = 40, 4
    source, pending, cache = _cache([0.5] * (2 * n), slots=10, policy=policy, jobs=True)
    rows = [cache.readers.name_job(pid, f"member{pid}", "sweep") for pid in (1, 2)]
    rng = np.random.default_rng(3)
    orders = [rng.permutation(n), n + rng.permutation(n)]  # epoch 1 reads other files
    follower_misses: list[int] = []

    async def run() -> None:
        for t in range(2 * n + lag):
            for member, row in enumerate(rows):
                i = t - member * lag
                if i < 0 or i >= 2 * n:
                    continue
                epoch, at = divmod(i, n)
                if at == 0:
                    pending.expect(epoch, orders[epoch], row)
                    cache.begin_epoch(epoch, row)
                key = int(orders[epoch][at])
                data = await cache.open(key, b"/%d" % key, source.stat(key), pid=member + 1)
                assert data is not None
                cache.unpin(data)
                if member == 1 and i == n - 1:
                    follower_misses.append(cache.readers.jobs.jobs[row].misses)

    trio.run(run)
    # The second member read all of epoch 0 from what the first fetched.
    assert follower_misses == [0] and pending.unbridged == 0
    assert not pending.left.any()


def test_members_further_apart_than_the_cache_bridges_are_counted() -> None:
    # Room for 5 files, the second member 8 files behind: the first member's misses that
    # the second still reads cannot all stay, and the stats say so.
    n, lag = 30, 8
    source, pending, cache = _cache([0.5] * n, slots=5, jobs=True)
    rows = [cache.readers.name_job(pid, f"member{pid}", "sweep") for pid in (1, 2)]
    order = np.random.default_rng(4).permutation(n)
    for row in rows:
        pending.expect(0, order, row)

    async def run() -> None:
        for t in range(n + lag):
            for member in (0, 1):
                i = t - member * lag
                if 0 <= i < n:
                    key = int(order[i])
                    data = await cache.open(key, b"/%d" % key, source.stat(key), pid=member + 1)
                    assert data is not None
                    cache.unpin(data)

    trio.run(run)
    assert pending.unbridged > 0 and len(source.fetches) > n
