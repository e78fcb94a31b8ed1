"""Speculative plans built off the event loop: one per job at a time, installed only if current,
and plans that count their job's latest reads without the prefetcher calling the speculator."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import trio
import trio.testing

from shadefs.prefetch import speculate
from shadefs.prefetch.spec_plans import SpecPlan
from shadefs.prefetch.speculate import PERIOD, Speculator
from shadefs.readers.tracker import Tracker
from tests.conftest import FakeClock
from tests.test_prefetch import _CountingSource
from tests.test_speculate import SIZE, FakeListing, _cache, _listings, _read


def _gated(monkeypatch: pytest.MonkeyPatch, gates: list[threading.Event]) -> list[object]:
    """Make the n-th plan build (in its worker thread) wait for gates[n]; returns the builds
    started so far."""
    started: list[object] = []
    build = speculate._build_plan

    def slow(snap: speculate._Snapshot) -> SpecPlan | None:
        gate = gates[len(started)]
        started.append(snap)
        gate.wait(10)  # until the event loop has done what the test does meanwhile
        return build(snap)

    monkeypatch.setattr(speculate, "_build_plan", slow)
    return started


async def _until(done: object) -> None:
    while not callable(done) or not done():
        await trio.sleep(PERIOD)


def test_an_off_loop_plan_of_an_older_epoch_is_dropped_and_one_build_runs_per_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gates = [threading.Event(), threading.Event()]
    started = _gated(monkeypatch, gates)

    async def run() -> None:
        source = _CountingSource(delay=0.001)
        files, more = FakeListing(b"d", list(range(1, 21))), FakeListing(b"e", [21, 22])
        clock = FakeClock()  # (the parts' time stands: a real thread builds the plans)
        cache = _cache(source, _listings(files, more), 100 * SIZE, clock)
        spec = Speculator(cache, cache.handles.kernel, seed=0, offload_above=0, clock=clock)
        await _read(cache, source, 1)  # cached: never planned
        readers = cache.readers
        for key in (2, 3):  # read, not cached
            readers.read(key, 0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(spec.run)
            await _until(lambda: len(started) == 1)
            # The universe grows while the plan is built (directory e joins): no second
            # build starts.
            readers.read(21, 0)
            for _ in range(10):
                await trio.sleep(speculate.REPLAN)
            assert spec.tracker.size[0] == 22
            assert len(started) == 1 and not spec.plans
            # Meanwhile the job ends its epoch and begins the next one with 5.
            for key in [*range(4, 21), 22, 5]:
                readers.read(key, 0)
            await trio.sleep(PERIOD * 2)
            assert spec.tracker.epoch[0] == 1
            gates[0].set()  # the first build lands: of the older epoch, it is dropped
            await _until(lambda: len(started) == 2)
            assert not spec.plans and spec.plans_made == 0
            readers.read(6, 0)  # read while the new epoch's plan is built
            await trio.sleep(PERIOD * 2)
            gates[1].set()
            await _until(lambda: 0 in spec.plans)
            nursery.cancel_scope.cancel()
        plan = spec.plans[0]
        assert spec.plans_made == 1
        # The new epoch's unread, uncached files; 6, read during the build, is consumed.
        assert set(plan.keys.tolist()) == set(range(2, 23)) - {5}
        assert plan.reads == 1 and plan.next_use(6) == math.inf
        assert cache.prefetcher is not None and cache.prefetcher.plans[plan.name] is plan

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_off_loop_plan_is_not_installed_once_a_known_order_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gates = [threading.Event()]
    started = _gated(monkeypatch, gates)

    async def run() -> None:
        source = _CountingSource(delay=0.001)
        clock = FakeClock()  # (the parts' time stands: a real thread builds the plan)
        listing_of = _listings(FakeListing(b"d", list(range(1, 21))))
        cache = _cache(source, listing_of, 100 * SIZE, clock)
        spec = Speculator(cache, cache.handles.kernel, offload_above=0, clock=clock)
        pf = cache.prefetcher
        assert pf is not None
        for key in (1, 2):  # (a plan comes after two opens: speculate.EVIDENCE)
            await _read(cache, source, key)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(spec.run)
            await _until(lambda: len(started) == 1)
            known = SpecPlan("sampler", np.array([3], np.uint64), [b"p3"], np.array([SIZE]))
            known.speculative = False  # a sampler's order
            pf.add_plan(known)
            gates[0].set()
            await _until(lambda: not spec._building)
            await trio.sleep(PERIOD * 2)
            nursery.cancel_scope.cancel()
        assert not spec.plans and list(pf.plans) == ["sampler"]

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_speculative_plan_counts_its_jobs_reads_not_taken_in_yet() -> None:
    t = Tracker()
    for key in (1, 2, 3):
        t.id(key)
    t.join(0)
    t.join(1)
    keys = np.array([1, 2, 3], dtype=np.uint64)
    plan = SpecPlan.over("s", t, np.array([0, 1, 2]), row=0)
    assert plan.unread(keys).all()
    assert not plan.consumed(1) and plan.next_use(2) == 1.0
    t.read(2, 1)  # another job's open of 2 consumes nothing of job 0's plan
    assert not plan.consumed(1) and plan.unread(keys).all()
    t.read(2, 0)  # job 0 opened 2; the speculator has not synced yet
    assert plan.consumed(1) and plan.next_use(2) == math.inf
    assert plan.unread(keys).tolist() == [True, False, True]
    assert not plan.consumed(0) and plan.next_use(1) == 0.0


def test_a_remade_plan_leads_with_what_is_staged_and_the_prefetcher_starts_past_it() -> None:
    from shadefs.file_version import Signature
    from shadefs.prefetch.spec_plans import JobEpoch
    from tests.test_prefetch import _prefetcher

    t = Tracker()
    keys = [4, 9, 1, 7, 3, 10, 2, 8, 6, 5]  # a speculative plan's random order
    ids = np.array([t.id(k) for k in keys])
    t.join(0)
    plan = SpecPlan("s", np.array(keys, np.uint64), [b"p%d" % k for k in keys],
                    np.full(10, SIZE), ids, JobEpoch(t, 0, 0))  # fmt: skip
    plan.consume(np.array([4], np.uint64), 0.0)  # read and taken in: the cursor moves
    t.read(10, 0)  # read, not taken in yet
    pf = _prefetcher(100 * SIZE)
    sig = Signature(size=SIZE, mtime_ns=1, ctime_ns=1, ino=1)
    for key in (7, 10, 5):
        pf.staged[key] = (b"x" * SIZE, sig)
        pf.staged_bytes += SIZE
    pf._inflight[1] = pf._inflight[7] = SIZE  # (7 also staged: a hold of a file in flight)
    pf.add_plan(plan)
    # Staged or in flight first, each part in the plan's order; the frontier past them.
    assert plan.keys.tolist() == [1, 7, 10, 5, 4, 9, 3, 2, 8, 6] and plan.frontier == 4
    assert list(plan.paths) == [b"p%d" % k for k in plan.keys.tolist()]
    assert set(pf.staged) == {7, 5}  # (10, read meanwhile, unstaged as before)
    # What was read follows its entry: 4 consumed, 10 read by id; the cursor is the first
    # position not read.
    assert [plan.consumed(i) for i in range(10)] == [k in (4, 10) for k in plan.keys.tolist()]
    assert plan.cursor == 0 and plan.next_use(9) == 5.0 and plan.next_use(4) == math.inf
    assert plan.unread(np.array([4, 10, 6], np.uint64)).tolist() == [False, False, True]
    plan.consume(np.array([1, 7], np.uint64), 0.0)
    assert plan.cursor == 2
    # The next fetch is of the unstaged, unread rest, in order.
    fetched: list[int] = []
    while batch := pf._next_batch()[0]:
        fetched += [k for k, _, _ in batch]
    assert fetched == [9, 3, 2, 8, 6]


def test_a_known_order_keeps_its_order_when_staged_files_are_in_it() -> None:
    from shadefs.file_version import Signature
    from tests.test_prefetch import _plan, _prefetcher

    pf = _prefetcher(100 * SIZE)
    pf.staged[3] = (b"x", Signature(size=1, mtime_ns=1, ctime_ns=1, ino=1))
    plan = _plan("sampler", [1, 2, 3, 4])
    pf.add_plan(plan)
    assert plan.keys.tolist() == [1, 2, 3, 4] and plan.frontier == 0
    known = SpecPlan("known", np.array([1, 2, 3], np.uint64), [b"1", b"2", b"3"], np.ones(3))
    known.speculative = False  # a sampler's order built as a SpecPlan
    pf.add_plan(known)
    assert known.keys.tolist() == [1, 2, 3] and known.frontier == 0


@pytest.mark.parametrize("dense", [True, False])
def test_resident_among_distinct_keys_matches_the_general_test(dense: bool) -> None:
    """A plan's keys are distinct, so the test skips deduplicating; the cached list may
    still hold a key twice (in RAM and on the SSD) and block keys (< 0)."""
    from shadefs.sampling.builds import resident_among

    rng = np.random.default_rng(int(dense))
    top = 3000 if dense else 1 << 50  # (numpy tests a dense range by table, else by sort)
    for _ in range(100):
        keys = rng.choice(top, size=int(rng.integers(1, 400)), replace=False).astype(np.uint64)
        cached = rng.integers(0, top, size=int(rng.integers(0, 500))).tolist()
        cached += [*cached[: len(cached) // 3], *keys[:5].tolist(), -5, -7]
        want = np.array([k in set(cached) for k in keys.tolist()])
        assert (resident_among(keys, cached, distinct=True) == want).all()
        assert (resident_among(keys, cached) == want).all()
