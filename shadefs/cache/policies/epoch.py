"""The `epoch` policy, the default: keep what has not been read this epoch.

Under shuffled epochs every file is read once per epoch, so the best any demand cache can
do is keep a fixed set until it has been read this epoch (hit ratio f = cache/dataset, the
bound that Belady's MIN also reaches), while LRU thrashes (DESIGN.md fact 1).

With several jobs (a sweep over one dataset), "read this epoch" is per job, and the policy
evicts by remaining demand instead: see `EpochPolicy` and demand.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from itertools import chain

import numpy as np

from shadefs.cache.policies.base import Policy, take_prefix
from shadefs.cache.policies.demand import JobReads
from shadefs.stats import PolicyState

log = logging.getLogger(__name__)


class EpochPolicy(Policy):
    """Keep what has not been read this epoch; evict what was read this epoch first.

    Each resident entry remembers the epoch of its last read. Relative to the current
    epoch E an entry is *protected* (last read in E-1: it will be read again in E),
    *consumed* (read in E: its next read is in E+1) or *stale* (not read for a whole epoch:
    no longer part of what the job reads). A miss is admitted into free space, or in place
    of stale entries; it is never swapped for a consumed one, because the miss itself was
    just consumed and the swap would be pure churn. Consumed entries go first when the
    budget shrinks, protected ones last.

    Epochs are inferred when no sampler announces them: reading a resident file that was
    already read in the current epoch means a new pass over the data has begun. With a
    resident fraction f the boundary is noticed after about 1/f reads of the new epoch,
    and the misses in between are not admitted anyway, so nothing is lost.

    Several jobs: the cache names the job of every access. While more than one job is
    active, epochs are per job (JobReads: one job's read of a file another job read is no
    new epoch) and the policy is demand-aware: an entry's remaining demand is the number of
    active jobs that have not read it in their current epoch. Entries nobody wants go
    first (stale for every job before consumed ones), a miss is admitted only in place of
    entries with less demand than its own (the jobs that have not read it yet), and among
    equal demand the entries more jobs will read next epoch stay. With one job the rules
    above apply unchanged (its row in JobReads is brought up to date when a second job
    joins).
    """

    name = "epoch"

    def __init__(self, pending: Callable[[int], bool] | None = None) -> None:
        """`pending(key)`: whether a known order (a ShadeSampler's, sampling/pending.py)
        reads `key` again. Such an entry is never evicted for a miss that no known order
        reads again, and such a miss may replace any entry without."""
        super().__init__()
        self.pending = pending
        self.epoch = 0
        self._explicit = False
        self._last: dict[int, int] = {}
        # Insertion-ordered buckets of keys by the epoch of their last read.
        self._buckets: dict[int, dict[int, None]] = {}
        self.reads = JobReads()
        self._solo = -1  # the row of the one active job, -1 unless exactly one is active

    @property
    def shared(self) -> bool:
        """Whether more than one job is active (the demand-aware rules apply)."""
        return len(self.reads.active) > 1

    def _place(self, key: int, epoch: int) -> None:
        self._unplace(key)
        self._last[key] = epoch
        self._buckets.setdefault(epoch, {})[key] = None

    def _unplace(self, key: int) -> None:
        old = self._last.pop(key, None)
        if old is not None:
            bucket = self._buckets[old]
            del bucket[key]
            if not bucket:
                del self._buckets[old]

    def inserted(self, key: int, size: int) -> None:
        super().inserted(key, size)
        # A miss was just read, so a new entry starts out consumed.
        self._place(key, self.epoch)
        self.reads.add(key, size)

    def restored(self, key: int, size: int) -> None:
        # Found on disk after a restart: nothing says it was read this epoch, so it is
        # protected until it is (and its first read must not look like a new epoch).
        Policy.inserted(self, key, size)
        self._place(key, self.epoch - 1)
        self.reads.add(key, size)

    def removed(self, key: int) -> None:
        super().removed(key)
        self._unplace(key)
        self.reads.remove(key)

    def accessed(self, key: int, hit: bool, job: int = 0) -> None:
        if job != self._solo or not hit:
            self._accessed(key, hit, job)
            return
        # A hit of the one active job: the single-job rules, and nothing else (hit path).
        self._solo_hit(key)

    def _solo_hit(self, key: int) -> None:
        """A hit while one job reads: a file it already read this epoch starts the next."""
        last = self._last.get(key)
        if last is None:
            return
        if last == self.epoch and not self._explicit:
            self.epoch += 1
            log.debug("inferred the start of epoch %d", self.epoch)
        self._place(key, self.epoch)

    def _accessed(self, key: int, hit: bool, job: int) -> None:
        reads = self.reads
        if job not in reads.active:
            if len(reads.active) == 1:
                # A second job: bring the first one's row up to date (hits of one job
                # alone only touch the single-job state, to keep the hit path cheap).
                (first,) = reads.active
                self._sync_row(first, recount=False)  # join recounts
            reads.join(job, recount=len(reads.active) > 0)
            if len(reads.active) == 1:
                # The first job of an empty policy (or the next after one ended alone).
                self._sync_row(job)
            self._solo = job if len(reads.active) == 1 else -1
        if len(reads.active) > 1:
            if reads.read(key, job):
                log.debug("job %d: inferred the start of its epoch %d", job, reads.epoch[job])
            return
        if not hit:
            # One job: as before, only resident files tell epochs apart (its row in step).
            reads.read(key, job, infer=False)
            return
        self._solo_hit(key)

    def _sync_row(self, row: int, recount: bool = True) -> None:
        """Job `row` is the one job: its row takes the single-job state of resident keys
        (and the demand counts follow unless the caller recounts them itself)."""
        reads = self.reads
        reads.epoch[row] = self.epoch
        reads.explicit[row] = self._explicit
        slot_of = reads.slot_of
        slots = np.fromiter((slot_of[k] for k in self._last), np.int64, len(self._last))
        reads.last[row, slots] = np.fromiter(self._last.values(), np.int64, len(self._last))
        if recount:
            reads.recount()

    def begin_epoch(self, epoch: int, job: int | None = None) -> None:
        rows = list(self.reads.active) if job is None else [job]
        for row in rows:
            if row in self.reads.active:
                self.reads.announce(row, epoch)
        if job is None or not self.shared:
            self._explicit = True
            if epoch > self.epoch:
                self.epoch = epoch

    def job_ended(self, job: int) -> None:
        reads = self.reads
        was_shared = self.shared
        reads.leave(job)
        self._solo = next(iter(reads.active)) if len(reads.active) == 1 else -1
        if was_shared and len(reads.active) == 1:
            # Back to one job: its row becomes the single-job state (resident keys only).
            (row,) = reads.active
            self.epoch = int(reads.epoch[row])
            self._explicit = bool(reads.explicit[row])
            self._last.clear()
            self._buckets.clear()
            slots = reads.slot_of
            for key in sorted(self.sizes, key=lambda k: int(reads.last[row, slots[k]])):
                self._place(key, int(reads.last[row, slots[key]]))

    def job_epochs(self) -> dict[int, int]:
        return {row: int(self.reads.epoch[row]) for row in self.reads.active}

    def _stale(self) -> Iterator[int]:
        for e in sorted(self._buckets):
            if e >= self.epoch - 1:
                break
            yield from self._buckets[e]

    def _consumed(self) -> Iterator[int]:
        yield from self._buckets.get(self.epoch, ())

    def _protected(self) -> Iterator[int]:
        yield from self._buckets.get(self.epoch - 1, ())

    def admit(self, key: int, size: int, free: int) -> list[int] | None:
        keep = self.pending
        if self.shared:
            if keep is None:
                return self.reads.victims(size - free, self.reads.rank_of(key))
            below = None if keep(key) else self.reads.rank_of(key)
            return self.reads.victims(size - free, below, keep)
        if keep is None or size <= free:
            return take_prefix(self._stale(), self.sizes, size - free)
        # A known order's pending reads come first: kept, and worth a consumed entry.
        wanted = keep(key)
        order = chain(self._stale(), self._consumed()) if wanted else self._stale()
        return take_prefix((k for k in order if not keep(k)), self.sizes, size - free)

    def shrink(self, need: int) -> list[int]:
        if self.shared:
            return self.reads.victims(need, None) or []

        def order() -> Iterator[int]:
            yield from self._stale()
            yield from self._consumed()
            yield from self._protected()

        victims = take_prefix(order(), self.sizes, need)
        return list(order()) if victims is None else victims

    def describe(self) -> PolicyState:
        source = "sampler" if self._explicit else "inferred"
        if self.shared:
            # One epoch per job (stats.json `jobs`); here the furthest along.
            epoch = max(self.job_epochs().values())
            return replace(super().describe(), epoch=epoch, epoch_source="per-job")
        return replace(super().describe(), epoch=self.epoch, epoch_source=source)
