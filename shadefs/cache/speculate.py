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
  the job's reads are taken in (`sync`, also called by the prefetcher before each round
  and before it stages a fetched file), and the prefetcher skips consumed entries;
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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Protocol, overload

import numpy as np
import trio

from shadefs.cache.fetchlog import FetchLog
from shadefs.cache.handles import HandleLedger
from shadefs.cache.plans import Plan
from shadefs.cache.prefetch import Prefetcher
from shadefs.sampling.epochs import JobReads, Listing, ListingOf
from shadefs.sampling.jobs import JobTable


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
    def resident_keys(self) -> np.ndarray: ...


log = logging.getLogger(__name__)

PERIOD = 0.05  # seconds between takes of the jobs' reads
IDLE = 1.0  # seconds without a read after which a job's plan is dropped
REPLAN = 0.25  # seconds between rebuilds of a plan whose universe grew


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

    def __init__(self, name: str, reads: JobReads, index: np.ndarray) -> None:
        paths = _Paths(reads.listings, reads.where[index])
        super().__init__(name, reads.keys[index], paths, reads.sizes[index])

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
        self._trusted = True  # the kernel pages' share when the plans were made
        cache.fetchlog.sync = self.sync
        if self.enabled and cache.prefetcher is not None:
            cache.prefetcher.before_round = self.sync

    async def run(self) -> None:
        """Take the reads in and keep the plans, until cancelled (unmount)."""
        while True:
            await trio.sleep(PERIOD)
            self.sync()
            self.tend(time.monotonic())

    def sync(self) -> None:
        """Take in every job's logged reads (the prefetcher calls this before each round)."""
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
            if began:
                self.cache.fetchlog.new_epoch()
                log.debug("job %s: epoch %d begins", job.id, track.epochs)
                self._spent.discard(row)
                if row in self.plans:
                    # A fresh plan over the new epoch's unread files; what is staged stays
                    # (it is unread in this epoch too).
                    self._plan(row, track, now)
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
            if track.grown:
                self._spent.discard(row)
            stale = track.grown and now - self._planned_at.get(row, 0.0) >= REPLAN
            if flipped:  # the kernel's pages turned out (not) to serve the reopens
                self._spent.discard(row)
                stale = True
            if (plan is None and row not in self._spent) or stale:
                self._plan(row, track, now)

    def _plan(self, row: int, track: JobReads, now: float) -> None:
        pf = self.cache.prefetcher
        assert pf is not None
        track.grown = False
        self._planned_at[row] = now
        index = track.unread()
        # Only what an open would take from staging and the RAM tier could keep: a file
        # above that is read in blocks (a block at a time, to RAM or SSD), through, or
        # whole while open handles leave room; a staged copy of it is mostly fetched
        # twice (and never taken when its blocks are on the SSD already).
        cache = self.cache
        index = index[track.sizes[index] <= min(cache.ram_max, cache.handle_limit)]
        if len(index):
            cached = np.isin(track.keys[index], self.cache.resident_keys())
            index = index[~cached]
        kernel = cache.handles.kernel
        self._trusted = kernel.trusted
        if len(index) and self._trusted:  # the kernel serves what it holds: not staged
            index = index[~kernel.may_hold(track.keys[index])]
        if not len(index):
            self._drop(row)
            self._spent.add(row)
            return
        index = self.rng.permutation(index)
        job = self.cache.jobs.jobs[row]
        plan = SpecPlan(f"speculate:{job.id}", track, index)
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
