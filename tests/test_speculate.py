"""Speculative prefetch for jobs with no announced order, over the readers' epoch tracker."""

from __future__ import annotations

import random
import shutil
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import trio
import trio.testing

from shadefs.cache.coordinator import Cache
from shadefs.prefetch import speculate as speculate_mod
from shadefs.prefetch.fetching import PrefetchSettings
from shadefs.prefetch.prefetcher import Plan
from shadefs.prefetch.speculate import Speculator
from shadefs.readers.jobs import JobTable, ProcInfo
from shadefs.readers.part import Readers
from shadefs.readers.tracker import ListingOf, Tracker
from shadefs.stats import Metrics
from tests.conftest import FakeClock
from tests.test_prefetch import _CountingSource

SIZE = 1000
T = TypeVar("T")


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


def _feed(t: Tracker, keys: list[int], row: int = 0) -> int:
    """Job `row` reads `keys` in order, then the universes settle; new epochs begun."""
    began = sum(t.read(k, row) for k in keys)
    t.settle()
    return began


def _unread(t: Tracker, row: int = 0) -> set[int]:
    return set(t.keys[t.unread(row)].tolist())


def test_a_shuffled_epoch_then_a_reread_begins_a_new_epoch() -> None:
    d = FakeListing(b"a", list(range(1, 21)))
    t = Tracker(_listings(d))
    order = random.Random(1).sample(range(1, 21), 20)
    assert _feed(t, order[:7]) == 0
    assert int(t.size[0]) == 20 and int(t.count[0]) == 7  # the subdirectory is not a file
    assert _unread(t) == set(order[7:])
    nxt = random.Random(2).sample(range(1, 21), 20)
    nxt.remove(order[-1])  # (a reopen of the last file is one read)
    # The epoch ends and the next one starts.
    assert _feed(t, order[7:] + nxt[:3]) == 1
    assert int(t.count[0]) == 3 and not t.broken[0] and int(t.epoch[0]) == 1


def test_a_file_read_twice_early_breaks_the_pattern() -> None:
    d = FakeListing(b"a", list(range(1, 21)))
    t = Tracker(_listings(d))
    _feed(t, [1])
    assert _feed(t, [2, 3, 2]) == 0
    assert t.broken[0] and int(t.breaks[0]) == 1
    # Sampling with replacement keeps it broken: re-reads come long before 90% is read.
    _feed(t, [5, 6, 5, 7, 8, 7])
    assert t.broken[0] and int(t.epoch[0]) == 0


def test_an_announced_epoch_wins_over_inference() -> None:
    t = Tracker()
    for k in (1, 2, 3, 1, 2):
        t.read(k, 0)
    assert int(t.epoch[0]) == 1  # inferred: 1 again after the whole universe
    t.announce(5, 0)
    for k in (1, 2, 3, 1, 2, 3):
        t.read(k, 0)
    assert int(t.epoch[0]) == 5 and not t.broken[0]  # replays of the sampler's epoch


def test_the_universe_grows_with_each_directory_read() -> None:
    a, b = FakeListing(b"a", [1, 2, 3]), FakeListing(b"b", [10, 11])
    t = Tracker(_listings(a, b))
    _feed(t, [2])
    assert _unread(t) == {1, 3}
    _feed(t, [11, 1])
    assert int(t.size[0]) == 5 and _unread(t) == {3, 10}
    assert t.path(t.id_of[11]) == b"p11"


def test_demand_counts_follow_every_read_in_constant_time() -> None:
    t = Tracker()
    for k in (1, 2):
        t.read(k, 0)
    t.read(1, 1)  # a second job: it still wants 2, and has consumed 1
    one, two = t.id_of[1], t.id_of[2]
    assert (int(t.want[one]), int(t.done[one])) == (0, 2)
    assert (int(t.want[two]), int(t.done[two])) == (1, 1)
    assert t.rank(two) > t.rank(one)
    t.leave(1)
    assert (int(t.want[two]), int(t.done[two])) == (0, 1)


# --- speculation over a cache ---------------------------------------------------------------


def _cache(
    source: _CountingSource,
    listing_of: ListingOf,
    window: int,
    clock: Callable[[], float] | None = None,
    **kw,
) -> Cache:
    """`clock`: the parts' (trio's virtual time where the test runs them; else a FakeClock,
    which moves only when the test moves it)."""
    clock = clock or FakeClock()
    # Room for 8 files (one file may take an eighth of the budget).
    return Cache(
        source,  # type: ignore[arg-type]
        Metrics(),
        capacity=8000,
        prefetch=PrefetchSettings(window),
        readers=Readers(JobTable(clock=clock), listing_of=listing_of),
        clock=clock,
        **kw,
    )


def _setup(
    n: int = 60,
    idle: float = 1.0,
    window: int = 20 * SIZE,
    clock: Callable[[], float] | None = None,
    **kw,
):
    """`clock`: as `_cache`'s; `kw`: more of the cache's arguments (an SSD tier's)."""
    clock = clock or FakeClock()
    source = _CountingSource(delay=0.005)
    listing_of = _listings(FakeListing(b"d", list(range(1, n + 1))))
    cache = _cache(source, listing_of, window, clock, **kw)
    spec = Speculator(cache, cache.handles.kernel, idle=idle, seed=0, clock=clock)
    return source, cache, spec


def _virtual(fn: Callable[..., Awaitable[T]], *args: object) -> T:
    """`trio.run` on virtual time: the source's delays and the parts' periods pass at once."""
    return trio.run(fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


def _tend(spec: Speculator, cache: Cache) -> None:
    """The speculator's periodic step, at the parts' time now."""
    spec.tend(cache.readers.jobs.clock())


async def _read(cache, source, key: int) -> None:
    data = await cache.open(key, b"p%d" % key, source.stat(key))
    assert data is not None
    cache.unpin(data)  # the handle is released


def test_speculation_never_stages_what_the_job_read_this_epoch() -> None:
    async def run() -> None:
        source, cache, spec = _setup(clock=trio.current_time)
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

    _virtual(run)


def test_speculation_stops_when_the_reads_stop() -> None:
    async def run() -> None:
        source, cache, spec = _setup(idle=0.2, window=5 * SIZE, clock=trio.current_time)
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

    _virtual(run)


def test_a_broken_pattern_drops_the_plan_and_a_new_epoch_replans() -> None:
    async def run() -> None:
        source, cache, spec = _setup(n=20, window=100 * SIZE, clock=trio.current_time)
        pf = cache.prefetcher
        assert pf is not None
        t = cache.readers.tracker
        await _read(cache, source, 1)
        spec.sync()  # the directory joins the job's universe
        for key in (2, 1):  # read twice at 2 of 20: not an epoch
            await _read(cache, source, key)
        spec.sync()
        _tend(spec, cache)
        assert not spec.plans and t.broken[0]
        for key in range(3, 21):  # the rest of the files, then one of them again
            await _read(cache, source, key)
        await _read(cache, source, 5)
        spec.sync()
        _tend(spec, cache)
        assert int(t.epoch[0]) == 1 and not t.broken[0]
        assert spec.plans and len(spec.plans[0]) <= 19  # the new epoch's unread files

    _virtual(run)


def test_no_speculation_when_turned_off_or_while_a_known_order_runs() -> None:
    source = _CountingSource(delay=0.005)
    cache = _cache(source, _listings(FakeListing(b"d", [1, 2, 3, 4])), 20 * SIZE)
    pf = cache.prefetcher
    assert pf is not None
    off = Speculator(cache, cache.handles.kernel, enabled=False, clock=cache.readers.jobs.clock)
    _virtual(_read, cache, source, 1)
    off.sync()
    _tend(off, cache)
    assert not off.plans and len(cache.readers.jobs.jobs[0].reads) == 0  # read in, no plan
    on = Speculator(cache, cache.handles.kernel, clock=cache.readers.jobs.clock)
    _virtual(_read, cache, source, 2)
    _virtual(_read, cache, source, 4)  # (one open is no sign of an epoch: two)
    pf.add_plan(Plan("sampler", np.array([3], dtype=np.uint64), [b"p3"], np.array([SIZE])))
    on.sync()
    _tend(on, cache)
    assert not on.plans  # a job that announces its order gets the clairvoyant prefetcher
    pf.drop_plan("sampler")
    _tend(on, cache)
    assert on.plans


def test_reads_from_a_directory_listed_later_count_as_read() -> None:
    a = FakeListing(b"a", [1, 2, 3, 4])
    listed: dict[int, FakeListing] = {}
    t = Tracker(lambda key: listed.get(key))
    _feed(t, [2, 3])
    assert _unread(t) == set()  # not listed yet: nothing known beyond the reads
    listed.update({k: a for k in (1, 2, 3, 4)})  # the background listing arrives
    _feed(t, [4])
    assert _unread(t) == {1}  # 2 and 3 were read before


def test_a_plans_paths_survive_a_refreshed_listing() -> None:
    from shadefs.prefetch.spec_plans import SpecPlan

    a, b = FakeListing(b"a", [5, 6, 7]), FakeListing(b"b", [1, 2])
    by_key = {5: a, 6: a, 7: a, 1: b, 2: b}
    t = Tracker(lambda key: by_key.get(key))
    _feed(t, [5])
    plan = SpecPlan.over("s", t, t.unread(0))
    a2 = FakeListing(b"a", [5, 6, 7, 8])  # the directory is listed afresh
    by_key.update({k: a2 for k in (5, 6, 7, 8)})
    _feed(t, [1], row=1)
    _feed(t, [8], row=1)
    assert [plan.paths[i] for i in range(len(plan))] == [b"p%d" % k for k in plan.keys]


def test_a_reused_job_row_starts_afresh() -> None:
    source, cache, spec = _setup(n=20)
    _virtual(_read, cache, source, 1)
    spec.sync()
    readers = cache.readers
    now = readers.jobs.clock()
    readers.expire(now)  # the sweep notes its reads
    assert readers.expire(now + readers.jobs.idle + 1) == [0]  # then idle: the job ends
    spec.sync()
    assert 0 not in spec._owner
    _virtual(_read, cache, source, 2)  # a new job takes row 0
    assert int(readers.tracker.count[0]) == 1


def test_speculation_never_stages_a_file_larger_than_the_ram_tier_keeps() -> None:
    async def run() -> None:
        source = _CountingSource(delay=0.005)
        d = FakeListing(b"d", list(range(1, 41)))
        d.rows["st_size"][20:40] = 2 * SIZE  # above what the RAM tier caches whole
        cache = _cache(source, _listings(d), 200 * SIZE, trio.current_time)
        spec = Speculator(cache, cache.handles.kernel, seed=0, clock=trio.current_time)
        assert cache.ram_max < 2 * SIZE
        for key in (3, 5):
            await _read(cache, source, key)
        spec.sync()
        _tend(spec, cache)
        (plan,) = spec.plans.values()
        assert set(plan.keys.tolist()) == set(range(1, 21)) - {3, 5}

    _virtual(run)


def test_a_reopen_straight_after_a_read_is_one_read() -> None:
    async def run() -> None:
        source, cache, spec = _setup(clock=trio.current_time)
        for key in (7, 7, 3, 3, 9):  # Parquet: the footer, a close, the data
            await _read(cache, source, key)
            if key == 3:
                spec.sync()  # a batch boundary between the two opens of 3
        spec.sync()
        t = cache.readers.tracker
        assert not t.broken[0] and int(t.breaks[0]) == 0 and int(t.count[0]) == 3

    _virtual(run)


def _plan_with_ten_held(source, cache, spec) -> set[int]:
    """Of files 1..20: 1..10 opened before (the kernel may hold their pages), 11 and 12
    read now; the keys of the plan made then."""
    for key in range(1, 11):
        cache.handles.kernel.opened(key)
    for key in (11, 12):
        _virtual(_read, cache, source, key)
    spec.sync()
    _tend(spec, cache)
    return set(spec.plans[0].keys.tolist())


def test_files_the_kernel_holds_are_not_staged_while_it_serves_the_reopens() -> None:
    source, cache, spec = _setup(n=20)
    kernel = cache.handles.kernel
    planned = _plan_with_ten_held(source, cache, spec)
    assert planned == set(range(13, 21))  # neither read nor held by the kernel
    # Deferred reopens that the daemon had to serve: the kernel's pages are mostly gone,
    # and the plan is rebuilt with the files it was thought to hold.
    for _ in range(40):
        kernel.served(False)
    assert not kernel.trusted
    _tend(spec, cache)
    assert set(spec.plans[0].keys.tolist()) == set(range(1, 11)) | set(range(13, 21))


def test_ssd_entries_are_staged_even_where_the_kernel_may_hold_their_pages(tmp_path) -> None:
    # An SSD hit is never deferred, so `held` never learns that a drop of the page cache
    # took the kernel's pages (e2e (g)): an SSD entry is planned all the same, since its open
    # reads the entry whether or not the kernel has it.
    from shadefs.cache.ssd.store import SsdStore
    from shadefs.file_version import Signature

    ssd = SsdStore(tmp_path / "ssd", 1 << 30, min_free=0)
    source, cache, spec = _setup(n=20, ssd=ssd, key_of_ino=int)
    assert cache.ssd is not None
    for key in range(1, 6):  # on the SSD, from an earlier epoch
        assert ssd.put(b"p%d" % key, bytes(SIZE), Signature.of(source.stat(key)))
        cache.ssd._index(key, b"p%d" % key, SIZE)
    planned = _plan_with_ten_held(source, cache, spec)
    assert cache.handles.kernel.trusted
    assert planned == set(range(1, 6)) | set(range(13, 21))


def test_the_kernel_pages_map_forgets_with_the_kernel() -> None:
    from shadefs.kernel.pages import KernelPages

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


def test_no_speculation_for_a_job_that_announces_its_epochs() -> None:
    # A sampler's job: its orders are known, and between two of them (or while it replays
    # resident samples) its unread files are no guide to what it reads next.
    source, cache, spec = _setup()
    for key in (1, 2):
        _virtual(_read, cache, source, key)
    spec.sync()
    _tend(spec, cache)
    assert spec.plans  # an unchanged job's unread files are staged
    cache.begin_epoch(1, 0)  # the job announces its epoch
    _virtual(_read, cache, source, 3)
    spec.sync()
    _tend(spec, cache)
    assert not spec.plans


class _Procs:
    """A /proc of our own (readers/jobs.py's ProcInfo reads it): processes that start and
    exit when the test says, each a child of a shell (pid 1 here) of another program."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def start(self, pid: int, program: bytes = b"cat") -> None:
        d = self.root / str(pid)
        d.mkdir(parents=True)
        (d / "status").write_bytes(b"Tgid:\t%d\nPPid:\t1\n" % pid)
        (d / "cmdline").write_bytes(program + b"\0")
        self._stat(pid, b"S")

    def _stat(self, pid: int, state: bytes) -> None:
        fields = [state, *[b"0"] * 18, b"%d" % (1000 + pid)]  # field 22: the start time
        (self.root / str(pid) / "stat").write_bytes(b"%d (x) " % pid + b" ".join(fields))

    def exit(self, pid: int, zombie: bool = False) -> None:
        if zombie:  # exited, not reaped yet
            self._stat(pid, b"Z")
        else:
            shutil.rmtree(self.root / str(pid))


def _cache_of_procs(
    source: _CountingSource, root: Path, n: int, window: int, clock: Callable[[], float]
) -> Cache:
    d = FakeListing(b"d", list(range(1, n + 1)))
    jobs = JobTable(proc=ProcInfo(str(root)), clock=clock)
    readers = Readers(jobs, listing_of=_listings(d))
    prefetch = PrefetchSettings(window)
    return Cache(source, Metrics(), capacity=8000, prefetch=prefetch, readers=readers, clock=clock)  # type: ignore[arg-type]


def test_a_shell_loop_of_one_file_jobs_fetches_each_file_once(tmp_path: Path) -> None:
    # `for f in ...; do cat "$f"; done`: each `cat` is a job of its own (jobs.py) that opens
    # one file and exits. A plan for each staged, for jobs that were over, the files the
    # other `cat`s then read, and what had left the RAM tier again (issue 36: 1.1-1.7
    # passes of fetches for one pass of reads). No plan is made for any of them.
    procs = _Procs(tmp_path / "proc")

    async def run() -> None:
        source = _CountingSource(delay=0.005)
        cache = _cache_of_procs(source, procs.root, 60, 20 * SIZE, trio.current_time)
        spec = Speculator(cache, cache.handles.kernel, seed=0, clock=trio.current_time)
        pf = cache.prefetcher
        assert pf is not None
        order = random.Random(5).sample(range(1, 61), 60)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pf.run)
            nursery.start_soon(spec.run)
            for pid, key in enumerate(order, start=100):
                procs.start(pid)
                data = await cache.open(key, b"p%d" % key, source.stat(key), pid)
                assert data is not None
                cache.unpin(data)
                procs.exit(pid, zombie=pid % 2 == 0)
                await trio.sleep(0.004)  # the shell starts the next `cat`
            await trio.sleep(2 * speculate_mod.PERIOD)
            nursery.cancel_scope.cancel()
        assert len(cache.readers.jobs.jobs) == 60  # one job per `cat`
        # Every file crossed the link once, and only for its reader.
        assert cache.fetchlog.refetches == 0 and pf.fetched == 0
        assert sorted(source.fetches) == sorted(b"p%d" % k for k in range(1, 61))
        assert spec.plans_made == 0

    _virtual(run)


def test_a_plan_needs_two_opens_and_ends_when_the_jobs_processes_exit(tmp_path: Path) -> None:
    procs = _Procs(tmp_path / "proc")
    source = _CountingSource()
    clock = FakeClock()
    cache = _cache_of_procs(source, procs.root, 20, 20 * SIZE, clock)
    spec = Speculator(cache, cache.handles.kernel, seed=0, clock=clock)
    pf = cache.prefetcher
    assert pf is not None
    procs.start(7, b"python")

    def read(key: int) -> None:
        _virtual(cache.open, key, b"p%d" % key, source.stat(key), 7)
        spec.sync()
        _tend(spec, cache)

    read(3)
    assert not spec.plans  # one open: no sign of an epoch yet
    read(5)
    (plan,) = spec.plans.values()  # an unchanged job reading its dataset: its unread files
    assert set(plan.keys.tolist()) == set(range(1, 21)) - {3, 5}
    assert list(pf.plans) == [plan.name]
    procs.exit(7)
    _tend(spec, cache)
    assert not spec.plans and not pf.plans  # it reads nothing more: nothing is staged for it
    _tend(spec, cache)
    assert not spec.plans


def test_listings_join_a_few_at_a_time(monkeypatch) -> None:
    # A job's first reads touch every directory at once: the listings join over several
    # settles (each bounded), never all in one stall of the event loop; nothing is lost.
    from shadefs.readers import tracker as tracker_mod

    monkeypatch.setattr(tracker_mod, "_SETTLE_FILES", 10)
    dirs = [FakeListing(b"d%d" % d, list(range(d * 100 + 1, d * 100 + 9))) for d in range(6)]
    t = Tracker(_listings(*dirs))
    for d in range(6):
        t.read(d * 100 + 1, 0)
    sizes = []
    while t.settle():
        sizes.append(t.size[0])
    assert len(sizes) == 3 and sizes == sorted(sizes)  # two 9-row listings per settle
    assert t.size[0] == 48 and _unread(t) == {k for d in dirs for k in d.ino[:-1].tolist()} - {
        d * 100 + 1 for d in range(6)
    }
