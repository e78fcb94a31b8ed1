"""Speculative prefetch for jobs with no announced order, and the per-job epoch tracking."""

from __future__ import annotations

import random
import stat
import time

import numpy as np
import trio

from shadefs.cache.prefetch import Plan
from shadefs.cache.speculate import Speculator
from shadefs.sampling.epochs import JobReads
from tests.test_prefetch import _cache, _CountingSource

SIZE = 1000


class FakeListing:
    """A directory listing: regular files named p<key>, plus a subdirectory row."""

    def __init__(self, path: bytes, keys: list[int]) -> None:
        self.path = path
        self.ino = np.array([*keys, 999_999], dtype=np.uint64)
        self.rows = np.zeros(len(keys) + 1, dtype=[("st_mode", "<u4"), ("st_size", "<i8")])
        self.rows["st_mode"] = stat.S_IFREG | 0o644
        self.rows["st_mode"][-1] = stat.S_IFDIR | 0o755
        self.rows["st_size"] = SIZE

    def child_path(self, i: int) -> bytes:
        return b"p%d" % int(self.ino[i])


def _listings(*dirs: FakeListing):
    by_key = {int(k): d for d in dirs for k in d.ino[:-1]}
    return lambda key: by_key.get(key)


# --- the epoch tracker ----------------------------------------------------------------------


def test_a_shuffled_epoch_then_a_reread_begins_a_new_epoch() -> None:
    d = FakeListing(b"a", list(range(1, 21)))
    reads = JobReads()
    order = random.Random(1).sample(range(1, 21), 20)
    assert reads.absorb(np.array(order[:7], dtype=np.uint64), _listings(d)) == 0
    assert len(reads) == 20 and reads.count == 7  # the subdirectory is not a file
    assert set(reads.keys[reads.unread()].tolist()) == set(order[7:])
    nxt = random.Random(2).sample(range(1, 21), 20)
    # The epoch ends and the next one starts within one batch.
    assert reads.absorb(np.array(order[7:] + nxt[:3], dtype=np.uint64), _listings(d)) == 1
    assert reads.count == 3 and not reads.paused and reads.epochs == 1


def test_a_file_read_twice_early_breaks_the_pattern() -> None:
    d = FakeListing(b"a", list(range(1, 21)))
    reads = JobReads()
    assert reads.absorb(np.array([1, 2, 3, 2], dtype=np.uint64), _listings(d)) == 0
    assert reads.paused and reads.breaks == 1
    # Sampling with replacement keeps it paused: re-reads come long before 90% is read.
    reads.absorb(np.array([5, 6, 5, 7, 8, 7], dtype=np.uint64), _listings(d))
    assert reads.paused and reads.epochs == 0


def test_the_universe_grows_with_each_directory_read() -> None:
    a, b = FakeListing(b"a", [1, 2, 3]), FakeListing(b"b", [10, 11])
    reads = JobReads()
    reads.absorb(np.array([2], dtype=np.uint64), _listings(a, b))
    assert reads.keys.tolist() == [1, 2, 3]
    reads.absorb(np.array([11, 1], dtype=np.uint64), _listings(a, b))
    assert reads.keys.tolist() == [1, 2, 3, 10, 11]
    assert reads.read.tolist() == [True, True, False, False, True]
    assert reads.path(4) == b"p11"


# --- speculation over a cache ---------------------------------------------------------------


def _setup(n: int = 60, idle: float = 1.0, window: int = 20 * SIZE):
    source = _CountingSource(delay=0.005)
    cache = _cache(source, window=window)
    spec = Speculator(cache, _listings(FakeListing(b"d", list(range(1, n + 1)))), idle=idle, seed=0)
    return source, cache, spec


async def _read(cache, source, key: int) -> None:
    data = await cache.open(key, b"p%d" % key, source.stat(key))
    assert data is not None
    cache.unpin(data)  # the handle is released


def test_speculation_never_stages_what_the_job_read_this_epoch() -> None:
    async def run() -> None:
        source, cache, spec = _setup()
        pf = cache.prefetcher
        assert pf is not None
        order = random.Random(3).sample(range(1, 61), 60)
        read: set[int] = set()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pf.run)
            nursery.start_soon(spec.run)
            for key in order:
                await _read(cache, source, key)
                read.add(key)
                await trio.sleep(0.004)  # the job's pace: slower than the source
                assert not read & set(pf.staged), "staged a file already read this epoch"
            nursery.cancel_scope.cancel()
        assert spec.plans_made >= 1
        assert pf.served > 20  # most misses came from staging
        # Every file crossed the link once in this epoch.
        assert sorted(source.fetches) == sorted(b"p%d" % k for k in range(1, 61))
        assert cache.fetchlog.refetches == 0

    trio.run(run)


def test_speculation_stops_when_the_reads_stop() -> None:
    async def run() -> None:
        source, cache, spec = _setup(idle=0.2, window=5 * SIZE)
        pf = cache.prefetcher
        assert pf is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pf.run)
            nursery.start_soon(spec.run)
            for key in (7, 3, 11):
                await _read(cache, source, key)
            await trio.sleep(0.1)
            assert spec.plans and pf.plans  # the job reads: its unread files are staged
            await trio.sleep(0.4)  # no read for longer than `idle`
            assert not spec.plans and not pf.plans
            fetched = len(source.fetches)
            await trio.sleep(0.3)
            assert len(source.fetches) == fetched  # nothing more is fetched for it
            nursery.cancel_scope.cancel()
        assert fetched < 60  # the window bounded what it fetched while the job read

    trio.run(run)


def test_a_broken_pattern_drops_the_plan_and_a_new_epoch_replans() -> None:
    async def run() -> None:
        source, cache, spec = _setup(n=20, window=100 * SIZE)
        pf = cache.prefetcher
        assert pf is not None
        for key in (1, 2, 1):  # read twice at 2 of 20: not an epoch
            await _read(cache, source, key)
        spec.sync()
        spec.tend(time.monotonic())
        assert not spec.plans and spec.tracks[0].paused
        for key in range(3, 21):  # the rest of the files, then one of them again
            await _read(cache, source, key)
        await _read(cache, source, 5)
        spec.sync()
        spec.tend(time.monotonic())
        assert spec.tracks[0].epochs == 1 and not spec.tracks[0].paused
        assert spec.plans and len(spec.plans[0]) <= 19  # the new epoch's unread files

    trio.run(run)


def test_no_speculation_when_turned_off_or_while_a_known_order_runs() -> None:
    source, cache, _ = _setup()
    pf = cache.prefetcher
    assert pf is not None
    off = Speculator(cache, _listings(FakeListing(b"d", [1, 2, 3])), enabled=False)
    trio.run(_read, cache, source, 1)
    off.sync()
    off.tend(time.monotonic())
    assert not off.plans and len(cache.jobs.jobs[0].reads) == 0  # read in, nothing planned
    on = Speculator(cache, _listings(FakeListing(b"d", [1, 2, 3])))
    trio.run(_read, cache, source, 2)
    pf.add_plan(Plan("sampler", np.array([3], dtype=np.uint64), [b"p3"], np.array([SIZE])))
    on.sync()
    on.tend(time.monotonic())
    assert not on.plans  # a job that announces its order gets the clairvoyant prefetcher
    pf.drop_plan("sampler")
    on.tend(time.monotonic())
    assert on.plans


def test_reads_from_a_directory_listed_later_count_as_read() -> None:
    a = FakeListing(b"a", [1, 2, 3, 4])
    listed: dict[int, FakeListing] = {}
    reads = JobReads()
    reads.absorb(np.array([2, 3], dtype=np.uint64), lambda key: listed.get(key))
    assert len(reads) == 0  # not listed yet: nothing known
    listed.update({k: a for k in (1, 2, 3, 4)})  # the background listing arrives
    reads.absorb(np.array([4], dtype=np.uint64), lambda key: listed.get(key))
    assert reads.keys[reads.unread()].tolist() == [1]  # 2 and 3 were read before


def test_a_plans_paths_survive_the_universe_growing() -> None:
    from shadefs.cache.speculate import SpecPlan

    a, b = FakeListing(b"a", [5, 6, 7]), FakeListing(b"b", [1, 2])
    reads = JobReads()
    reads.absorb(np.array([5], dtype=np.uint64), _listings(a, b))
    plan = SpecPlan.over("s", reads, reads.unread())
    reads.absorb(np.array([1], dtype=np.uint64), _listings(a, b))  # re-sorts the universe
    assert [plan.paths[i] for i in range(len(plan))] == [b"p%d" % k for k in plan.keys]


def test_a_reused_job_row_starts_a_fresh_track() -> None:
    source, cache, spec = _setup(n=20)
    trio.run(_read, cache, source, 1)
    spec.sync()
    first = spec.tracks[0]
    job = cache.jobs.jobs[0]
    job.id = "another job"  # its row now serves a new job
    job.reads.append(1)
    spec.sync()
    assert spec.tracks[0] is not first and spec.tracks[0].count == 1


def test_speculation_never_stages_a_file_larger_than_the_ram_tier_keeps() -> None:
    async def run() -> None:
        source = _CountingSource(delay=0.005)
        cache = _cache(source, window=200 * SIZE)
        d = FakeListing(b"d", list(range(1, 41)))
        d.rows["st_size"][20:40] = 2 * SIZE  # above what the RAM tier caches whole
        spec = Speculator(cache, _listings(d), seed=0)
        assert cache.ram_max < 2 * SIZE
        for key in (3, 5):
            await _read(cache, source, key)
        spec.sync()
        spec.tend(time.monotonic())
        (plan,) = spec.plans.values()
        assert set(plan.keys.tolist()) == set(range(1, 21)) - {3, 5}

    trio.run(run)


def test_a_reopen_straight_after_a_read_is_one_read() -> None:
    async def run() -> None:
        source, cache, spec = _setup()
        for key in (7, 7, 3, 3, 9):  # Parquet: the footer, a close, the data
            await _read(cache, source, key)
            if key == 3:
                spec.sync()  # a batch boundary between the two opens of 3
        spec.sync()
        (track,) = spec.tracks.values()
        assert not track.paused and track.breaks == 0 and track.count == 3

    trio.run(run)


def test_files_the_kernel_holds_are_not_staged_while_it_serves_the_reopens() -> None:
    source, cache, spec = _setup(n=20)
    kernel = cache.handles.kernel
    for key in range(1, 11):  # opened before: the kernel may hold their pages
        kernel.opened(key)
    for key in (11, 12):
        trio.run(_read, cache, source, key)
    spec.sync()
    spec.tend(time.monotonic())
    planned = set(spec.plans[0].keys.tolist())
    assert planned == set(range(13, 21))  # neither read nor held by the kernel
    # Deferred reopens that the daemon had to serve: the kernel's pages are mostly gone,
    # and the plan is rebuilt with the files it was thought to hold.
    for _ in range(40):
        kernel.served(False)
    assert not kernel.trusted
    spec.tend(time.monotonic())
    assert set(spec.plans[0].keys.tolist()) == set(range(1, 11)) | set(range(13, 21))


def test_the_kernel_pages_map_forgets_with_the_kernel() -> None:
    from shadefs.cache.kernel_pages import KernelPages

    kernel = KernelPages()
    assert not kernel.opened(5) and kernel.opened(5)
    assert kernel.may_hold(np.array([5, 6], dtype=np.uint64)).tolist() == [True, False]
    kernel.forget([5])
    assert not kernel.opened(5)
    assert kernel.trusted
    for _ in range(40):
        kernel.served(False)
    assert not kernel.trusted
    for _ in range(40):
        kernel.served(True)
    assert kernel.trusted
