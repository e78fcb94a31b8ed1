"""Speculative prefetch: stage what a job with no announced order has not read this epoch.

A plain shuffled DataLoader tells the daemon nothing of its order, but within an epoch each
file not yet read will be read exactly once (the readers' tracker, readers/tracker.py,
knows per job its universe, its epoch and what it read of it). So
the unread files of a job's epoch not in RAM are a prefetch target that the epoch never
wastes (an SSD tier's entries among them are staged from the SSD in batches: after a drop of
the page cache, a hit read from disk alone costs a thread hop on the event loop). The
speculator turns them into a *speculative plan* for the prefetcher (prefetch/prefetcher.py):
the unread files in a random order. The prefetcher stages them in its
staging buffer, within its window and at its adaptive concurrency, exactly as for a known
order; a reader that opens a staged file takes it from there, and one that opens a file
being fetched joins the flight.

With cache fraction f and window w (both shares of the data), the share of misses served
from staging is (w + w ln((1 - f) / w)) / (1 - f): 0.60 at f = w = 0.2.

Rules that keep it from ever slowing a job down:

- a file the job read this epoch is never staged: a plan is made of the tracker's unread
  files, and an entry counts as consumed as soon as the tracker has its job's open (the
  plan holds its tracker ids and asks the job's `last` column: `consumed`, `unread`), so
  the prefetcher skips consumed entries and stages only what some plan still reads. The
  job's logged opens, taken in every PERIOD (`sync`), move the plan's cursor and rate.
  So the prefetcher never calls the speculator, and a finished fetch never re-enters a
  planner;
- a job gets a plan only once it has opened `EVIDENCE` files, and only while one of its
  processes still runs (readers/jobs.py `running`): one open is no sign of an epoch, and a
  job whose processes all exited reads nothing more. A shell loop that `cat`s each file
  is one job per `cat` (jobs.py), each of which opens one file and exits: a plan for each
  would stage, for jobs that are over, the files the other `cat`s read next, and what
  left RAM again, fetching each file more than once;
- the plan is dropped when the job's processes have all exited, when its reads stop
  (`idle` seconds without one), while the tracker finds its epoch pattern broken (a file
  read twice before the epoch was complete), when the job announces its epochs (a
  sampler: its orders are known), when the job ends, and while any known order (a
  sampler's or a `.shadefs/plan`) is being prefetched: a job that announces its order
  gets the clairvoyant prefetcher alone;
- the window bounds what is staged or in flight, as for every plan;
- a file larger than the RAM tier caches whole (`--max-entry`) is never planned: its
  reader reads it in blocks or through, or whole from the SSD tier, not from staging;
- while most deferred opens are served by the kernel's own pages (kernel/pages.py),
  a file the kernel may hold is not planned.

A new epoch of the job (the tracker's) replaces the plan by a fresh one over the new
epoch's unread files. Also in the first, cold epoch: the universe is then the directories
the job has read from so far, so staging starts after its first reads. The speculator
infers nothing itself: epochs, universes and unread files are the tracker's.

A plan over a large universe (ImageNet: 1.28 M files) takes a sort and a set test over every
unread file, 0.1-0.3 s: while `run` serves, it is built in a worker thread (`_build_plan`)
over a snapshot (the unread ids, the tracker's columns, whose entries for those ids do not
change, and a list of the keys in RAM), at most one per job at a time. Its result is
installed only if still current: the same job in the row, no epoch begun since, no known
order started, and the reads taken in meanwhile are consumed from it first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import trio

from shadefs.kernel.pages import KernelPages
from shadefs.prefetch.plans import speculative_name
from shadefs.prefetch.prefetcher import Prefetcher
from shadefs.prefetch.spec_plans import JobEpoch, Paths, SpecPlan
from shadefs.readers.part import Readers
from shadefs.readers.tracker import Listing
from shadefs.sampling.builds import resident_among


class Cache(Protocol):
    """What speculation reads of the cache (cache/coordinator.py's Cache): the prefetch part
    never imports the coordinator (tests/test_structure.py)."""

    @property
    def prefetcher(self) -> Prefetcher | None: ...
    @property
    def readers(self) -> Readers: ...
    @property
    def ram_max(self) -> int: ...
    @property
    def handle_limit(self) -> int: ...
    def cached_keys(self, ram: bool = True, ssd: bool = True) -> list[int]: ...


log = logging.getLogger(__name__)

PERIOD = 0.05  # seconds between takes of the jobs' reads
IDLE = 1.0  # seconds without a read after which a job's plan is dropped
REPLAN = 0.25  # seconds between rebuilds of a plan whose universe grew
EVIDENCE = 2  # opens a job makes before it gets a plan (module doc)
# Universe sizes above which `run` builds a plan in a worker thread (a smaller one costs
# less than the thread hop, ~0.1 ms).
OFFLOAD_ABOVE = 1 << 16


class _Snapshot(NamedTuple):
    """What a plan is built from: a job's unread files and the tracker's columns, and what
    to leave out."""

    name: str
    keys: np.ndarray  # the tracker's columns (regrowth replaces them; set ids never change)
    sizes: np.ndarray
    where: np.ndarray
    listings: list[Listing]  # the tracker's, only ever appended to
    unread: np.ndarray  # the unread ids
    limit: int  # the largest file worth staging
    cached: list[int]  # the keys in RAM
    ssd: list[int]  # the keys on the SSD (with `kernel` only)
    seed: int
    job: JobEpoch  # whose reads consume the plan (SpecPlan's)
    # Files the kernel may hold pages of are left out (a wrong guess read from the loop's
    # live map only stages a file more or less, never serves anything).
    kernel: KernelPages | None


def _build_plan(snap: _Snapshot) -> SpecPlan | None:
    """A plan over the unread ids of `snap` that are at most `limit` bytes and not in RAM,
    in a random order; None when none is left. It reads only `snap`, so it may run in a
    worker thread."""
    keys, sizes, where, index = snap.keys, snap.sizes, snap.where, snap.unread
    index = index[sizes[index] <= snap.limit]
    ukeys = keys[index].astype(np.uint64)
    if len(index):
        keep = ~resident_among(ukeys, snap.cached, distinct=True)  # (distinct ids' keys)
        index, ukeys = index[keep], ukeys[keep]
    if len(index) and snap.kernel is not None:
        # An SSD entry is staged all the same: an open reads it whether or not the kernel
        # holds its pages (an SSD hit is never deferred), so staging it reads no more.
        keep = ~snap.kernel.may_hold(ukeys) | resident_among(ukeys, snap.ssd, distinct=True)
        index, ukeys = index[keep], ukeys[keep]
    if not len(index):
        return None
    order = np.random.default_rng(snap.seed).permutation(len(index))
    index, ukeys = index[order], ukeys[order]
    paths = Paths(snap.listings, where[index])
    return SpecPlan(snap.name, ukeys, paths, sizes[index], index, snap.job)


@dataclass
class _Build:
    """A plan being built off the loop for one job: what makes its result current."""

    owner: str  # the id of the job it is for (a row is reused once its job ends)
    epoch: int  # the job's epoch when it began
    caught: list[np.ndarray] = field(default_factory=list)  # reads taken in since


class Speculator:
    """Keeps a speculative plan per job over the tracker's unread files of its epoch."""

    def __init__(
        self,
        cache: Cache,
        kernel: KernelPages,
        *,
        enabled: bool = True,
        idle: float = IDLE,
        seed: int | None = None,
        offload_above: int = OFFLOAD_ABOVE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock  # (the prefetcher's: plans' pace and jobs' idleness)
        self.cache = cache
        self.kernel = kernel  # which files the kernel may hold pages of (the service's)
        self.tracker = cache.readers.tracker
        self.enabled = enabled and cache.prefetcher is not None
        self.idle = idle
        self.rng = np.random.default_rng(seed)
        self.plans: dict[int, SpecPlan] = {}
        self._owner: dict[int, str] = {}  # job row -> the id of the job it served
        self._last_read: dict[int, float] = {}
        self._planned: dict[int, tuple[int, int, float]] = {}  # row -> (epoch, universe, t)
        self._spent: set[int] = set()  # rows with nothing left to stage until they grow
        self._opens: dict[int, int] = {}  # row -> the opens taken in from its job
        self._exited: set[int] = set()  # rows whose processes had all exited (until it reads)
        self.plans_made = 0
        self.offload_above = offload_above
        self._nursery: trio.Nursery | None = None  # while `run` runs: builds go off the loop
        self._building: dict[int, _Build] = {}  # job row -> its plan in the making
        self._trusted = True  # the kernel pages' share when the plans were made

    async def run(self) -> None:
        """Take the reads in and keep the plans, until cancelled (unmount)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                while True:
                    await trio.sleep(PERIOD)
                    self.sync()
                    self.tend(self._clock())
        finally:
            self._nursery = None
            self._building.clear()

    def sync(self) -> None:
        """Take in every job's logged opens: they consume its plan's entries. It plans
        nothing (`tend` does, also for a job whose epoch moved)."""
        now = self._clock()
        self.tracker.settle()
        jobs = self.cache.readers.jobs.jobs
        for row in [r for r, o in self._owner.items() if r not in jobs or jobs[r].id != o]:
            self._forget(row)  # the job ended (its row may already serve another)
        for row, job in jobs.items():
            if not job.reads:
                continue
            keys = np.frombuffer(job.reads, dtype=np.uint64).copy()
            del job.reads[:]
            self._owner[row] = job.id
            self._last_read[row] = now
            self._opens[row] = self._opens.get(row, 0) + len(keys)
            self._exited.discard(row)  # asked again (a job's reads may be taken late)
            building = self._building.get(row)
            if building is not None:
                building.caught.append(keys)  # consumed from its plan once it lands
            plan = self.plans.get(row)
            if plan is not None and self._planned[row][0] == self.tracker.epoch[row]:
                plan.consume(keys, now)

    def tend(self, now: float) -> None:
        """Drop the plans that must stop; make or rebuild those that should run."""
        pf = self.cache.prefetcher
        if not self.enabled or pf is None:
            return
        t = self.tracker
        known = any(not p.speculative for p in pf.plans.values())
        flipped = self.kernel.trusted != self._trusted
        jobs = self.cache.readers.jobs
        for row in self._owner:
            plan = self.plans.get(row)
            # A job that announces its epochs has a sampler whose orders the daemon knows
            # (or will): the clairvoyant prefetcher's, even between two of its orders.
            idle = now - self._last_read.get(row, 0.0) > self.idle
            if known or t.explicit[row] or t.broken[row] or idle or row in self._exited:
                self._drop(row)
                continue
            if self._opens.get(row, 0) < EVIDENCE:
                continue  # no plan yet: one open says nothing of an epoch
            # Asked of the jobs with a plan and of those about to get one; a job found
            # exited is not asked again until it reads (a /proc read per job, not per tick).
            if not jobs.running(row):
                self._exited.add(row)
                self._drop(row)
                continue
            if plan is not None and plan.name not in pf.plans:
                # The prefetcher ended it (all of it read, or abandoned): start afresh.
                del self.plans[row]
                plan = None
            if row in self._building:
                continue  # one plan in the making per job; it is checked when it lands
            epoch, size, at = self._planned.get(row, (-1, -1, 0.0))
            grown = t.size[row] != size
            renew = epoch != t.epoch[row]  # a fresh plan over the new epoch's unread files
            if grown or renew or flipped:  # (flipped: the kernel's pages (stopped) serving)
                self._spent.discard(row)
            stale = (grown and now - at >= REPLAN) or flipped
            if (plan is None and row not in self._spent) or stale or (renew and plan):
                self._plan(row, now)

    def _plan(self, row: int, now: float) -> None:
        """Make `row`'s plan over its unread files: at once for a small universe, else in a
        worker thread (while `run` serves), installed only if still current."""
        t, cache = self.tracker, self.cache
        self._planned[row] = (t.epoch[row], t.size[row], now)
        # Only what an open would take from staging and the RAM tier could keep: a file
        # above that is read in blocks (a block at a time, to RAM or SSD), through, or
        # whole while open handles leave room; a staged copy of it is mostly fetched
        # twice (and never taken when its blocks are on the SSD already).
        limit = min(cache.ram_max, cache.handle_limit)
        owner = self._owner[row]
        kernel = self.kernel
        self._trusted = kernel.trusted
        held = kernel if self._trusted else None  # the kernel serves what it holds
        unread = t.unread(row)
        snap = _Snapshot(
            speculative_name(owner), t.keys, t.sizes, t.where, t.listings, unread, limit,
            cache.cached_keys(ssd=False), cache.cached_keys(ram=False) if held else [],
            int(self.rng.integers(1 << 62)), JobEpoch(t, row, t.epoch[row]), held,
        )  # fmt: skip
        if self._nursery is None or t.size[row] <= self.offload_above:
            self._install(row, _build_plan(snap))
            return
        building = self._building[row] = _Build(owner, t.epoch[row])
        self._nursery.start_soon(self._build_off_loop, row, building, snap)

    async def _build_off_loop(self, row: int, building: _Build, snap: _Snapshot) -> None:
        try:
            plan = await trio.to_thread.run_sync(_build_plan, snap)
        finally:
            if self._building.get(row) is building:
                del self._building[row]
        t, now = self.tracker, self._clock()
        if self._owner.get(row) != building.owner or t.epoch[row] != building.epoch:
            # `tend` plans the new epoch (or the row's new job) afresh.
            log.debug("job row %d: a plan built for an older epoch is dropped", row)
            return
        pf = self.cache.prefetcher
        known = pf is None or any(not p.speculative for p in pf.plans.values())
        if known or t.broken[row] or t.explicit[row]:
            return  # it must not run now: `tend` plans again when it may
        if plan is not None:
            for keys in building.caught:
                plan.consume(keys, now)  # the job's reads while it was built
        self._install(row, plan)

    def _install(self, row: int, plan: SpecPlan | None) -> None:
        pf = self.cache.prefetcher
        assert pf is not None
        if plan is None:
            self._drop(row)
            self._spent.add(row)
            return
        old = self.plans.get(row)
        if old is not None:
            plan.rate = old.rate  # the job's pace carries over a rebuild
        self.plans[row] = plan
        pf.add_plan(plan)
        self.plans_made += 1

    def _drop(self, row: int) -> None:
        plan = self.plans.pop(row, None)
        pf = self.cache.prefetcher
        if plan is not None and pf is not None and pf.plans.get(plan.name) is plan:
            pf.drop_plan(plan.name)

    def _forget(self, row: int) -> None:
        self._drop(row)
        self._owner.pop(row, None)
        self._last_read.pop(row, None)
        self._planned.pop(row, None)
        self._spent.discard(row)
        self._opens.pop(row, None)
        self._exited.discard(row)
