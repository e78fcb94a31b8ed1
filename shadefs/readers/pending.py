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
- A sweep group's members read one order each, but a member that starts seconds after
  the first asks for it only then: until it does, its reads were not counted, and the
  first member's files could be evicted before it came for them (the group's first few
  hundred reads of an epoch fetched again). So the first request of a group's epoch also
  counts the order once for each other member (`members - 1` copies, the group's *ahead*
  counts); a member's own request then moves one copy to its row. Reads never take from
  the ahead counts. Copies a member can no longer claim go: one when it ends, all of an
  epoch once the group's first member asks for the epoch after next.

`left[sample]` is the sum over jobs and the pool: one lookup answers `pending`. A read
costs O(1); an order costs O(its length) (a bincount), never O(dataset) per read.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

_POOL = -1  # the node's pool: counts of orders no single job reads (multi-node installs)
_NONE = np.zeros(0, dtype=np.int32)  # the ahead counts of an order no member waits for


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
        # (group, epoch, share) -> (counts, copies): the order counted for the members of
        # a sweep group that have not asked for it yet; and each job row's group.
        self._ahead: dict[tuple[str, int, tuple[int, int]], tuple[np.ndarray, int]] = {}
        self._group_of: dict[int, str] = {}
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
        self._ahead.clear()
        self._group_of.clear()

    def expect(
        self,
        epoch: int,
        samples: np.ndarray,
        job: int | None = None,
        share: tuple[int, int] = (1, 0),
        counts: np.ndarray | None = None,
        group: str = "",
        members: int = 1,
    ) -> None:
        """Job `job` (None: the node's pool) will read `samples` (ids, repeats counted) in
        `epoch`, as share `share` (world size, rank) of that epoch's order: counted once.
        `counts`: `count(samples, len(left))`, if computed already (in a worker thread:
        a bincount over a whole epoch would hold the event loop at 1.28 M samples).
        `group`, `members`: the job's sweep group and its active jobs, this one included
        (the others read this order too, each when it asks: counted ahead for them)."""
        row = _POOL if job is None else job
        if group and job is not None:
            self._group_of[row] = group
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
        if group and job is not None:
            self._count_ahead(group, epoch, share, counts, members)

    def _count_ahead(
        self, group: str, epoch: int, share: tuple[int, int], counts: np.ndarray, members: int
    ) -> None:
        """A member of `group` counted its share of `epoch`: the first one counts it for
        the other members too, a later one takes its copy back from those counts."""
        if (group, epoch, share) in self._ahead:
            self._release_ahead((group, epoch, share), 1)
            return
        # The group's first request of this epoch (a key stays, with no copies left, until
        # then): the members two epochs behind are too far to bridge, and may never ask.
        for key in [k for k in self._ahead if k[0] == group and k[1] < epoch - 1]:
            self._release_ahead(key, len(self.left))
            del self._ahead[key]
        copies = max(members - 1, 0)
        self._ahead[(group, epoch, share)] = (counts if copies else _NONE, copies)
        self.left[: len(counts)] += counts * copies

    def _release_ahead(self, key: tuple[str, int, tuple[int, int]], copies: int) -> None:
        """Take up to `copies` copies of `key`'s ahead counts off the reads to come."""
        counts, left = self._ahead[key]
        n = min(copies, left)
        self.left[: len(counts)] -= counts * n
        self._ahead[key] = (counts if left > n else _NONE, left - n)

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

    def ended(self, job: int, group: str = "") -> None:
        """Job `job` of sweep group `group` is over: what it still had to read, and the
        copies of its group's orders counted ahead for it (the epochs after its own), are
        not read any more."""
        group, epoch = self._group_of.pop(job, group), self._epoch_of.get(job, -1)
        for key in [k for k in self._ahead if k[0] == group and k[1] > epoch]:
            self._release_ahead(key, 1)
        self.drop(job)

    def drop(self, job: int) -> None:
        """Job `job` starts another epoch (or is over): what it still had to read is not
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

    def reads_left(self, key: int) -> int:
        """How many reads of `key` the known orders still make (over every job)."""
        if self.epoch < 0 or key < 0:
            return 0
        sid = self.sample_of(key)
        return int(self.left[sid]) if sid >= 0 else 0

    def group_reads_left(self, key: int) -> int:
        """`reads_left` while a job of a sweep group counts its orders here, else 0."""
        return self.reads_left(key) if self._group_of else 0

    def refused(self, key: int) -> None:
        """The cache refused to admit `key`: counted when a known order reads it again."""
        if self.pending(key):
            self.unbridged += 1
