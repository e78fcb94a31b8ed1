"""The `belady` policy: Belady's MIN whenever the future order is known (docs/design.md fact 3)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from sortedcontainers import SortedList

from shadefs.cache.policies.base import Policy, lazy_walk, ranked_victims


class BeladyPolicy(Policy):
    """Belady's MIN on a known order: evict what is needed furthest in the future.

    `next_use(key)` estimates when `key` is read next: a monotonic time from the prefetch
    plans, or any quantity that grows with distance in a known order. Keys that no plan
    reads again are infinitely far. The rule (Lobster): never evict an entry whose next
    use comes before that of the entry being brought in. A miss whose own next use is
    furthest is not admitted at all (MIN with bypass). With no known order, every key is
    infinitely far, nothing is ever displaced, and the cache keeps what it filled up with.

    Entries sit in a sorted list under the estimate they had when last ranked. Estimates
    only move when a key is read (its next use jumps to the following occurrence) or when
    the readers' rates change, so each entry is re-ranked when read, and the furthest
    entry is checked again before it is evicted (a lazy priority queue).
    """

    name = "belady"

    def __init__(self, next_use: Callable[[int], float]) -> None:
        super().__init__()
        self.next_use = next_use
        self._ranked: SortedList = SortedList()
        self._rank_of: dict[int, float] = {}

    def _rank(self, key: int) -> None:
        old = self._rank_of.get(key)
        if old is not None:
            self._ranked.remove((old, key))
        t = self.next_use(key)
        self._rank_of[key] = t
        self._ranked.add((t, key))

    def inserted(self, key: int, size: int) -> None:
        super().inserted(key, size)
        self._rank(key)

    def removed(self, key: int) -> None:
        super().removed(key)
        t = self._rank_of.pop(key, None)
        if t is not None:
            self._ranked.remove((t, key))

    def accessed(self, key: int, hit: bool, job: int = 0) -> None:
        if key in self._rank_of:
            self._rank(key)

    def _furthest(self) -> Iterator[tuple[float, int]]:
        """Entries from the furthest next use down, each re-checked before it is offered."""
        return lazy_walk(self._ranked, self._rank_of, self.next_use, descending=True)

    def admit(self, key: int, size: int, free: int) -> list[int] | None:
        need = size - free
        if need <= 0:
            return []
        incoming = self.next_use(key)
        # Everything from the first entry needed no later than the newcomer on must stay.
        return ranked_victims(self._furthest(), self.sizes, need, lambda t: not t > incoming)

    def shrink(self, need: int) -> list[int]:
        return ranked_victims(self._furthest(), self.sizes, need) or []
