"""The `shade` policy: SHADE's importance-aware admission and eviction (APP).

It keeps the samples the training job finds most important. It pays off with the
importance sampler, which replays resident samples (DESIGN.md fact 2).
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
    """

    name = "shade"

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
        top = self._ranked.bisect_left((math.inf, -math.inf))
        for _, key in list(self._ranked[top:]):
            self._rerank(key)

    def _bottom(self) -> Iterator[tuple[float, int]]:
        """Entries from the least important up, each re-ranked to its current score first."""
        return lazy_walk(self._ranked, self._rank_of, self._rank, descending=False)

    def admit(self, key: int, size: int, free: int) -> list[int] | None:
        need = size - free
        if need <= 0:
            return []
        incoming = self._rank(key)
        return ranked_victims(self._bottom(), self.sizes, need, lambda s: s >= incoming)

    def shrink(self, need: int) -> list[int]:
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
