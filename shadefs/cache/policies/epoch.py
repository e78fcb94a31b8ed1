"""The `epoch` policy, the default: keep what the jobs have not read this epoch.

Under shuffled epochs every file is read once per epoch, so the best any demand cache can
do is keep a fixed set until it has been read this epoch (hit ratio f = cache/dataset, the
bound that Belady's MIN also reaches), while LRU thrashes (docs/design.md fact 1).

The policy is a pure ranker over the readers' tracker (readers/tracker.py), which alone
knows each job's epoch and what it read: an entry's rank is the number of active jobs that
still want it this epoch, then the number that consumed it (they read it again next
epoch). With one job that is: stale (not read for a whole epoch) first, then consumed
(read this epoch), then protected (read last epoch, to be read in this one).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from shadefs.cache.policies.base import Policy
from shadefs.cache.policies.buckets import RankBuckets
from shadefs.readers.tracker import Tracker
from shadefs.stats import PolicyState

log = logging.getLogger(__name__)

_MOVES = 8192  # log entries (two a read) at most before their moves are taken in


class EpochPolicy(Policy):
    """Keep what the active jobs still read this epoch; evict what nobody wants first.

    Resident entries sit in buckets by rank (the tracker's `rank`: want, then done). A
    miss is admitted only in place of entries of a lower rank than its own (so never
    swapped for an entry as wanted as itself: pure churn), lowest rank first, oldest first
    within a rank; shrinking takes the lowest ranks first. A read moves one entry between
    buckets (O(1)); when the tracker recounts (a job's new epoch, a job joining or
    leaving: its `generation` moves) the policy re-ranks its entries in numpy, once, with
    no Python object per entry (buckets.py).

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
        # Resident ids by rank, oldest first within one (numpy columns and logs: a
        # re-rank rebuilds them in numpy, no Python object per entry).
        self._buckets = RankBuckets()
        self._generation = self.tracker.generation
        # The reads since the buckets last took their moves in (`_fresh`): a read logs its
        # id and its rank then, and any other call moves them all in numpy first (a warm
        # open's move, one at a time, cost ~2 us of CPU per open in the daemon).
        self._moved: array[int] = array("q")

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

    def _fresh(self) -> None:
        """Re-rank every resident entry if the tracker recounted since the last look, else
        move the entries read since to the buckets of their ranks now."""
        t = self.tracker
        if self._generation == t.generation:
            if self._moved:
                moved, self._moved = self._moved, array("q")
                pairs = np.frombuffer(moved, dtype=np.int64)
                self._buckets.move_many(pairs[0::2], pairs[1::2])
            return
        self._generation = t.generation
        self._moved = array("q")  # (the re-rank gives every entry its rank now)
        self._buckets.reserve(len(t.keys))
        self._buckets.rerank(t.rank_ids)

    # --- what the cache tells ------------------------------------------------------------

    def inserted(self, key: int, size: int) -> None:
        super().inserted(key, size)
        # The logged moves need not be taken in first (a numpy call per miss): they are of
        # resident ids only, and `removed` took them in, so none is of this id.
        if self._generation != self.tracker.generation:
            self._fresh()
        t = self.tracker
        i = t.id(key)
        self._buckets.reserve(len(t.keys))  # at once: see buckets.py
        self._buckets.place(i, t.rank(i))

    def restored(self, key: int, size: int) -> None:
        # Found on disk after a restart: not a read, so every job still wants it.
        self.inserted(key, size)

    def removed(self, key: int) -> None:
        super().removed(key)
        i = self.tracker.id_of.get(key)
        if i is not None:
            if self._moved:
                # Its logged moves go first: re-admitted later, it must not take them.
                self._fresh()
            self._buckets.drop(i)

    def accessed(self, key: int, hit: bool, job: int = 0) -> None:
        # The tracker has taken the read in (the cache told it first): the entry moves to
        # the bucket of its new rank at the next call that reads the buckets (`_fresh`),
        # or once the log is full. Only an entry whose rank moved changes place.
        if not hit:
            return  # not resident: no entry to move (and `inserted` ranks it afresh)
        t = self.tracker
        if self._generation != t.generation:
            self._fresh()  # (the moves logged before the recount are the re-rank's)
        moved = self._moved
        if key == t.read_key:
            moved.append(t.read_id)
            moved.append(t.read_rank)
        else:
            j = t.id_of.get(key)
            if j is None:
                return
            moved.append(j)
            moved.append(t.rank(j))
        if len(moved) >= _MOVES:
            self._fresh()

    def accessed_many(self, keys: list[int], job: int, ids: np.ndarray, ranks: np.ndarray) -> None:
        # Logged as `accessed` logs them one by one (the tracker recounted nothing: a batch
        # it took in begins no epoch).
        if self._generation != self.tracker.generation:
            self._fresh()
        pairs = np.empty(2 * len(ids), dtype=np.int64)
        pairs[0::2] = ids
        pairs[1::2] = ranks
        self._moved.frombytes(pairs.tobytes())
        if len(self._moved) >= _MOVES:
            self._fresh()

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
        for i in self._buckets.walk(below):
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
