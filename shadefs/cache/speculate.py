"""Speculative prefetch: stage what a job with no announced order has not read this epoch.

A plain shuffled DataLoader tells the daemon nothing of its order, but within an epoch each
file not yet read will be read exactly once (sampling/epochs.py tracks that per job). So
the unread, uncached files of a job's epoch are a prefetch target that the epoch never
wastes. The speculator turns them into a *speculative plan* for the prefetcher
(cache/prefetch.py): the unread files in a random order. The prefetcher stages them in its
staging buffer, within its window and at its adaptive concurrency, exactly as for a known
order; a reader that opens a staged file takes it from there, and one that opens a file
being fetched joins the flight.

With cache fraction f and window w (both shares of the data), the share of misses served
from staging is (w + w ln((1 - f) / w)) / (1 - f): 0.60 at f = w = 0.2.

Rules that keep it from ever slowing a job down:

- a file the job read this epoch is never staged: the plan's entries are marked consumed as
  the job's reads are taken in (`sync`), the plan also counts the reads its job logged
  since (it holds the job's read log: `consumed`, `next_use`), and the prefetcher skips
  consumed entries and stages only what some plan still reads. So the prefetcher never
  calls the speculator, and a finished fetch never re-enters a planner;
- the plan is dropped when the job's reads stop (`idle` seconds without one), when its
  epoch pattern breaks (a file read twice before the epoch was complete), when the job ends,
  and while any known order (a sampler's or a `.shadefs/plan`) is being prefetched: a job
  that announces its order gets the clairvoyant prefetcher alone;
- the window bounds what is staged or in flight, as for every plan;
- a file larger than the RAM tier caches whole (`--max-entry`) is never planned: its
  reader reads it in blocks or through, or whole from the SSD tier, not from staging.

A new epoch (the job has read NEW_EPOCH of its files and reads one again) replaces the plan
by a fresh one over the new epoch's unread files, and tells the cache's fetch log that an
epoch began (cache/fetchlog.py). Also in the first, cold epoch: the universe is then the
directories the job has read from so far, so staging starts after its first reads.

A plan over a large universe (ImageNet: 1.28 M files) takes a sort and a set test over every
unread file, 0.1-0.3 s: while `run` serves, it is built in a worker thread (`_build_plan`)
over snapshots (the unread indexes, the universe's arrays, which a growing universe replaces
rather than mutates, and a list of the cached keys), at most one per job at a time. Its
result is installed only if still current: the same job's track, no epoch begun since, no
known order started, and the reads taken in meanwhile are consumed from it first.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, overload

import numpy as np
import trio

from shadefs.cache.fetchlog import FetchLog
from shadefs.cache.handles import HandleLedger
from shadefs.cache.kernel_pages import KernelPages
from shadefs.cache.plans import Plan
from shadefs.cache.prefetch import Prefetcher
from shadefs.sampling.builds import resident_among
from shadefs.sampling.epochs import JobReads, Listing, ListingOf
from shadefs.sampling.jobs import Job, JobTable


class Cache(Protocol):
    """What speculation reads of the cache (cache/coordinator.py's Cache): the prefetch part
    never imports the coordinator (tests/test_structure.py)."""

    @property
    def prefetcher(self) -> Prefetcher | None: ...
    @property
    def fetchlog(self) -> FetchLog: ...
    @property
    def jobs(self) -> JobTable: ...
    @property
    def handles(self) -> HandleLedger: ...
    @property
    def ram_max(self) -> int: ...
    @property
    def handle_limit(self) -> int: ...
    def cached_keys(self) -> list[int]: ...


log = logging.getLogger(__name__)

PERIOD = 0.05  # seconds between takes of the jobs' reads
IDLE = 1.0  # seconds without a read after which a job's plan is dropped
REPLAN = 0.25  # seconds between rebuilds of a plan whose universe grew
# Universe sizes above which `run` builds a plan in a worker thread (a smaller one costs
# less than the thread hop, ~0.1 ms).
OFFLOAD_ABOVE = 1 << 16


class _Paths(Sequence[bytes]):
    """A plan's paths, built on demand from the job's listings (no list of paths).

    It keeps the (listing, row) of each entry as the plan was made: the job's universe is
    re-sorted when it grows, so indexes into it would go stale.
    """

    def __init__(self, listings: list[Listing], where: np.ndarray) -> None:
        self._listings = listings  # only ever appended to
        self._where = where

    def __len__(self) -> int:
        return len(self._where)

    @overload
    def __getitem__(self, i: int) -> bytes: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[bytes]: ...
    def __getitem__(self, i: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(i, slice):
            return _Paths(self._listings, self._where[i])
        w = int(self._where[i])
        return self._listings[w >> 32].child_path(w & 0xFFFFFFFF)

    def __iter__(self) -> Iterator[bytes]:
        return (self[i] for i in range(len(self)))


class SpecPlan(Plan):
    """A speculative plan: its entries are consumed by the job's reads, in any order."""

    speculative = True

    def __init__(
        self,
        name: str,
        keys: np.ndarray,
        paths: Sequence[bytes],
        sizes: np.ndarray,
        unseen: Sequence[int] = (),
    ) -> None:
        """`unseen`: the job's log of reads not taken in yet (sampling/jobs.py's Job.reads,
        which `Speculator.sync` empties): they count as read before `consume` sees them."""
        super().__init__(name, keys, paths, sizes)
        self.unseen = unseen

    @classmethod
    def over(cls, name: str, reads: JobReads, index: np.ndarray) -> SpecPlan:
        """The plan of universe entries `index` of `reads`, in that order."""
        paths = _Paths(list(reads.listings), reads.where[index])
        return cls(name, reads.keys[index], paths, reads.sizes[index])

    def consumed(self, pos: int) -> bool:
        # A scan of the reads logged since the last sync: at most PERIOD's worth.
        return bool(self._consumed[pos]) or int(self.keys[pos]) in self.unseen

    def next_use(self, key: int) -> float:
        return math.inf if key in self.unseen else super().next_use(key)

    def observe(self, key: int, now: float) -> bool:
        return False  # `consume` takes the job's reads in batches instead

    def consume(self, keys: np.ndarray, now: float) -> int:
        """Mark the entries of `keys` read; returns how many were unread plan entries."""
        if not len(keys) or not len(self.keys):
            return 0
        pos = np.searchsorted(self._sorted, keys)
        pos[pos >= len(self._sorted)] = 0
        pos = self._positions[pos[self._sorted[pos] == keys]]
        pos = pos[~self._consumed[pos]]
        n = len(pos)
        if not n:
            return 0
        self._consumed[pos] = True
        rest = self._consumed[self.cursor :]
        self.cursor += int(np.argmin(rest)) if not rest.all() else len(rest)
        self.reads += n
        dt = now - self._rate_since
        if dt >= 0.2:
            inst = (self.reads - self._rate_reads) / dt
            first = self._rate_reads == 0
            self.rate = inst if first else 0.7 * self.rate + 0.3 * inst
            self._rate_since, self._rate_reads = now, self.reads
        self.last_progress = now
        return n

    _rate_reads = 0


class _Snapshot(NamedTuple):
    """What a plan is built from: a job's universe as it was, and what to leave out."""

    name: str
    keys: np.ndarray  # the universe's arrays (a growing universe replaces, never mutates them)
    sizes: np.ndarray
    where: np.ndarray
    listings: list[Listing]
    unread: np.ndarray  # the unread entries
    limit: int  # the largest file worth staging
    cached: list[int]  # every cached key (blocks' negative ones too)
    seed: int
    unseen: Sequence[int]  # the job's read log (SpecPlan's)
    # Files the kernel may hold pages of are left out (a wrong guess read from the loop's
    # live map only stages a file more or less, never serves anything).
    kernel: KernelPages | None

    @classmethod
    def of(
        cls,
        name: str,
        reads: JobReads,
        limit: int,
        cached: list[int],
        seed: int,
        log: Job,
        kernel: KernelPages | None,
    ) -> _Snapshot:
        return cls(
            name, reads.keys, reads.sizes, reads.where, list(reads.listings),
            reads.unread(), limit, cached, seed, log.reads, kernel,
        )  # fmt: skip


def _build_plan(snap: _Snapshot) -> SpecPlan | None:
    """A plan over the unread universe entries of `snap` that are at most `limit` bytes and
    not cached, in a random order; None when none is left. It reads only `snap`, so it may
    run in a worker thread."""
    keys, sizes, where, index = snap.keys, snap.sizes, snap.where, snap.unread
    limit, cached, listings = snap.limit, snap.cached, snap.listings
    index = index[sizes[index] <= limit]
    if len(index):
        index = index[~resident_among(keys[index], cached)]
    if len(index) and snap.kernel is not None:
        index = index[~snap.kernel.may_hold(keys[index])]
    if not len(index):
        return None
    index = np.random.default_rng(snap.seed).permutation(index)
    paths = _Paths(listings, where[index])
    return SpecPlan(snap.name, keys[index], paths, sizes[index], snap.unseen)


@dataclass
class _Build:
    """A plan being built off the loop for one job: what makes its result current."""

    track: JobReads
    epochs: int  # the track's epochs when it began
    caught: list[np.ndarray] = field(default_factory=list)  # reads taken in since


class Speculator:
    """Takes in every job's reads, tracks its epochs, and keeps its speculative plan."""

    def __init__(
        self,
        cache: Cache,
        listing_of: ListingOf,
        *,
        enabled: bool = True,
        idle: float = IDLE,
        seed: int | None = None,
        offload_above: int = OFFLOAD_ABOVE,
    ) -> None:
        self.cache = cache
        self.listing_of = listing_of
        self.enabled = enabled and cache.prefetcher is not None
        self.idle = idle
        self.rng = np.random.default_rng(seed)
        self.tracks: dict[int, JobReads] = {}  # job row -> its reads
        self.plans: dict[int, SpecPlan] = {}
        self._last_read: dict[int, float] = {}
        self._last_key: dict[int, int] = {}  # the key of each job's latest open
        self._planned_at: dict[int, float] = {}
        self._spent: set[int] = set()  # rows with nothing left to stage until they grow
        self.plans_made = 0
        self.offload_above = offload_above
        self._nursery: trio.Nursery | None = None  # while `run` runs: builds go off the loop
        self._building: dict[int, _Build] = {}  # job row -> its plan in the making
        self._renew: set[int] = set()  # rows whose new epoch wants a fresh plan (`tend`)
        self._trusted = True  # the kernel pages' share when the plans were made
        cache.fetchlog.sync = self.sync

    async def run(self) -> None:
        """Take the reads in and keep the plans, until cancelled (unmount)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                while True:
                    await trio.sleep(PERIOD)
                    self.sync()
                    self.tend(time.monotonic())
        finally:
            self._nursery = None
            self._building.clear()

    def sync(self) -> None:
        """Take in every job's logged reads. It plans nothing (`tend` does): the fetch log
        calls it on a refetch, and a finished fetch must not re-enter the planning."""
        now = time.monotonic()
        jobs = self.cache.jobs.jobs
        for row in [r for r, t in self.tracks.items() if r not in jobs or jobs[r].id != t.job]:
            self._forget(row)  # the job ended (its row may already serve another)
        for row, job in jobs.items():
            if not job.reads:
                continue
            keys = np.frombuffer(job.reads, dtype=np.uint64).copy()
            del job.reads[:]
            track = self.tracks.get(row)
            if track is None:
                track = self.tracks[row] = JobReads()
                track.job = job.id
            self._last_read[row] = now
            keys = self._reopens_dropped(row, keys)
            if not len(keys):
                continue
            began = track.absorb(keys, self.listing_of)
            building = self._building.get(row)
            if building is not None:
                building.caught.append(keys)  # consumed from its plan once it lands
            if began:
                self.cache.fetchlog.new_epoch()
                log.debug("job %s: epoch %d begins", job.id, track.epochs)
                self._spent.discard(row)
                # A fresh plan over the new epoch's unread files (`tend`); what is staged
                # stays (it is unread in this epoch too).
                self._renew.add(row)
            plan = self.plans.get(row)
            if plan is not None:
                plan.consume(keys, now)

    def _reopens_dropped(self, row: int, keys: np.ndarray) -> np.ndarray:
        """`keys` without the opens that repeat the job's previous one: a reader that opens
        a file again at once (Parquet reads the footer, closes and reopens) reads it once,
        and taking the reopen for a second read would break the epoch's pattern."""
        keep = np.ones(len(keys), dtype=bool)
        keep[1:] = keys[1:] != keys[:-1]
        keep[0] = int(keys[0]) != self._last_key.get(row, -1)
        self._last_key[row] = int(keys[-1])
        return keys[keep]

    def tend(self, now: float) -> None:
        """Drop the plans that must stop; make or rebuild those that should run."""
        pf = self.cache.prefetcher
        if not self.enabled or pf is None:
            return
        known = any(not p.speculative for p in pf.plans.values())
        flipped = self.cache.handles.kernel.trusted != self._trusted
        for row, track in self.tracks.items():
            plan = self.plans.get(row)
            if known or track.paused or now - self._last_read.get(row, 0.0) > self.idle:
                self._drop(row)
                continue
            if plan is not None and plan.name not in pf.plans:
                # The prefetcher ended it (all of it read, or abandoned): start afresh.
                del self.plans[row]
                plan = None
            if row in self._building:
                continue  # one plan in the making per job; it is checked when it lands
            if track.grown:
                self._spent.discard(row)
            stale = track.grown and now - self._planned_at.get(row, 0.0) >= REPLAN
            renew = row in self._renew
            if flipped:  # the kernel's pages turned out (not) to serve the reopens
                self._spent.discard(row)
                stale = True
            if (plan is None and row not in self._spent) or stale or renew:
                self._plan(row, track, now)

    def _plan(self, row: int, track: JobReads, now: float) -> None:
        """Make `row`'s plan over its unread files: at once for a small universe, else in a
        worker thread (while `run` serves), installed only if still current."""
        self._renew.discard(row)
        track.grown = False
        self._planned_at[row] = now
        # Only what an open would take from staging and the RAM tier could keep: a file
        # above that is read in blocks (a block at a time, to RAM or SSD), through, or
        # whole while open handles leave room; a staged copy of it is mostly fetched
        # twice (and never taken when its blocks are on the SSD already).
        cache = self.cache
        limit = min(cache.ram_max, cache.handle_limit)
        job = cache.jobs.jobs[row]
        seed = int(self.rng.integers(1 << 62))
        kernel = cache.handles.kernel
        self._trusted = kernel.trusted
        held = kernel if self._trusted else None  # the kernel serves what it holds
        snap = _Snapshot.of(
            f"speculate:{job.id}", track, limit, cache.cached_keys(), seed, job, held
        )
        if self._nursery is None or len(track) <= self.offload_above:
            self._install(row, _build_plan(snap))
            return
        building = self._building[row] = _Build(track, track.epochs)
        self._nursery.start_soon(self._build_off_loop, row, building, snap)

    async def _build_off_loop(self, row: int, building: _Build, snap: _Snapshot) -> None:
        try:
            plan = await trio.to_thread.run_sync(_build_plan, snap)
        finally:
            if self._building.get(row) is building:
                del self._building[row]
        track, now = building.track, time.monotonic()
        if self.tracks.get(row) is not track or track.epochs != building.epochs:
            # `tend` plans the new epoch (or the row's new job) afresh.
            log.debug("job row %d: a plan built for an older epoch is dropped", row)
            return
        pf = self.cache.prefetcher
        if pf is None or track.paused or any(not p.speculative for p in pf.plans.values()):
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
        self.tracks.pop(row, None)
        self._last_read.pop(row, None)
        self._last_key.pop(row, None)
        self._planned_at.pop(row, None)
        self._spent.discard(row)
        self._renew.discard(row)
