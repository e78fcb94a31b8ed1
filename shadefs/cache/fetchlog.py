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
lower bound there. A key with a tracker id (every file a job opened or a speculative plan
stages) is marked in a column over ids with the epoch's stamp (an epoch boundary bumps the
stamp: nothing is cleared); a note costs a dict lookup and a column read. Other keys (a
known order's files no job has opened yet) go to a sorted uint64 array plus a small set of
the latest ones (at most _PENDING), merged into the array when full (docs/design.md §6: no
Python object per file).
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
        self._stamp = 1  # this epoch's mark in `_fetched`
        self._fetched = np.zeros(64, dtype=np.int32)  # per tracker id: the stamp last fetched
        self._fetchedv = self._fetched.data
        self._sorted = np.empty(0, dtype=np.uint64)  # keys without an id (sorted)
        self._pending: set[int] = set()  # the latest keys without an id, not in _sorted yet
        self.fetches = 0
        self.fetch_bytes = 0
        self.refetches = 0
        self.refetch_bytes = 0

    def __contains__(self, key: int) -> bool:
        i = self.tracker.id_of.get(key)
        if i is not None and i < len(self._fetched) and self._fetchedv[i] == self._stamp:
            return True
        if key in self._pending:
            return True
        k = np.uint64(key)
        s = self._sorted
        j = int(np.searchsorted(s, k))
        return j < len(s) and bool(s[j] == k)

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
        id_of, stamp = self.tracker.id_of, self._stamp
        again = 0
        for key, nbytes in zip(keys, sizes, strict=True):
            if key < 0:
                continue  # blocks (block_keys.py) are not files
            i = id_of.get(key)
            if i is None:
                was = self._note_unlisted(key)
            else:
                if i >= len(self._fetched):
                    self._grow(i)
                was = self._fetchedv[i] == stamp
                self._fetchedv[i] = stamp
            if was:
                again += 1
                self.refetches += 1
                self.refetch_bytes += nbytes
                log.debug("key %d fetched again this epoch", key)
        return again

    def _grow(self, i: int) -> None:
        cap = len(self._fetched)
        while cap <= i:
            cap *= 2
        new = np.zeros(cap, dtype=np.int32)
        new[: len(self._fetched)] = self._fetched
        self._fetched, self._fetchedv = new, new.data

    def _note_unlisted(self, key: int) -> bool:
        """Note `key`, which has no tracker id; whether it was noted this epoch."""
        if key in self._pending:
            return True
        s = self._sorted
        if len(s):
            j = int(np.searchsorted(s, np.uint64(key)))
            if j < len(s) and s[j] == key:
                return True
        if len(self._pending) >= _PENDING:
            # Merge the small sorted batch in (O(n) copies): a union1d re-sorted every
            # key noted, 0.1 s and more of the event loop every 512 fetches at 1.28 M.
            batch = np.sort(np.fromiter(self._pending, np.uint64, len(self._pending)))
            pos = np.searchsorted(self._sorted, batch)
            self._sorted = np.insert(self._sorted, pos, batch)
            self._pending.clear()
        self._pending.add(key)
        return False

    def new_epoch(self) -> None:
        """An epoch boundary (the tracker's): every file may be fetched once more."""
        self._stamp += 1
        self._sorted = np.empty(0, dtype=np.uint64)
        self._pending.clear()

    def describe(self) -> FetchStats:
        return FetchStats(self.fetches, self.fetch_bytes, self.refetches, self.refetch_bytes)
