"""Speculative prefetch: stage what a job with no announced order has not read this epoch.

A plain shuffled DataLoader tells the daemon nothing of its order, but within an epoch each
file not yet read will be read exactly once (the readers' tracker, readers/tracker.py,
knows per job its universe, its epoch and what it read of it). So the unread, uncached
files of a job's epoch are a prefetch target that the epoch never wastes. The speculator
turns them into a *speculative plan* for the prefetcher (cache/prefetch.py): the unread
files in a random order. The prefetcher stages them in its staging buffer, within its
window and at its adaptive concurrency, exactly as for a known order; a reader that opens
a staged file takes it from there, and one that opens a file being fetched joins the
flight.

With cache fraction f and window w (both shares of the data), the share of misses served
from staging is (w + w ln((1 - f) / w)) / (1 - f): 0.60 at f = w = 0.2.

Rules that keep it from ever slowing a job down:

- a file the job read this epoch is never staged: a plan is made of the tracker's unread
  files, its entries are marked consumed as the job's logged opens are taken in (`sync`,
  also called by the prefetcher before each round and before it stages a fetched file),
  and the prefetcher skips consumed entries;
- the plan is dropped when the job's reads stop (`idle` seconds without one), while the
  tracker finds its epoch pattern broken (a file read twice before the epoch was
  complete), when the job announces its epochs (a sampler: its orders are known), when
  the job ends, and while any known order (a sampler's or a `.shadefs/plan`) is being
  prefetched: a job that announces its order gets the clairvoyant prefetcher alone;
- the window bounds what is staged or in flight, as for every plan;
- a file larger than the RAM tier caches whole (`--max-entry`) is never planned: its
  reader reads it in blocks or through, or whole from the SSD tier, not from staging.

A new epoch of the job (the tracker's) replaces the plan by a fresh one over the new
epoch's unread files. Also in the first, cold epoch: the universe is then the directories
the job has read from so far, so staging starts after its first reads. The speculator
infers nothing itself: epochs, universes and unread files are the tracker's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Protocol, overload

import numpy as np
import trio

from shadefs.cache.plans import Plan
from shadefs.cache.prefetch import Prefetcher
from shadefs.readers.part import Readers
from shadefs.readers.tracker import Listing, Tracker


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
    def resident_keys(self) -> np.ndarray: ...


log = logging.getLogger(__name__)

PERIOD = 0.05  # seconds between takes of the jobs' reads
IDLE = 1.0  # seconds without a read after which a job's plan is dropped
REPLAN = 0.25  # seconds between rebuilds of a plan whose universe grew


class _Paths(Sequence[bytes]):
    """A plan's paths, built on demand from the job's listings (no list of paths).

    It keeps the (listing, row) of each entry as the plan was made: a refreshed listing
    moves a file's `where` in the tracker, and the plan's paths must stay those it made.
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

    def __init__(self, name: str, tracker: Tracker, index: np.ndarray) -> None:
        """The plan of the files of tracker ids `index`, in that order."""
        paths = _Paths(tracker.listings, tracker.where[index])
        keys = tracker.keys[index].astype(np.uint64)
        super().__init__(name, keys, paths, tracker.sizes[index])

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
    """Keeps a speculative plan per job over the tracker's unread files of its epoch."""

    def __init__(
        self,
        cache: Cache,
        *,
        enabled: bool = True,
        idle: float = IDLE,
        seed: int | None = None,
    ) -> None:
        self.cache = cache
        self.tracker = cache.readers.tracker
        self.enabled = enabled and cache.prefetcher is not None
        self.idle = idle
        self.rng = np.random.default_rng(seed)
        self.plans: dict[int, SpecPlan] = {}
        self._owner: dict[int, str] = {}  # job row -> the id of the job it served
        self._last_read: dict[int, float] = {}
        self._planned: dict[int, tuple[int, int, float]] = {}  # row -> (epoch, universe, t)
        self._spent: set[int] = set()  # rows with nothing left to stage until they grow
        self.plans_made = 0
        if self.enabled and cache.prefetcher is not None:
            cache.prefetcher.before_round = self.sync

    async def run(self) -> None:
        """Take the reads in and keep the plans, until cancelled (unmount)."""
        while True:
            await trio.sleep(PERIOD)
            self.sync()
            self.tend(time.monotonic())

    def sync(self) -> None:
        """Take in every job's logged opens: they consume its plan's entries (the prefetcher
        calls this before each round); a job whose epoch moved gets a fresh plan."""
        now = time.monotonic()
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
            plan = self.plans.get(row)
            if plan is None:
                continue
            if self._planned[row][0] != int(self.tracker.epoch[row]):
                # A fresh plan over the new epoch's unread files; what is staged stays
                # (it is unread in this epoch too).
                self._spent.discard(row)
                self._plan(row, now)
            else:
                plan.consume(keys, now)

    def tend(self, now: float) -> None:
        """Drop the plans that must stop; make or rebuild those that should run."""
        pf = self.cache.prefetcher
        if not self.enabled or pf is None:
            return
        t = self.tracker
        known = any(not p.speculative for p in pf.plans.values())
        for row in self._owner:
            plan = self.plans.get(row)
            # A job that announces its epochs has a sampler whose orders the daemon knows
            # (or will): the clairvoyant prefetcher's, even between two of its orders.
            idle = now - self._last_read.get(row, 0.0) > self.idle
            if known or t.explicit[row] or t.broken[row] or idle:
                self._drop(row)
                continue
            if plan is not None and plan.name not in pf.plans:
                # The prefetcher ended it (all of it read, or abandoned): start afresh.
                del self.plans[row]
                plan = None
            epoch, size, at = self._planned.get(row, (-1, -1, 0.0))
            grown = int(t.size[row]) != size
            if grown or epoch != int(t.epoch[row]):
                self._spent.discard(row)
            stale = grown and now - at >= REPLAN
            if (plan is None and row not in self._spent) or stale:
                self._plan(row, now)

    def _plan(self, row: int, now: float) -> None:
        pf = self.cache.prefetcher
        assert pf is not None
        t = self.tracker
        self._planned[row] = (int(t.epoch[row]), int(t.size[row]), now)
        index = t.unread(row)
        # Only what an open would take from staging and the RAM tier could keep: a file
        # above that is read in blocks (a block at a time, to RAM or SSD), through, or
        # whole while open handles leave room; a staged copy of it is mostly fetched
        # twice (and never taken when its blocks are on the SSD already).
        cache = self.cache
        index = index[t.sizes[index] <= min(cache.ram_max, cache.handle_limit)]
        if len(index):
            cached = np.isin(t.keys[index].astype(np.uint64), cache.resident_keys())
            index = index[~cached]
        if not len(index):
            self._drop(row)
            self._spent.add(row)
            return
        index = self.rng.permutation(index)
        plan = SpecPlan(f"speculate:{self._owner[row]}", t, index)
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
