"""The `epoch` policy, the default: keep what the jobs have not read this epoch.

Under shuffled epochs every file is read once per epoch, so the best any demand cache can
do is keep a fixed set until it has been read this epoch (hit ratio f = cache/dataset, the
bound that Belady's MIN also reaches), while LRU thrashes (DESIGN.md fact 1).

The policy is a pure ranker over the readers' tracker (readers/tracker.py), which alone
knows each job's epoch and what it read: an entry's rank is the number of active jobs that
still want it this epoch, then the number that consumed it (they read it again next
epoch). With one job that is: stale (not read for a whole epoch) first, then consumed
(read this epoch), then protected (read last epoch, to be read in this one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from shadefs.cache.policies.base import Policy
from shadefs.readers.tracker import Tracker
from shadefs.stats import PolicyState

log = logging.getLogger(__name__)


class EpochPolicy(Policy):
    """Keep what the active jobs still read this epoch; evict what nobody wants first.

    Resident entries sit in buckets by rank (the tracker's `rank`: want, then done). A
    miss is admitted only in place of entries of a lower rank than its own (so never
    swapped for an entry as wanted as itself: pure churn), lowest rank first, oldest first
    within a rank; shrinking takes the lowest ranks first. A read moves one entry between
    buckets (O(1)); when the tracker recounts (a job's new epoch, a job joining or
    leaving: its `generation` moves) the policy re-ranks its entries in numpy, once.

    With `pending` (the reads the known orders still make, readers/pending.py), an entry
    with reads to come is never evicted for a miss without, and such a miss may replace
    any entry without.
    """

    name = "epoch"

    def __init__(
        self, tracker: Tracker | None = None, pending: Callable[[int], bool] | None = None
    ) -> None:
        super().__init__()
        self.tracker = tracker if tracker is not None else Tracker()
        self.pending = pending
        # Resident ids in the order they became resident (oldest first within a rank),
        # and per id the rank of its bucket (-1: not resident here), read through a
        # memoryview (Python ints, as fast as a dict on the hit path; a re-rank writes the
        # numpy column in one go instead of building a dict of every entry).
        self._order: dict[int, None] = {}
        self._rankv = np.full(64, -1, dtype=np.int64)
        self._rank = self._rankv.data
        self._buckets: dict[int, dict[int, None]] = {}  # rank -> resident ids, oldest first
        self._generation = self.tracker.generation

    @property
    def epoch(self) -> int:
        """The furthest epoch of the active jobs (the one job's, alone)."""
        t = self.tracker
        return max(t.epochs_of().values(), default=t.start_epoch)

    @property
    def shared(self) -> bool:
        """Whether more than one job is active."""
        return len(self.tracker.active) > 1

    # --- buckets -------------------------------------------------------------------------

    def _rank_of(self, i: int) -> int:
        """The rank of resident id `i`'s bucket, -1 if it is not resident here."""
        return self._rank[i] if i < len(self._rankv) else -1

    def _place(self, i: int, r: int) -> None:
        """Put resident id `i` in the bucket of rank `r`."""
        if i >= len(self._rankv):
            grown = np.full(max(len(self.tracker.keys), i + 1), -1, dtype=np.int64)
            grown[: len(self._rankv)] = self._rankv
            self._rankv, self._rank = grown, grown.data
        old = self._rank[i]
        if old == r:
            return
        if old >= 0:
            self._unbucket(i, old)
        else:
            self._order[i] = None
        bucket = self._buckets.get(r)
        if bucket is None:
            bucket = self._buckets[r] = {}
        bucket[i] = None
        self._rank[i] = r

    def _unbucket(self, i: int, rank: int) -> None:
        bucket = self._buckets[rank]
        del bucket[i]
        if not bucket:
            del self._buckets[rank]
        self._rank[i] = -1

    def _fresh(self) -> None:
        """Re-rank every resident entry if the tracker recounted since the last look."""
        t = self.tracker
        if self._generation == t.generation:
            return
        self._generation = t.generation
        live = np.fromiter(self._order, dtype=np.int64, count=len(self._order))
        rank = t.rank_ids(live)
        self._rankv[live] = rank
        # One dict per distinct rank (a handful), filled at C speed.
        ranks = np.unique(rank).tolist()
        self._buckets = {r: dict.fromkeys(live[rank == r].tolist()) for r in ranks}

    # --- what the cache tells ------------------------------------------------------------

    def inserted(self, key: int, size: int) -> None:
        super().inserted(key, size)
        self._fresh()
        t = self.tracker
        i = t.id(key)
        self._place(i, t.rank(i))

    def restored(self, key: int, size: int) -> None:
        # Found on disk after a restart: not a read, so every job still wants it.
        self.inserted(key, size)

    def removed(self, key: int) -> None:
        super().removed(key)
        i = self.tracker.id_of.get(key)
        if i is not None and self._rank_of(i) >= 0:
            self._unbucket(i, self._rank[i])
            del self._order[i]

    def accessed(self, key: int, hit: bool, job: int = 0) -> None:
        # The tracker has taken the read in (the cache told it first): move the entry to
        # the bucket of its new rank, which the tracker computed with the read.
        t = self.tracker
        if self._generation != t.generation:
            self._fresh()
        if key == t.read_key:
            i, r = t.read_id, t.read_rank
            old = self._rank_of(i)
            if old < 0 or old == r:
                return  # not resident here, or its rank did not move (a replay)
        else:
            j = t.id_of.get(key)
            if j is None or self._rank_of(j) < 0:
                return
            i, r = j, t.rank(j)
        self._place(i, r)

    # --- what the cache asks -------------------------------------------------------------

    def _victims(
        self, need: int, below: int | None, kept: Callable[[int], bool] | None = None
    ) -> list[int] | None:
        """Keys to evict, lowest rank first, that free `need` bytes; only ranks < `below`
        when given (None if they do not free enough); everything there is when shrinking.
        With `kept(key)`, the keys it holds are never victims (pending reads)."""
        if need <= 0:
            return []
        keys, sizes = self.tracker.keys, self.sizes
        victims: list[int] = []
        for r in sorted(self._buckets):
            if below is not None and r >= below:
                break
            for i in self._buckets[r]:
                key = int(keys[i])
                if kept is not None and kept(key):
                    continue
                victims.append(key)
                need -= sizes[key]
                if need <= 0:
                    return victims
        return None if below is not None or kept is not None else victims

    def admit(self, key: int, size: int, free: int) -> list[int] | None:
        if size <= free:
            return []
        self._fresh()
        rank = self.tracker.rank(self.tracker.id(key))
        keep = self.pending
        if keep is None:
            return self._victims(size - free, rank)
        # A known order's pending reads come first: kept, and worth any entry without.
        return self._victims(size - free, None if keep(key) else rank, keep)

    def shrink(self, need: int) -> list[int]:
        self._fresh()
        return self._victims(need, None) or []

    def describe(self) -> PolicyState:
        t = self.tracker
        if len(t.active) > 1:
            # One epoch per job (stats.json `jobs`); here the furthest along.
            return replace(super().describe(), epoch=self.epoch, epoch_source="per-job")
        explicit = bool(t.explicit[next(iter(t.active))]) if t.active else t.start_explicit
        source = "sampler" if explicit else "inferred"
        return replace(super().describe(), epoch=self.epoch, epoch_source=source)
