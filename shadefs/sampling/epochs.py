"""Per job: the files it may read, which of them it read this epoch, where its epochs begin.

An unchanged training job (a plain shuffled DataLoader) announces nothing, yet its epochs
have a shape: within one epoch every file is read exactly once. So what a job has not read
yet this epoch is exactly what it will read before the epoch ends, and speculative prefetch
(cache/speculate.py) stages from that set. This module keeps, per job:

- its *universe*: the regular files of every directory it has read a file from (the
  directory listings the namespace holds), as sorted key, size and (listing, row) arrays;
- a bool array over the universe: read this epoch or not, and the count of those read;
- the epoch pattern. A file read twice ends the epoch. If by then the job has read at least
  `NEW_EPOCH` of its universe, a new epoch begins (the array is cleared); otherwise the
  pattern is broken (sampling with replacement, a job reading a small subset, replays):
  the job is *paused*, so nothing is staged for it, until a re-read finds it has again read
  `NEW_EPOCH` of its universe since the last one.

The cache logs every open's key in the job's `reads` buffer (sampling/jobs.py: one append,
the only cost on the hit path), and `absorb` takes them in batches: one vectorised pass per
batch (DESIGN.md §6: numpy arrays, no Python object per file). Growing the universe is the
only per-key work, once per unknown key, and each listing joins once.
"""

from __future__ import annotations

import logging
import stat
from collections.abc import Callable
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)

# The share of its universe a job must have read when a file is read again for that re-read
# to start a new epoch (rather than break the pattern). Below 1 for drop_last and for files
# added while the epoch ran.
NEW_EPOCH = 0.9
# The most reads kept while their directory is being listed (the newest win).
_PENDING = 1 << 16


class Listing(Protocol):
    """What the tracker reads of a directory listing (fs/snapshots.py's Snapshot)."""

    @property
    def path(self) -> bytes: ...
    @property
    def ino(self) -> np.ndarray: ...
    @property
    def rows(self) -> np.ndarray: ...
    def child_path(self, i: int) -> bytes: ...


# The listing of the directory holding a key's file, or None when there is none (a file
# looked up in a directory never listed, or a key the namespace no longer holds).
ListingOf = Callable[[int], Listing | None]


class JobReads:
    """One job's universe, what it read this epoch, and its epoch pattern."""

    def __init__(self) -> None:
        self.job = ""  # the owner's job id (a row is reused once its job ends)
        self.keys = np.empty(0, dtype=np.uint64)  # the universe, sorted
        self.sizes = np.empty(0, dtype=np.int64)
        self.where = np.empty(0, dtype=np.int64)  # listing index << 32 | row
        self.listings: list[Listing] = []
        self._dirs: set[bytes] = set()  # one path per directory (a handful per job)
        self.read = np.zeros(0, dtype=bool)
        self.count = 0  # files of the universe read this epoch
        self.epochs = 0  # epoch boundaries seen
        self.breaks = 0  # re-reads that broke the pattern
        self.paused = False
        self.grown = False  # the universe grew since the owner last looked (it resets it)
        self._pending = np.empty(0, dtype=np.uint64)  # read, in no known listing yet

    def __len__(self) -> int:
        return len(self.keys)

    def path(self, i: int) -> bytes:
        """The path of universe entry `i`."""
        w = int(self.where[i])
        return self.listings[w >> 32].child_path(w & 0xFFFFFFFF)

    def unread(self) -> np.ndarray:
        """Universe indexes of the files not read this epoch."""
        return np.flatnonzero(~self.read)

    def _grow(self, listing: Listing) -> None:
        self._dirs.add(listing.path)
        modes = listing.rows["st_mode"].astype(np.int64)
        rows = np.flatnonzero((modes & 0o170000) == stat.S_IFREG)
        keys = listing.ino[rows].astype(np.uint64)
        fresh = ~np.isin(keys, self.keys)
        rows, keys = rows[fresh], keys[fresh]
        if not len(keys):
            return
        where = (np.int64(len(self.listings)) << np.int64(32)) | rows.astype(np.int64)
        self.listings.append(listing)
        sizes = listing.rows["st_size"][rows].astype(np.int64)
        all_keys = np.concatenate([self.keys, keys])
        order = np.argsort(all_keys, kind="stable")
        self.keys = all_keys[order]
        self.sizes = np.concatenate([self.sizes, sizes])[order]
        self.where = np.concatenate([self.where, where])[order]
        self.read = np.concatenate([self.read, np.zeros(len(keys), dtype=bool)])[order]
        self.grown = True

    def _resolve_pending(self) -> None:
        idx, found = self._index(self._pending)
        fresh = np.unique(idx[found])
        fresh = fresh[~self.read[fresh]]
        self.read[fresh] = True
        self.count += len(fresh)
        self._pending = self._pending[~found]

    def _index(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = np.searchsorted(self.keys, keys)
        idx[idx >= len(self.keys)] = 0
        found = self.keys[idx] == keys if len(self.keys) else np.zeros(len(keys), dtype=bool)
        return idx, found

    def absorb(self, keys: np.ndarray, listing_of: ListingOf) -> int:
        """Take a batch of opened keys, in order; returns how many new epochs began."""
        keys = keys.astype(np.uint64, copy=False)
        idx, found = self._index(keys)
        if not found.all():
            size = len(self.keys)
            for key in np.unique(keys[~found]).tolist():
                listing = listing_of(int(key))
                if listing is not None and listing.path not in self._dirs:
                    self._grow(listing)
            idx, found = self._index(keys)
            if len(self.keys) != size:
                self._resolve_pending()
            # Reads from directories not listed yet: remembered, so that they count as
            # read once the listing joins (nothing read this epoch may be staged).
            lost = keys[~found]
            if len(lost):
                self._pending = np.concatenate([self._pending, lost])[-_PENDING:]
        idx = idx[found]
        began = 0
        while len(idx):
            # A re-read: read before in this epoch, or earlier in this very batch.
            again = self.read[idx]
            _, first = np.unique(idx, return_index=True)
            repeat = np.ones(len(idx), dtype=bool)
            repeat[first] = False
            hits = np.flatnonzero(again | repeat)
            j = int(hits[0]) if len(hits) else len(idx)
            fresh = idx[:j]
            self.read[fresh] = True
            self.count += len(fresh)
            if j == len(idx):
                break
            if self.count >= NEW_EPOCH * len(self.keys):
                began += 1
                self.epochs += 1
                self.paused = False
            else:
                if not self.paused:
                    log.debug("epoch pattern broken after %d of %d files", self.count, len(self))
                self.breaks += 1
                self.paused = True
            self.read[:] = False
            self.count = 0
            self._pending = self._pending[:0]
            idx = idx[j:]
        return began
