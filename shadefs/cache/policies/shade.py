"""The `shade` policy: SHADE's importance-aware admission and eviction (APP).

It keeps the samples the training job finds most important. It pays off with the
importance sampler, which replays resident samples (docs/design.md fact 2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import replace

from sortedcontainers import SortedList

from shadefs.cache.policies.base import Policy, lazy_walk, ranked_victims
from shadefs.stats import PolicyState


class ShadePolicy(Policy):
    """SHADE's APP: resident entries ordered by importance; a miss is admitted only if it is
    more important than the least important resident entries it replaces.

    Importance comes from `score(key)` (the importance table, which covers every sample,
    cached or not: the ghost table). Scores change whenever losses arrive; instead of
    re-sorting on every update, an entry sits in the sorted list under the score it had when
    last ranked, and is re-ranked when it reaches the bottom (a lazy priority queue). So a
    loss batch costs the policy nothing, and eviction does O(log n) work per re-ranked entry.
    Ties keep what is resident (strictly more important to get in), so equal scores mean no
    churn: with no losses reported yet this behaves like a static cache.

    With `pending`, an entry that this epoch's known order reads again ranks above every
    other (infinitely important) until its last read: a miss never evicts it, so each
    sample crosses the link at most once per epoch (a miss that will be read again ranks
    so too, and may evict only entries without reads to come).

    A new order releases what an old one still had to read: the kept entries are checked
    again, RECHECK of them before each admission or shrink (`_recheck`), never all at once:
    256 k kept entries took 0.5-1 s of the event loop. Until checked, an entry the new
    order no longer reads stays kept (for at most the first few hundred admissions).
    """

    name = "shade"
    RECHECK = 256  # kept entries checked again per admission after a new order

    def __init__(
        self, score: Callable[[int], float], pending: Callable[[int], bool] | None = None
    ) -> None:
        """`pending(key)`: whether a known order reads `key` again this epoch
        (readers/pending.py); such an entry ranks above every other."""
        super().__init__()
        self.score = score
        self.pending = pending
        self._ranked: SortedList = SortedList()
        self._rank_of: dict[int, float] = {}
        self._unchecked: list[tuple[float, int]] = []  # kept entries since a new order
        self._epoch_of: dict[int | None, int] = {}  # the latest order's epoch, per job

    def _rank(self, key: int) -> float:
        # An entry the epoch still reads is worth a hit this epoch, more than any entry it
        # could make room for: evicting it would fetch it again before the epoch ends.
        if self.pending is not None and self.pending(key):
            return math.inf
        return self.score(key)

    def _rerank(self, key: int) -> None:
        old = self._rank_of[key]
        new = self._rank(key)
        if new != old:
            self._ranked.remove((old, key))
            self._ranked.add((new, key))
            self._rank_of[key] = new

    def inserted(self, key: int, size: int) -> None:
        super().inserted(key, size)
        s = self._rank(key)
        self._rank_of[key] = s
        self._ranked.add((s, key))

    def removed(self, key: int) -> None:
        super().removed(key)
        s = self._rank_of.pop(key, None)
        if s is not None:
            self._ranked.remove((s, key))

    def accessed(self, key: int, hit: bool, job: int = 0) -> None:
        # Reads say nothing about importance under an importance sampler; the last read of
        # an entry the epoch was still to read makes it an ordinary entry again.
        if self._rank_of.get(key) == math.inf:
            self._rerank(key)

    def begin_epoch(self, epoch: int, job: int | None = None) -> None:
        # A new order replaced the pending reads: entries the old one still had to read are
        # no longer kept for it. (Those the new one reads are found stale by `_bottom`.)
        # Another rank's order of the same epoch releases nothing.
        if job is not None and self._epoch_of.get(job, -1) >= epoch:
            return
        self._epoch_of[job] = epoch
        top = self._ranked.bisect_left((math.inf, -math.inf))
        self._unchecked = list(self._ranked.islice(top))  # one C-level copy

    def job_ended(self, job: int) -> None:
        self._epoch_of.pop(job, None)  # its row may serve another job, from epoch 0

    def _recheck(self) -> None:
        """Check again up to RECHECK kept entries that a new order may have released."""
        batch = self._unchecked[-self.RECHECK :]
        del self._unchecked[-self.RECHECK :]
        for rank, key in batch:
            if self._rank_of.get(key) == rank:  # not removed or re-ranked since
                self._rerank(key)

    def _bottom(self) -> Iterator[tuple[float, int]]:
        """Entries from the least important up, each re-ranked to its current score first."""
        return lazy_walk(self._ranked, self._rank_of, self._rank, descending=False)

    def admit(self, key: int, size: int, free: int) -> list[int] | None:
        need = size - free
        if need <= 0:
            return []
        if self._unchecked:
            self._recheck()
        incoming = self._rank(key)
        return ranked_victims(self._bottom(), self.sizes, need, lambda s: s >= incoming)

    def shrink(self, need: int) -> list[int]:
        if self._unchecked:
            self._recheck()
        return ranked_victims(self._bottom(), self.sizes, need) or []

    def describe(self) -> PolicyState:
        d = super().describe()
        if not self._ranked:
            return d
        # Kept entries rank infinitely high; the scores shown are the others' (JSON has no
        # infinity, and looking up every kept entry's score would stall the event loop).
        top = self._ranked.bisect_left((math.inf, -math.inf))
        if top:
            low, high = self._ranked[0][0], self._ranked[top - 1][0]
            d = replace(d, min_score=round(low, 4), max_score=round(high, 4))
        return replace(d, kept=len(self._ranked) - top) if self.pending is not None else d
