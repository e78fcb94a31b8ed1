"""Clairvoyant prefetching and Belady eviction on a known order."""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyfuse3
import pytest
import trio
import trio.testing

from shadefs.cache.policies import BeladyPolicy
from shadefs.kernel.pages import KernelPages
from shadefs.prefetch.fetching import SSD
from shadefs.prefetch.prefetcher import Plan, Prefetcher
from tests.conftest import FakeClock, poll, require_fuse, shadefs_cmd

REPO = Path(__file__).resolve().parents[1]
# When a plan's reads happen, for the tests of cursors and next uses (none looks at the
# reader's pace, which a read's time feeds): a fixed time, not the real clock.
READ_AT = 1000.0


# --- Belady against an exhaustive MIN -------------------------------------------------


def brute_force_min(trace: list[int], cap: int) -> int:
    """The most hits any demand cache of `cap` unit entries can get on `trace`:
    an exhaustive search over every admit/bypass and every victim choice."""

    @functools.cache
    def best(t: int, cache: frozenset[int]) -> int:
        if t == len(trace):
            return 0
        x = trace[t]
        if x in cache:
            return 1 + best(t + 1, cache)
        options = [best(t + 1, cache)]  # bypass
        if len(cache) < cap:
            options.append(best(t + 1, cache | {x}))
        else:
            options += [best(t + 1, (cache - {v}) | {x}) for v in cache]
        return max(options)

    return best(0, frozenset())


def belady_hits(trace: list[int], cap: int) -> int:
    plan = Plan("t", np.array(trace, dtype=np.uint64), [b""] * len(trace), np.ones(len(trace)))

    def next_use(key: int) -> float:
        return plan.cursor + plan.next_use(key)  # an absolute position: stable as it advances

    policy = BeladyPolicy(next_use)
    resident: set[int] = set()
    hits = 0
    for x in trace:
        plan.observe(x, READ_AT)  # the reader moves past x
        if x in resident:
            hits += 1
            policy.accessed(x, True)
            continue
        policy.accessed(x, False)
        victims = policy.admit(x, 1, cap - len(resident))
        if victims is None:
            continue
        for v in victims:
            resident.discard(v)
            policy.removed(v)
        resident.add(x)
        policy.inserted(x, 1)
        assert len(resident) <= cap
    return hits


@pytest.mark.parametrize("seed", range(12))
def test_belady_matches_exhaustive_min_on_random_orders(seed: int) -> None:
    rng = random.Random(seed)
    keys = rng.randint(3, 6)
    trace = [rng.randrange(keys) for _ in range(rng.randint(8, 16))]
    cap = rng.randint(1, 3)
    assert belady_hits(trace, cap) == brute_force_min(trace, cap), (trace, cap)


def test_belady_never_evicts_what_is_needed_sooner() -> None:
    order = [1, 2, 3, 9, 1, 2, 3]
    plan = Plan("t", np.array(order, dtype=np.uint64), [b""] * 7, np.ones(7))
    plan.cursor = 4  # the reader has just read 9; 1, 2, 3 are needed right after
    policy = BeladyPolicy(lambda k: plan.cursor + plan.next_use(k))
    for k in (1, 2, 3):
        policy.inserted(k, 1)
    assert policy.admit(9, 1, 0) is None  # 9 is never read again: not worth any of them
    assert policy.admit(42, 1, 0) is None  # unknown to the plan: infinitely far
    policy.inserted(7, 1)  # resident and never needed again
    assert policy.admit(9, 1, 0) is None  # ...but neither is 9: no swap for nothing
    assert policy.shrink(1) == [7]  # when room is needed, 7 goes first


# --- the prefetcher's scheduling ----------------------------------------------------------


def _not_cached(key: int) -> int:
    return 0


async def _never_fetched(items: object) -> None:
    raise AssertionError("the scheduling tests fetch nothing")


def _prefetcher(window: int, tier_of=_not_cached, **kw) -> Prefetcher:
    """A prefetcher on a clock that moves only when the test moves it."""
    return Prefetcher(_never_fetched, tier_of, window=window, clock=FakeClock(), **kw)


def _plan(name: str, keys: list[int], size: int = 100) -> Plan:
    return Plan(name, np.array(keys, dtype=np.uint64), [b"p%d" % k for k in keys],
                np.full(len(keys), size))  # fmt: skip


def test_the_reader_with_least_buffered_ahead_goes_first() -> None:
    pf = _prefetcher(10_000)
    a, b = _plan("a", list(range(0, 50))), _plan("b", list(range(100, 150)))
    pf.add_plan(a)
    pf.add_plan(b)
    a.frontier = 20  # a already has 20 entries fetched ahead of its reader, b none
    pick = pf._next_item()
    assert pick is not None and pick[:2] == (b, 0)


def test_window_bounds_what_is_staged_and_skips_oversized() -> None:
    pf = _prefetcher(250)
    pf.add_plan(_plan("a", [1, 2, 3, 4], size=100))
    first = pf._next_item()
    pf._inflight[1] = 100
    pf._inflight_bytes = 100
    second = pf._next_item()
    pf._inflight[2] = 100
    pf._inflight_bytes = 200
    assert first and second and pf._next_item() is None  # 300 would exceed the window
    big = _prefetcher(50)
    big.add_plan(_plan("b", [1, 2], size=100))
    assert big._next_item() is None and big.skipped == 2


def test_files_the_kernel_serves_are_left_to_it() -> None:
    """A planned file whose reads the kernel's own pages will serve is not staged: fetched,
    it would never be read (under kernel hits the daemon does not even see its open)."""
    kernel = KernelPages()
    for key in (2, 3):
        kernel.opened(key)  # opened since the kernel last forgot them: it may hold them
    pf = _prefetcher(10_000, kernel=kernel, no_open=True)
    pf.add_plan(_plan("a", [1, 2, 3, 4]))

    def picks() -> list[int]:
        got = []
        while (pick := pf._next_item()) is not None:
            got.append(pick[2])
            pf._inflight[pick[2]] = 100
            pf._inflight_bytes += 100
        return got

    assert picks() == [1, 4] and pf.kernel_held == 2
    for _ in range(32):  # its files are read again: the kernel's pages went
        kernel.served(False)
    pf._trust()  # (each round's first step): the plan goes back to its reader
    assert picks() == [2, 3]


@pytest.mark.parametrize("no_open", [False, True])
def test_an_ssd_entry_is_left_to_the_kernel_only_without_opens(no_open: bool) -> None:
    """With opens, an SSD entry is staged whatever the kernel holds: its open reads the
    entry anyway, and staging it spares the reader that read."""
    kernel = KernelPages()
    kernel.opened(7)
    pf = _prefetcher(10_000, lambda key: SSD, kernel=kernel, no_open=no_open)
    pf.add_plan(_plan("a", [7]))
    assert (pf._next_item() is None) == no_open


def test_concurrency_follows_littles_law() -> None:
    pf = _prefetcher(10_000, max_workers=16)
    p = _plan("a", list(range(100)))
    pf.add_plan(p)
    # A slow source (5 ms per file) gets a file per fetch call.
    p.rate, pf.latency, pf.file_seconds = 200.0, 0.005, 0.005
    assert pf.batch_size() == 1
    assert pf.target_workers() == 2  # 200 reads/s, 5 ms per fetch: ~1 in flight
    pf.latency = pf.file_seconds = 0.05  # a slower source needs more in flight
    assert pf.target_workers() == 11
    pf.latency = pf.file_seconds = 1.0  # but never more than max_workers
    assert pf.target_workers() == 16


def test_a_fast_source_is_fetched_in_batches() -> None:
    pf = _prefetcher(10_000, max_workers=16)
    p = _plan("a", list(range(100)))
    pf.add_plan(p)
    # 100 us per file: 20 files would take the 2 ms a batch may, 16 is the cap.
    p.rate, pf.latency, pf.file_seconds = 2000.0, 0.004, 0.0001
    assert pf.batch_size() == 16
    assert pf.target_workers() == 2  # 16 files per 4 ms call keep up with 2000 reads/s
    pf.file_seconds = 0.0005  # 500 us per file: four per call, so more calls
    assert pf.batch_size() == 4 and pf.target_workers() == 3
    batch, origins = pf._next_batch()
    assert [k for k, _, _ in batch] == [0, 1, 2, 3] and set(pf._inflight) == {0, 1, 2, 3}
    assert origins == [(p, 0), (p, 1), (p, 2), (p, 3)]
    assert [k for k, _, _ in pf._next_batch()[0]] == [4, 5, 6, 7]  # never a key twice


# --- real mounts over a slow source ---------------------------------------------------------


def _slowfs(real: Path, mnt: Path, *args: str) -> None:
    mnt.mkdir()
    subprocess.run(
        [sys.executable, "-m", "shadefs.demo.slowfs", str(real), str(mnt), "--daemon", *args],
        check=True,
        timeout=60,
    )


def _slow_stats(mnt: Path) -> dict:
    return json.loads(os.getxattr(mnt, "user.slowfs.stats"))


@pytest.fixture
def slow_source(tmp_path: Path):
    require_fuse()
    real = tmp_path / "real"
    for i in range(60):
        p = real / f"c{i % 3}" / f"s{i:03d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(20_000 + i))
    remote = tmp_path / "remote"
    _slowfs(real, remote, "--open-latency", "20", "--bandwidth", "0")
    try:
        yield real, remote
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(remote)], check=False)


def _write_plan(mnt: Path, rels: list[str]) -> None:
    with open(mnt / ".shadefs" / "plan", "w") as f:
        f.write("".join(r + "\n" for r in rels))


@pytest.mark.mount
def test_a_jobs_own_order_is_prefetched_before_it_reads(slow_source, mounter) -> None:
    real, remote = slow_source
    m = mounter(remote, "--ram", "256K")  # far smaller than the data: hits cannot explain it
    rels = sorted(str(p.relative_to(real)) for p in real.rglob("*.bin"))
    opens_before = _slow_stats(remote)["opens"]
    _write_plan(m.mnt, rels[:30])
    poll(lambda: m.stats()["prefetch"]["fetched"] >= 30, lambda: str(m.stats()["prefetch"]), 20)
    # The source saw the reads before the reader asked for anything.
    assert _slow_stats(remote)["opens"] - opens_before >= 30
    before = m.stats()
    for rel in rels[:30]:
        assert (m.mnt / rel).read_bytes() == (real / rel).read_bytes()
    after = m.stats()
    assert after["prefetch"]["served"] - before["prefetch"]["served"] >= 25
    assert after["bytes_from_source"] == before["bytes_from_source"]  # nothing fetched on demand
    assert after["blocked_seconds"] - before["blocked_seconds"] < 0.2


@pytest.mark.mount
def test_an_abandoned_order_stops_being_prefetched(slow_source, mounter) -> None:
    real, remote = slow_source
    m = mounter(remote, "--ram", "256K", "--prefetch-window", "60K", "-o", "prefetch_abandon=1")
    rels = sorted(str(p.relative_to(real)) for p in real.rglob("*.bin"))
    _write_plan(m.mnt, rels)
    for rel in rels[:3]:
        (m.mnt / rel).read_bytes()
    time.sleep(2.5)  # the reader stopped mid-epoch
    s = m.stats()["prefetch"]
    assert s["plans"] == 0 and s["plans_abandoned"] == 1 and s["staged"] == 0
    opens = _slow_stats(remote)["opens"]
    time.sleep(1.0)
    assert _slow_stats(remote)["opens"] == opens  # the source sees nothing more
    # The window kept it from fetching the whole list ahead of a reader that never came.
    assert m.stats()["prefetch"]["fetched"] < len(rels)


@pytest.mark.mount
def test_unmount_stops_the_prefetcher_cleanly(tmp_path: Path, mounter) -> None:
    require_fuse()
    real = tmp_path / "real"
    real.mkdir()
    for i in range(200):
        (real / f"f{i:03d}").write_bytes(b"x" * 1000)
    remote = tmp_path / "remote"
    _slowfs(real, remote, "--open-latency", "200")  # every fetch takes a while
    try:
        m = mounter(remote, "--ram", "1M")
        _write_plan(m.mnt, [f"f{i:03d}" for i in range(200)])
        time.sleep(0.5)
        assert m.stats()["prefetch"]["inflight"] > 0
        t0 = time.monotonic()
        res = subprocess.run(shadefs_cmd("umount", str(m.mnt)), capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        assert time.monotonic() - t0 < 10
        log = m.log.read_text()
        assert "Traceback" not in log and "unmounted" in log
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(remote)], check=False)


def test_a_late_read_of_a_replayed_sample_does_not_jump_the_cursor() -> None:
    # Sample 7 is replayed: at positions 10 and 900. Workers have read everything up to 100
    # but position 10, whose worker is slow.
    order = list(range(1000, 2000))
    order[10] = order[900] = 7
    plan = Plan("r", np.array(order, dtype=np.uint64), [b""] * 1000, np.ones(1000))
    for pos in range(0, 100):
        if pos != 10:
            plan.observe(order[pos], READ_AT)
    assert plan.cursor == 10  # the first position not read yet
    plan.observe(7, READ_AT)  # the late copy at 10, not the one at 900
    assert plan.cursor == 100
    assert plan.next_use(7) == 800  # its next use is the copy at 900
    for pos in range(100, 900):
        plan.observe(order[pos], READ_AT)
    plan.observe(7, READ_AT)  # now it is the copy at 900
    assert plan.cursor == 901


def test_interleaved_workers_on_a_replayed_order_end_the_plan_only_at_its_end() -> None:
    from shadefs.sampling import pads

    n = 2000
    rng = np.random.default_rng(0)
    resident = np.zeros(n, bool)
    resident[rng.choice(n, 400, replace=False)] = True
    params = pads.OrderParams(epoch=2, seed=0, world_size=1, rank=0, replay=3.0)
    order = pads.build_global_order(rng.random(n), resident, params)
    plan = Plan("x", order.astype(np.uint64), [b""] * n, np.ones(n))
    # 4 DataLoader workers, batches of 64, their reads interleaved.
    reads = []
    batches = [order[i : i + 64] for i in range(0, n, 64)]
    for g in range(0, len(batches), 4):
        group = [list(b) for b in batches[g : g + 4]]
        for j in range(64):
            reads += [int(b[j]) for b in group if j < len(b)]
    for i, key in enumerate(reads):
        plan.observe(key, READ_AT)
        assert not plan.done or i == len(reads) - 1, f"done after {i + 1} of {n} reads"
        assert i + 1 - plan.cursor <= 4 * 64  # never further behind than the batches in flight
    assert plan.done


def test_a_groups_staged_file_waits_for_every_member() -> None:
    from shadefs.file_version import Signature

    sig = Signature(size=3, mtime_ns=1, ctime_ns=1, ino=1)

    async def fetch(items):
        return [(b"abc", sig) for _ in items], 1e-5

    async def run() -> None:
        pf = Prefetcher(fetch, _not_cached, window=10_000, clock=FakeClock())
        plan = _plan("group", [1, 2])
        plan.readers = 3  # three members read this plan, each at its own pace
        pf.add_plan(plan)
        pf._inflight[1] = 3  # as the scheduler does before it starts a fetch
        await pf._fetch([(1, b"p1", 3)], [(plan, 0)])
        for _ in range(3):
            pf.observe(1)  # a member opens it: served from staging
            assert pf.take(1, sig) == b"abc"
        pf.observe(1)
        assert pf.take(1, sig) is None and pf.staged_bytes == 0  # all three had it
        # A file of a plan with one reader is handed over at its first open.
        plan.readers = 1
        pf._inflight[2] = 3
        await pf._fetch([(2, b"p2", 3)], [(plan, 1)])
        pf.observe(2)
        assert pf.take(2, sig) == b"abc" and pf.take(2, sig) is None

    trio.run(run)


# --- every byte fetched once ------------------------------------------------------------------


class _CountingSource:
    """A source of 1000-byte files whose fetches take `delay` seconds and are counted."""

    def __init__(self, delay: float = 0.01) -> None:
        self.delay = delay
        self.fetches: list[bytes] = []
        self.calls = 0  # read_files calls: the prefetcher's batches

    @staticmethod
    def stat(key: int) -> SimpleNamespace:
        return SimpleNamespace(st_size=1000, st_mtime_ns=1, st_ctime_ns=1, st_ino=key)

    async def read_file(self, path: bytes, size: int | None = None):
        self.fetches.append(path)
        await trio.sleep(self.delay)
        return bytes(1000), self.stat(int(path[1:]))

    def read_now(self, path, size=None):  # a source that always makes its caller wait
        return None

    async def read_files(self, items):  # the prefetcher's batches, one file after another
        self.calls += 1
        return [await self.read_file(path, size) for path, size in items], 1e-5


def _cache(source: _CountingSource, window: int = 10_000):
    """A cache over `source`, inside a trio run: its parts keep trio's time, which the
    tests run virtual (a MockClock), as the source's delays are."""
    from shadefs.cache.coordinator import Cache
    from shadefs.prefetch.fetching import PrefetchSettings
    from shadefs.stats import Metrics

    # Room for 8 files (one file may take an eighth of the budget); tests `drop()` them to
    # make a second read a miss.
    return Cache(
        source,  # type: ignore[arg-type]
        Metrics(),
        capacity=8000,
        prefetch=PrefetchSettings(window),
        clock=trio.current_time,
    )


def test_a_reader_and_a_prefetch_of_the_same_file_share_one_fetch() -> None:
    async def run() -> None:
        source = _CountingSource(delay=0.05)
        cache = _cache(source)
        pf = cache.prefetcher
        assert pf is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pf.run)
            pf.add_plan(_plan("a", [2], size=1000))
            await trio.sleep(0.01)  # the prefetcher has started fetching 2
            assert set(pf._inflight) == {2}
            # A reader opens 2 while its prefetch is in flight: it joins that flight.
            data = await cache.open(2, b"p2", source.stat(2))
            assert data == bytes(1000)
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
        assert source.fetches == [b"p2"]
        assert cache.shared_fetches == 1 and cache.fetchlog.refetches == 0
        assert 2 not in pf.staged  # its reader had it: nothing left to stage

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_full_window_refills_in_batches_not_a_fetch_per_read() -> None:
    async def run() -> None:
        source = _CountingSource(delay=0.001)
        cache = _cache(source, window=16_000)  # 16 files staged or in flight at most
        pf = cache.prefetcher
        assert pf is not None
        keys = list(range(1, 201))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pf.run)
            pf.add_plan(_plan("a", keys, size=1000))
            await trio.testing.wait_all_tasks_blocked()
            for key in keys:  # a reader slower than the source: the window stays full
                data = await cache.open(key, b"p%d" % key, source.stat(key))
                assert data == bytes(1000)
                cache.unpin(data)  # (its release)
                await trio.sleep(0.005)  # the reader's pace, in the MockClock's virtual time
            nursery.cancel_scope.cancel()
        assert pf.served >= 190 and sorted(source.fetches) == sorted(b"p%d" % k for k in keys)
        # Each take frees one file's room; the round that refills it waits for an eighth
        # of the window (two files here), so a fetch call brings two files or more.
        assert source.calls <= 110, source.calls

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_prefetcher_skips_what_workers_read_ahead_of_the_cursor() -> None:
    async def run() -> None:
        source = _CountingSource(delay=0.01)
        cache = _cache(source)
        pf = cache.prefetcher
        assert pf is not None
        plan = _plan("a", [1, 2, 3, 4, 5], size=1000)
        pf.add_plan(plan)
        # DataLoader workers read 3 and 5 before anyone read 1: the cursor stays at 0.
        for key in (3, 5):
            await cache.open(key, b"p%d" % key, source.stat(key))
        cache.drop()  # not kept (a small RAM tier): a second fetch would cross the link
        assert plan.cursor == 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pf.run)
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
        # 3 and 5 crossed the link once, for their readers; the prefetcher took 1, 2 and 4.
        assert sorted(source.fetches) == [b"p1", b"p2", b"p3", b"p4", b"p5"]
        assert set(pf.staged) == {1, 2, 4}
        assert cache.fetchlog.refetches == 0

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_refetch_within_an_epoch_is_counted_and_a_new_epoch_forgets() -> None:
    async def run() -> None:
        source = _CountingSource(delay=0)
        cache = _cache(source)
        cache.begin_epoch(0)  # announced: a re-read is a replay within the epoch
        for key in (1, 2, 1):
            await cache.open(key, b"p%d" % key, source.stat(key))
            cache.drop()
        assert cache.fetchlog.refetches == 1 and cache.fetchlog.refetch_bytes == 1000
        cache.begin_epoch(1)
        await cache.open(2, b"p2", source.stat(2))
        stats = cache.describe().fetches
        assert (stats.source_fetches, stats.refetches) == (4, 1)

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_inferred_epoch_forgets_the_fetches_of_the_last() -> None:
    async def run() -> None:
        source = _CountingSource(delay=0)
        cache = _cache(source)
        for key in (1, 2, 3, 1, 2):  # 1 again after all three: the job's next epoch
            await cache.open(key, b"p%d" % key, source.stat(key))
            cache.drop()
        assert cache.fetchlog.refetches == 0 and cache.readers.tracker.epochs_of() == {0: 1}

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_replayed_sample_stays_staged_until_its_last_read_nearby() -> None:
    async def run() -> None:
        source = _CountingSource(delay=0.001)
        cache = _cache(source)
        pf = cache.prefetcher
        assert pf is not None
        pf.add_plan(_plan("a", [1, 2, 1], size=1000))  # sample 1 is replayed
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pf.run)
            await trio.sleep(0.05)
            assert set(pf.staged) == {1, 2}
            for key in (1, 2):
                data = await cache.open(key, b"p%d" % key, source.stat(key))
                assert data is not None
                cache.unpin(data)
                cache.drop()  # a policy that keeps nothing
            assert 1 in pf.staged  # read once, needed again two reads on
            data = await cache.open(1, b"p1", source.stat(1))
            assert data is not None
            nursery.cancel_scope.cancel()
        assert sorted(source.fetches) == [b"p1", b"p2"] and pf.served == 3
        assert 1 not in pf.staged and cache.fetchlog.refetches == 0

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_far_replay_is_held_within_a_quarter_of_the_window() -> None:
    async def run() -> None:
        source = _CountingSource(delay=0.001)
        cache = _cache(source, window=4000)  # four files: the plan's span is 4 reads
        pf = cache.prefetcher
        assert pf is not None
        order = [1, 2, 3, 4, 5, 6, 7, 1, 8]  # 1 comes back 7 reads on
        pf.add_plan(_plan("a", order, size=1000))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pf.run)
            for key in order:
                await trio.sleep(0.02)  # the prefetcher stays ahead
                data = await cache.open(key, b"p%d" % key, source.stat(key))
                assert data is not None
                cache.unpin(data)
                cache.drop()  # a policy that keeps nothing
            nursery.cancel_scope.cancel()
        assert sorted(source.fetches) == sorted(b"p%d" % k for k in set(order))
        assert pf._replay_bytes == 0 and not pf.staged

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_fetch_log_counts_a_refetch_of_each_file_fetched_before_in_its_epoch() -> None:
    from shadefs.cache.fetchlog import FetchLog
    from shadefs.readers.tracker import Tracker

    rng = np.random.default_rng(1)
    tracker = Tracker()
    for key in range(0, 3000, 2):
        tracker.id(key)  # opened files have ids (the column); the others the sorted keys
    log, seen, refetches = FetchLog(tracker), set(), 0  # the log against a set per epoch
    for _ in range(300):
        keys = rng.choice(3000, size=int(rng.integers(1, 40)), replace=False).tolist()
        refetches += len(seen.intersection(keys))
        seen.update(keys)
        if len(keys) > 1:  # a prefetch batch
            log.note_many(keys, [10] * len(keys))
        else:
            log.note(keys[0], 10)
        log.note(-5, 10)  # a block's key: never a refetch
        if rng.random() < 0.02:
            log.new_epoch()
            seen.clear()
        assert all(k in log for k in seen) and not any(k in log for k in range(3000, 3010))
    stats = log.describe()
    assert (stats.refetches, stats.refetch_bytes) == (refetches, 10 * refetches)
    assert refetches > 100


def test_a_plans_unread_keys_are_those_with_a_next_use() -> None:
    rng = np.random.default_rng(2)
    order = rng.integers(0, 300, 400)  # replays: some keys occur several times
    plan = Plan("u", order.astype(np.uint64), [b""] * 400, np.ones(400))
    for key in rng.permutation(order)[:250].tolist():
        plan.observe(int(key), READ_AT)
    keys = np.arange(320, dtype=np.uint64)  # also keys the plan never reads
    want = [plan.next_use(int(k)) != math.inf for k in keys]
    assert plan.unread(keys).tolist() == want and 0 < sum(want) < 300


def test_a_reader_that_joined_a_failed_prefetch_batch_fetches_its_file_alone() -> None:
    class _FailingBatches(_CountingSource):
        healthy = True

        async def read_files(self, items):
            await trio.sleep(self.delay)
            raise pyfuse3.FUSEError(errno.EIO)  # say, another file of the batch failed

    async def run() -> None:
        source = _FailingBatches(delay=0.05)
        cache = _cache(source)
        pf = cache.prefetcher
        assert pf is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pf.run)
            pf.add_plan(_plan("a", [2, 3], size=1000))
            await trio.sleep(0.01)
            assert 2 in cache._flights  # the batch is in flight
            data = await cache.open(2, b"p2", source.stat(2))  # joins it; it fails
            nursery.cancel_scope.cancel()
        assert data == bytes(1000) and source.fetches == [b"p2"]  # then fetched alone
        assert pf.errors == 2

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_replaced_plan_unstages_what_no_plan_reads_but_what_members_still_take() -> None:
    from shadefs.file_version import Signature

    sig = Signature(size=3, mtime_ns=1, ctime_ns=1, ino=1)
    pf = _prefetcher(10_000)
    pf.add_plan(_plan("a", [1, 2, 3, 4]))
    pf.add_plan(_plan("b", [9]))
    for key in (1, 2, 3, 4, 9):
        pf.staged[key] = (b"abc", sig)
        pf.staged_bytes += 3
    pf.holds.hold(4, 2, 0.0)  # a sweep group's member behind the fastest will still open 4
    pf.add_plan(_plan("a", [2, 3]))  # the next version of plan a reads 1 and 4 no more
    assert set(pf.staged) == {2, 3, 4, 9} and pf.wasted == 1 and pf.staged_bytes == 12


def test_a_reader_that_takes_a_prefetch_in_flight_is_served_late() -> None:
    async def run() -> None:
        source = _CountingSource(delay=0.05)
        cache = _cache(source)
        pf = cache.prefetcher
        assert pf is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pf.run)
            pf.add_plan(_plan("a", [2, 3], size=1000))
            await trio.sleep(0.01)
            assert set(pf._inflight) == {2, 3}
            await cache.open(2, b"p2", source.stat(2))  # joins the flight of 2
            await trio.sleep(0.2)
            await cache.open(3, b"p3", source.stat(3))  # staged by then
            nursery.cancel_scope.cancel()
        # Both reads were the prefetch's: one late (its bytes from the flight), one staged.
        assert (pf.fetched, pf.served, pf.late, pf.unused, pf.wasted) == (2, 2, 1, 0, 0)

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_replaced_order_fetches_each_file_once_and_counts_what_landed_unread() -> None:
    async def run() -> None:
        source = _CountingSource(delay=0.05)
        cache = _cache(source)
        pf = cache.prefetcher
        assert pf is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pf.run)
            pf.add_plan(_plan("order:rank=0", [1, 2, 3], size=1000))
            await trio.sleep(0.01)
            assert set(pf._inflight) == {1, 2, 3}
            # The next epoch's order (or a replaced one) while those are in flight: it
            # reads 3 and 1 again, and 4; 2 no more.
            pf.add_plan(_plan("order:rank=0", [3, 4, 1], size=1000))
            await trio.sleep(0.5)
            nursery.cancel_scope.cancel()
        # Nothing crossed the link twice: 3 and 1 landed for the new order and were kept.
        assert sorted(source.fetches) == [b"p1", b"p2", b"p3", b"p4"]
        assert set(pf.staged) == {1, 3, 4}
        assert (pf.fetched, pf.unused, pf.wasted) == (4, 1, 0)

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
