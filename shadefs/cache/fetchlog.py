"""Which files the source sent this epoch: counts fetches of a file fetched before.

Within one epoch every file is read once, so with single flight (cache/flights.py) and a
prefetcher that never fetches what its reader already opened, no file should cross the link
twice: bytes from the source should equal the bytes of the distinct files fetched. The
cache notes every whole-file fetch here, and a fetch of a key already noted since the last
epoch boundary counts as a *refetch* (stats.json `refetches`, `refetch_bytes`): a refetch
is a file that a larger cache, or a better-timed prefetch, would have fetched once.

An epoch boundary is any job's new epoch: a sampler's `begin_epoch`, or one that the read
tracker infers (sampling/epochs.py). With several jobs at different epochs a key fetched
for one job and again for another after a boundary is not counted, so the counter is a
lower bound there. The keys are kept in a sorted uint64 array plus a small unsorted
buffer that is merged in when full (DESIGN.md §6: no Python object per file); a note costs
one binary search and one short vector comparison, next to a fetch's milliseconds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from shadefs.stats import FetchStats

__all__ = ["FetchLog"]

log = logging.getLogger(__name__)

_PENDING = 512


class FetchLog:
    """The keys fetched since the last epoch boundary, and the fetch counters."""

    def __init__(self) -> None:
        self._sorted = np.empty(0, dtype=np.uint64)
        self._pending = np.empty(_PENDING, dtype=np.uint64)
        self._n = 0
        self.fetches = 0
        self.fetch_bytes = 0
        self.refetches = 0
        self.refetch_bytes = 0
        # Takes in the jobs' latest reads (cache/speculate.py), which may end the epoch: a
        # job's first reads of a new epoch are noted before its logs are read otherwise.
        self.sync: Callable[[], None] | None = None

    def __contains__(self, key: int) -> bool:
        k = np.uint64(key)
        s = self._sorted
        i = int(np.searchsorted(s, k))
        if i < len(s) and s[i] == k:
            return True
        return bool(self._n) and bool((self._pending[: self._n] == k).any())

    def note(self, key: int, nbytes: int) -> bool:
        """Count a fetch of `key` (`nbytes` bytes); True if it is a refetch this epoch."""
        self.fetches += 1
        self.fetch_bytes += nbytes
        if key < 0:
            return False  # a block (cache/block_keys.py): not a whole file
        seen = key in self
        if seen and self.sync is not None:
            self.sync()  # the job's latest reads may end the epoch, which clears the log
            seen = key in self
        if seen:
            self.refetches += 1
            self.refetch_bytes += nbytes
            log.debug("key %d fetched again this epoch", key)
            return True
        if self._n == _PENDING:
            self._sorted = np.union1d(self._sorted, self._pending)
            self._n = 0
        self._pending[self._n] = key
        self._n += 1
        return False

    def note_many(self, keys: list[int], sizes: list[int]) -> int:
        """`note` of whole files `keys` (distinct, `sizes` bytes each) in one vectorised
        pass: a prefetch batch's; returns how many were refetches."""
        if len(keys) <= 1:
            return sum(self.note(k, n) for k, n in zip(keys, sizes, strict=True))
        k = np.array(keys, dtype=np.uint64)
        seen = self._seen(k)
        if seen.any() and self.sync is not None:
            self.sync()  # as in `note`: the latest reads may end the epoch
            seen = self._seen(k)
        self.fetches += len(keys)
        self.fetch_bytes += sum(sizes)
        again = np.flatnonzero(seen).tolist()
        for i in again:
            self.refetches += 1
            self.refetch_bytes += sizes[i]
            log.debug("key %d fetched again this epoch", keys[i])
        fresh = k[~seen] if again else k
        if self._n + len(fresh) > _PENDING:
            self._sorted = np.union1d(self._sorted, self._pending[: self._n])
            self._n = 0
            if len(fresh) > _PENDING:
                self._sorted = np.union1d(self._sorted, fresh)
                return len(again)
        self._pending[self._n : self._n + len(fresh)] = fresh
        self._n += len(fresh)
        return len(again)

    def _seen(self, k: np.ndarray) -> np.ndarray:
        s = self._sorted
        seen: np.ndarray
        if len(s):
            pos = np.searchsorted(s, k)
            pos[pos == len(s)] = 0
            seen = np.equal(s[pos], k)
        else:
            seen = np.zeros(len(k), dtype=bool)
        if self._n:
            seen |= np.isin(k, self._pending[: self._n])
        return seen

    def new_epoch(self) -> None:
        """An epoch boundary: every file may be fetched once more."""
        self._sorted = np.empty(0, dtype=np.uint64)
        self._n = 0

    def describe(self) -> FetchStats:
        return FetchStats(self.fetches, self.fetch_bytes, self.refetches, self.refetch_bytes)
