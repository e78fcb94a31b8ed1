"""Reads still to come: what the known orders will read again, per sample and per job.

The daemon builds every epoch order that a `ShadeSampler` reads, so it knows how many
times each sample will be read this epoch (PADS replays resident samples, r copies each).
A resident sample that is evicted before its last read is fetched again later in the same
epoch: bytes over the link twice, and a stall for a sample that was a hit when the order
was made. `PendingReads` counts, per sample, the reads still to come; the `shade` and
`epoch` policies keep an entry with reads to come above every entry without
(cache/policies/), so it is not evicted for a miss until its last known read.

The counts are kept per job (the cache's job row), because the jobs of a sweep group read
one order each at their own pace: a member that starts the next epoch first must not drop
what the others still read of this one (that refetched up to 2.5x the bytes of one job).

- An order request of job j for epoch e adds j's share (the rank's slice, each rank once)
  to j's counts; j's first request of a later epoch first releases what j left unread of
  its previous one (it stopped early, or its order had reads it skipped).
- An open of a sample by job j takes one read off j's count; reads beyond a job's count
  take one off the node's pool (below) instead, never below zero.
- A multi-node job's installed epoch is counted in the node's pool (`job` None): the
  shares of this node's ranks, whichever process reads them; a later epoch replaces it.
- A job that ends releases its counts (`drop`).

`left[sample]` is the sum over jobs and the pool: one lookup answers `pending`. A read
costs O(1); an order costs O(its length) (a bincount), never O(dataset) per read.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

_POOL = -1  # the node's pool: counts of orders no single job reads (multi-node installs)


class PendingReads:
    """`left[sample]`: the reads of the known orders not yet seen, over every job."""

    def __init__(self, sample_of: Callable[[int], int]) -> None:
        """`sample_of(key)`: the sample id of a cache key, or -1 outside the dataset."""
        self.sample_of = sample_of
        self.left = np.zeros(0, dtype=np.int32)
        self.epoch = -1  # no order yet: reads cost one comparison
        self._mine: dict[int, np.ndarray] = {}  # job row (or _POOL) -> its counts
        self._epoch_of: dict[int, int] = {}  # job row -> the epoch its counts are of
        self._counted: dict[int, set[tuple[int, int]]] = {}  # job -> (world, rank) counted
        # Admissions the cache refused for a sample with reads to come: the cache is full
        # of such samples (a sweep group's members further apart than it can bridge), and
        # unless staging serves them, those reads fetch the file again (`sampler.unbridged`).
        self.unbridged = 0

    def reset(self, n: int) -> None:
        """A new dataset of `n` samples: nothing is pending."""
        self.left = np.zeros(n, dtype=np.int32)
        self.epoch = -1
        self._mine.clear()
        self._epoch_of.clear()
        self._counted.clear()

    def expect(
        self,
        epoch: int,
        samples: np.ndarray,
        job: int | None = None,
        share: tuple[int, int] = (1, 0),
        counts: np.ndarray | None = None,
    ) -> None:
        """Job `job` (None: the node's pool) will read `samples` (ids, repeats counted) in
        `epoch`, as share `share` (world size, rank) of that epoch's order: counted once.
        `counts`: `count(samples, len(left))`, if computed already (in a worker thread:
        a bincount over a whole epoch holds the event loop for 10-20 ms at 1.28 M)."""
        row = _POOL if job is None else job
        mine = self._release_before(row, epoch)
        if mine is None:
            return  # a request for an epoch older than the job's: nothing new to count
        counted = self._counted.setdefault(row, set())
        if share in counted:
            return
        counted.add(share)
        self.epoch = max(self.epoch, epoch)
        if not len(samples):
            return
        n = max(len(self.left), int(samples.max()) + 1)
        if n > len(self.left):  # ids past the registered ones (a test's table)
            self.left = np.concatenate([self.left, np.zeros(n - len(self.left), np.int32)])
        if n > len(mine):
            mine = self._mine[row] = np.concatenate([mine, np.zeros(n - len(mine), np.int32)])
        if counts is None or len(counts) != n:
            counts = self.count(samples, n)
        mine += counts
        self.left += counts

    @staticmethod
    def count(samples: np.ndarray, n: int) -> np.ndarray:
        """Reads per sample id of `samples`, over at least `n` ids (in any thread)."""
        return np.bincount(samples, minlength=n).astype(np.int32)

    def _release_before(self, row: int, epoch: int) -> np.ndarray | None:
        """Job `row`'s counts for `epoch`: its counts of an earlier epoch are released
        first; None when it already counts a later epoch."""
        known = self._epoch_of.get(row)
        if known is not None and epoch < known:
            return None
        if known is None or epoch > known:
            self.drop(row)
            self._epoch_of[row] = epoch
            self._mine[row] = np.zeros(len(self.left), dtype=np.int32)
        return self._mine[row]

    def drop(self, job: int) -> None:
        """Job `job` is over (or starts another epoch): what it still had to read is not
        read any more."""
        mine = self._mine.pop(job, None)
        if mine is not None:
            self.left[: len(mine)] -= mine
        self._epoch_of.pop(job, None)
        self._counted.pop(job, None)

    def read(self, key: int, job: int = _POOL) -> None:
        """One open of `key` by job `job` (the cache calls this on every open)."""
        if self.epoch < 0:
            return
        sid = self.sample_of(key) if key >= 0 else -1
        if sid < 0 or self.left[sid] <= 0:
            return
        mine = self._mine.get(job)
        if mine is None or sid >= len(mine) or mine[sid] <= 0:
            mine = self._mine.get(_POOL)
            if mine is None or sid >= len(mine) or mine[sid] <= 0:
                return  # another job's read still to come: not this one
        mine[sid] -= 1
        self.left[sid] -= 1

    def pending(self, key: int) -> bool:
        """Whether a known order reads `key` again (for any job)."""
        if self.epoch < 0 or key < 0:
            return False
        sid = self.sample_of(key)
        return sid >= 0 and bool(self.left[sid] > 0)

    def refused(self, key: int) -> None:
        """The cache refused to admit `key`: counted when a known order reads it again."""
        if self.pending(key):
            self.unbridged += 1
