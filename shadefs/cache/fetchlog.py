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
lower bound there. The keys are kept in a sorted uint64 array plus a small set of the
latest ones (at most _PENDING), merged into the array when full (DESIGN.md §6: no Python
object per file); a note costs one binary search and one set lookup, and a prefetch
batch's notes one vectorised search (`note_many`).
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
        self._pending: set[int] = set()  # the latest keys, not in _sorted yet
        self.fetches = 0
        self.fetch_bytes = 0
        self.refetches = 0
        self.refetch_bytes = 0

    def __contains__(self, key: int) -> bool:
        if key in self._pending:
            return True
        k = np.uint64(key)
        s = self._sorted
        i = int(np.searchsorted(s, k))
        return i < len(s) and bool(s[i] == k)

    def note(self, key: int, nbytes: int) -> bool:
        """Count a fetch of `key` (`nbytes` bytes); True if it is a refetch this epoch."""
        return bool(self.note_many([key], [nbytes]))

    def note_many(self, keys: list[int], sizes: list[int]) -> int:
        """Count fetches of distinct `keys` (`sizes` bytes each): a reader's fetch or a
        prefetch batch; returns how many were refetches this epoch."""
        self.fetches += len(keys)
        self.fetch_bytes += sum(sizes)
        if self.tracker.boundaries != self._boundaries:
            self._boundaries = self.tracker.boundaries
            self.new_epoch()  # some job began an epoch since the last fetch
        files = [i for i, k in enumerate(keys) if k >= 0]  # blocks (block_keys.py) are not
        seen = self._seen([keys[i] for i in files])
        again = 0
        for i, was in zip(files, seen, strict=True):
            key = keys[i]
            if was:
                again += 1
                self.refetches += 1
                self.refetch_bytes += sizes[i]
                log.debug("key %d fetched again this epoch", key)
                continue
            if len(self._pending) >= _PENDING:
                # Merge the small sorted batch in (O(n) copies): a union1d re-sorted every
                # key noted, 0.1 s and more of the event loop every 512 fetches at 1.28 M.
                batch = np.sort(np.fromiter(self._pending, np.uint64, len(self._pending)))
                pos = np.searchsorted(self._sorted, batch)
                self._sorted = np.insert(self._sorted, pos, batch)
                self._pending.clear()
            self._pending.add(key)
        return again

    def _seen(self, keys: list[int]) -> list[bool]:
        pending, s = self._pending, self._sorted
        if not len(s) or not keys:
            return [k in pending for k in keys]
        k = np.array(keys, dtype=np.uint64)
        pos = np.searchsorted(s, k)
        pos[pos == len(s)] = 0
        return [p or k in pending for p, k in zip((s[pos] == k).tolist(), keys, strict=True)]

    def new_epoch(self) -> None:
        """An epoch boundary (the tracker's): every file may be fetched once more."""
        self._sorted = np.empty(0, dtype=np.uint64)
        self._pending.clear()

    def describe(self) -> FetchStats:
        return FetchStats(self.fetches, self.fetch_bytes, self.refetches, self.refetch_bytes)
