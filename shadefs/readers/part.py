"""The readers part: who reads what, in one place.

`Readers` owns the job table (readers/jobs.py), the epoch tracker (readers/tracker.py) and
the pending reads of the known orders (readers/pending.py), and runs their one task: the
idle-job sweep and the settling of the jobs' universes. The cache tells it of every open
in one call (`read`), the control commands name jobs and announce epochs through it, and
the policies, the speculator, the fetch log and the stats read its state. Nothing outside
it infers an epoch or ends a job: a job that ends leaves the tracker's demand and the
pending reads here, and the policies re-rank when the tracker's generation moves.

Reading its state never changes it: only the sweep ends jobs (stats.json reads nothing
but `describe`).
"""

from __future__ import annotations

import logging

import numpy as np

from shadefs.readers.jobs import Job, JobTable
from shadefs.readers.pending import PendingReads
from shadefs.readers.tracker import ListingOf, Tracker
from shadefs.stats import JobStats

log = logging.getLogger(__name__)

SETTLE = 0.05  # seconds between two ticks by the owner (`tick`: new listings join)


def _no_sample(key: int) -> int:
    return -1


class Readers:
    """The jobs, their epochs and reads, and the reads their known orders still make.

    :jobs: the job table; :tracker: epochs, reads and demand over dense file ids;
    :pending: the reads still to come of the known orders (the sampling registry's)
    """

    def __init__(
        self,
        jobs: JobTable | None = None,
        pending: PendingReads | None = None,
        listing_of: ListingOf | None = None,
    ) -> None:
        self.jobs = jobs if jobs is not None else JobTable()
        self.pending = pending if pending is not None else PendingReads(_no_sample)
        self.tracker = Tracker(listing_of)
        self._swept: float | None = None  # the last sweep (None: from the first tick)

    def tick(self) -> None:
        """Settle the universes, and sweep the idle jobs once a sweep period has passed. The
        owner calls it every SETTLE seconds, once it has told the reads it logged (the
        cache's hits), so that no sweep finds their job idle."""
        self.tracker.settle()
        now = self.jobs.clock()
        if self._swept is None:
            self._swept = now
        elif now - self._swept >= self.jobs.period:
            self._swept = now
            self.expire(now)

    def read(self, key: int, pid: int, i: int = -1) -> Job:
        """An open of `key` (tracker id `i`, -1: unknown) by reader `pid`: its job, with
        the read counted (`read_by`)."""
        jobs = self.jobs
        job = jobs.pids.get(pid) or jobs.job_of(pid)
        self.read_by(key, job, i)
        return job

    def read_by(self, key: int, job: Job, i: int = -1) -> None:
        """An open of `key` by `job` (the cache's hit path: keep it short), counted in the
        pending reads, the tracker and the job's log."""
        pending = self.pending
        if pending.epoch >= 0:  # some known order counts reads: take this one off
            pending.read(key, job.row)
        self.tracker.read(key, job.row, i)
        job.reads.append(key)  # the speculator's plans take them in (prefetch/speculate.py)

    def read_many(self, keys: list[int], job: Job, ids: list[int]) -> np.ndarray | None:
        """`read_by(keys[k], job, ids[k])` for k in order, the tracker's part in numpy
        (`Tracker.read_many`): each id's rank after the batch, or None (nothing done)."""
        ranks = self.tracker.read_many(keys, job.row, ids)
        if ranks is None:
            return None
        pending = self.pending
        if pending.epoch >= 0:
            for key in keys:
                pending.read(key, job.row)
        job.reads.extend(keys)
        return ranks

    def read_block(self, key: int) -> None:
        """A read of block `key` (cache/blocks.py), for the `epoch` policy's ranks. A block
        read names no reader: it counts for row 0 (the first job's), as it always did."""
        self.tracker.read(key, 0)

    def row_of(self, pid: int) -> int | None:
        """The row of reader `pid`'s job; None (every job) for an unknown writer (pid 0)."""
        return self.jobs.row_of(pid) if pid > 0 else None

    def announce(self, epoch: int, row: int | None) -> None:
        """A sampler announced `epoch` for job `row` (None: every job)."""
        self.tracker.announce(epoch, row)

    def name_job(self, pid: int, name: str, group: str) -> int:
        """Name `pid`'s job (a sampler's registration); returns its row."""
        row, merged = self.jobs.name(pid, name, group)
        if merged is not None:
            self._ended(merged)
        return row

    def expire(self, now: float) -> list[int]:
        """End the jobs idle for longer than the table's idle time; returns their rows."""
        groups = {row: job.group for row, job in self.jobs.jobs.items()}
        gone = self.jobs.expire(now)
        for row in gone:
            self._ended(row, groups.get(row, ""))
        return gone

    def _ended(self, row: int, group: str = "") -> None:
        self.pending.ended(row, group)  # what it had still to read, it reads no more
        self.tracker.leave(row)

    def describe(self) -> list[JobStats]:
        return self.jobs.describe(self.tracker.epochs_of())
