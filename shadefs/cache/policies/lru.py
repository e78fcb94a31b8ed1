"""The `lru` policy: the baseline that shuffled epochs defeat (about f^2/2 hits)."""

from __future__ import annotations

from collections import OrderedDict

from shadefs.cache.policies.base import Policy, take_prefix


class LruPolicy(Policy):
    """Least recently used, over bytes: always admit, evict the oldest access first."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._order: OrderedDict[int, None] = OrderedDict()

    def inserted(self, key: int, size: int) -> None:
        super().inserted(key, size)
        self._order[key] = None

    def removed(self, key: int) -> None:
        super().removed(key)
        self._order.pop(key, None)

    def accessed(self, key: int, hit: bool, job: int = 0) -> None:
        if hit and key in self._order:
            self._order.move_to_end(key)

    def admit(self, key: int, size: int, free: int) -> list[int] | None:
        return take_prefix(iter(self._order), self.sizes, size - free)

    def shrink(self, need: int) -> list[int]:
        victims = take_prefix(iter(self._order), self.sizes, need)
        return list(self._order) if victims is None else victims
