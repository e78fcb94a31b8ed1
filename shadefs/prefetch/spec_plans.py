"""Speculative plans: a job's unread files of its epoch, in a random order (speculate.py).

A `SpecPlan` is a `Plan` (plans.py) whose entries are consumed by its job's reads in any
order: each entry holds its tracker id, and an entry counts as read the moment the tracker
has its job's open (`consumed`, `unread`), before the speculator takes the reads in
(`consume`, in batches). Its order is free, so the prefetcher may put what it has staged
already first (`lead`). Its paths (`Paths`) are built on demand from the job's listings.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple, overload

import numpy as np

from shadefs.prefetch.plans import Plan
from shadefs.readers.tracker import Listing, Tracker, path_at

__all__ = ["JobEpoch", "Paths", "SpecPlan"]


class Paths(Sequence[bytes]):
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
            return Paths(self._listings, self._where[i])
        return path_at(self._listings, int(self._where[i]))

    def __iter__(self) -> Iterator[bytes]:
        return (self[i] for i in range(len(self)))

    def take(self, index: np.ndarray) -> Paths:
        """The paths at `index` (positions), in that order."""
        return Paths(self._listings, self._where[index])


class JobEpoch(NamedTuple):
    """Whose reads consume a speculative plan: job `row` of `tracker`, from its epoch
    `epoch` on (the epoch the plan was made in)."""

    tracker: Tracker
    row: int
    epoch: int


class SpecPlan(Plan):
    """A speculative plan: its entries are consumed by the job's reads, in any order."""

    speculative = True

    def __init__(
        self,
        name: str,
        keys: np.ndarray,
        paths: Sequence[bytes],
        sizes: np.ndarray,
        ids: np.ndarray | None = None,
        job: JobEpoch | None = None,
    ) -> None:
        """`ids`: the entries' tracker ids, whose reads by `job` count as consumed the
        moment the tracker has them (at the open), before `consume` takes them in."""
        super().__init__(name, keys, paths, sizes)
        self.ids = ids if ids is not None else np.zeros(len(keys), dtype=np.int64)
        self._idv = np.ascontiguousarray(self.ids, dtype=np.int64).data
        self.job = job

    @classmethod
    def over(cls, name: str, tracker: Tracker, index: np.ndarray, row: int = 0) -> SpecPlan:
        """The plan of job `row` over the files of tracker ids `index`, in that order."""
        paths = Paths(tracker.listings, tracker.where[index])
        keys = tracker.keys[index].astype(np.uint64)
        job = JobEpoch(tracker, row, tracker.epoch[row])
        return cls(name, keys, paths, tracker.sizes[index], index, job)

    def _read(self, pos: int) -> bool:
        job = self.job
        return job is not None and job.tracker.read_one_since(job.row, job.epoch, self._idv[pos])

    def consumed(self, pos: int) -> bool:
        return bool(self._consumed[pos]) or self._read(pos)

    def next_use(self, key: int) -> float:
        occ = self._occurrences(key)
        if len(occ) and self._read(int(occ[0])):
            return math.inf
        return super().next_use(key)

    def unread(self, keys: np.ndarray) -> np.ndarray:
        out = super().unread(keys)
        job = self.job
        if job is not None and out.any():
            # An entry occurs once (a plan of distinct ids): its key's sorted position.
            at = np.flatnonzero(out)
            pos = self._positions[np.searchsorted(self._sorted, keys[at])]
            out[at] = ~job.tracker.read_since(job.row, job.epoch, self.ids[pos])
        return out

    def observe(self, key: int, now: float) -> bool:
        return False  # `consume` takes the job's reads in batches instead

    def lead(self, keys: np.ndarray) -> int:
        """Reorder the plan in place: its entries of `keys` first, each part in its order.

        A plan is remade several times an epoch (each time the job's universe grows) while
        thousands of its files are staged already. Left in their random places, the
        prefetcher would walk over each of them again to find the unstaged ones: 3-4
        positions per file fetched on a cold pass of tools/bench/bench_cpu.py. A
        speculative order is a random one, and which entry was read is asked by id, not
        position, so moving them changes nothing else. O(len(keys) log n), on the loop."""
        n = len(self.keys)
        if not self.speculative or not len(keys) or not n:
            return super().lead(keys)
        at = np.minimum(np.searchsorted(self._sorted, keys), n - 1)
        at = at[self._sorted[at] == keys]  # (ids are distinct: a key occurs once)
        if not len(at):
            return 0
        first = np.zeros(n, dtype=bool)
        first[self._positions[at]] = True
        order = np.concatenate([np.flatnonzero(first), np.flatnonzero(~first)])
        where = np.empty(n, dtype=np.int64)
        where[order] = np.arange(n)  # an entry's old position -> its new one
        self.keys, self.sizes = self.keys[order], self.sizes[order]
        self.ids = self.ids[order]
        self._idv = np.ascontiguousarray(self.ids, dtype=np.int64).data
        paths = self.paths
        self.paths = paths.take(order) if isinstance(paths, Paths) else [paths[i] for i in order]
        self._positions = where[self._positions]
        self._consumed = self._consumed[order]
        rest = self._consumed
        self.cursor = int(np.argmin(rest)) if not rest.all() else n
        return int(np.count_nonzero(first))  # (a key both staged and in flight: once)

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
