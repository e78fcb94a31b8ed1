"""The `shade` policy: SHADE's importance-aware admission and eviction (APP).

It keeps the samples the training job finds most important. It pays off with the
importance sampler, which replays resident samples (DESIGN.md fact 2).
"""

from __future__ import annotations

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
    """

    name = "shade"

    def __init__(self, score: Callable[[int], float]) -> None:
        super().__init__()
        self.score = score
        self._ranked: SortedList = SortedList()
        self._rank_of: dict[int, float] = {}

    def inserted(self, key: int, size: int) -> None:
        super().inserted(key, size)
        s = self.score(key)
        self._rank_of[key] = s
        self._ranked.add((s, key))

    def removed(self, key: int) -> None:
        super().removed(key)
        s = self._rank_of.pop(key, None)
        if s is not None:
            self._ranked.remove((s, key))

    def accessed(self, key: int, hit: bool, job: int = 0) -> None:
        pass  # reads say nothing about importance under an importance sampler

    def _bottom(self) -> Iterator[tuple[float, int]]:
        """Entries from the least important up, each re-ranked to its current score first."""
        return lazy_walk(self._ranked, self._rank_of, self.score, descending=False)

    def admit(self, key: int, size: int, free: int) -> list[int] | None:
        need = size - free
        if need <= 0:
            return []
        incoming = self.score(key)
        return ranked_victims(self._bottom(), self.sizes, need, lambda s: s >= incoming)

    def shrink(self, need: int) -> list[int]:
        return ranked_victims(self._bottom(), self.sizes, need) or []

    def describe(self) -> PolicyState:
        d = super().describe()
        if not self._ranked:
            return d
        low, high = round(self._ranked[0][0], 4), round(self._ranked[-1][0], 4)
        return replace(d, min_score=low, max_score=high)
