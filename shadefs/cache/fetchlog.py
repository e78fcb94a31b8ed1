"""Which files the source sent this epoch: counts fetches of a file fetched before.

Within one epoch every file is read once, so with single flight (cache/flights.py) and a
prefetcher that never fetches what its reader already opened, no file should cross the link
twice: bytes from the source should equal the bytes of the distinct files fetched. The
cache notes every whole-file fetch here, and a fetch of a key already noted since the last
epoch boundary counts as a *refetch* (stats.json `refetches`, `refetch_bytes`): a refetch
is a file that a larger cache, or a better-timed prefetch, would have fetched once.

An epoch boundary is any job's new epoch, announced or inferred: the log asks the readers'
tracker (readers/tracker.py, `boundaries`) at every note, and the tracker has taken every
open in before its fetch starts, so a job's first fetches of a new epoch are never counted
against the last one. With several jobs at different epochs a key fetched
for one job and again for another after a boundary is not counted, so the counter is a
lower bound there. The keys are kept in a sorted uint64 array plus a small unsorted
buffer that is merged in when full (DESIGN.md §6: no Python object per file); a note costs
one binary search and one short vector comparison, next to a fetch's milliseconds.
"""

from __future__ import annotations

import logging

import numpy as np

from shadefs.readers.tracker import Tracker
from shadefs.stats import FetchStats

__all__ = ["FetchLog"]

log = logging.getLogger(__name__)

_PENDING = 512


class FetchLog:
    """The keys fetched since the last epoch boundary, and the fetch counters."""

    def __init__(self, tracker: Tracker | None = None) -> None:
        self.tracker = tracker if tracker is not None else Tracker()
        self._boundaries = self.tracker.boundaries
        self._sorted = np.empty(0, dtype=np.uint64)
        self._pending = np.empty(_PENDING, dtype=np.uint64)
        self._n = 0
        self.fetches = 0
        self.fetch_bytes = 0
        self.refetches = 0
        self.refetch_bytes = 0

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
        if self.tracker.boundaries != self._boundaries:
            self._boundaries = self.tracker.boundaries
            self.new_epoch()  # some job began an epoch since the last fetch
        if key in self:
            self.refetches += 1
            self.refetch_bytes += nbytes
            log.debug("key %d fetched again this epoch", key)
            return True
        if self._n == _PENDING:
            # Merge the small sorted batch in (O(n) copies): a union1d re-sorted every key
            # noted, 0.1 s and more of the event loop every 512 fetches at 1.28 M files.
            batch = np.sort(self._pending)  # distinct: a key noted twice is a refetch
            self._sorted = np.insert(self._sorted, np.searchsorted(self._sorted, batch), batch)
            self._n = 0
        self._pending[self._n] = key
        self._n += 1
        return False

    def new_epoch(self) -> None:
        """An epoch boundary (the tracker's): every file may be fetched once more."""
        self._sorted = np.empty(0, dtype=np.uint64)
        self._n = 0

    def describe(self) -> FetchStats:
        return FetchStats(self.fetches, self.fetch_bytes, self.refetches, self.refetch_bytes)
