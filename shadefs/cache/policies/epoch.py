"""The `epoch` policy, the default: keep what has not been read this epoch.

Under shuffled epochs every file is read once per epoch, so the best any demand cache can
do is keep a fixed set until it has been read this epoch (hit ratio f = cache/dataset, the
bound that Belady's MIN also reaches), while LRU thrashes (DESIGN.md fact 1).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace

from shadefs.cache.policies.base import Policy, take_prefix
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
    """

    name = "epoch"

    def __init__(self) -> None:
        super().__init__()
        self.epoch = 0
        self._explicit = False
        self._last: dict[int, int] = {}
        # Insertion-ordered buckets of keys by the epoch of their last read.
        self._buckets: dict[int, dict[int, None]] = {}

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

    def restored(self, key: int, size: int) -> None:
        # Found on disk after a restart: nothing says it was read this epoch, so it is
        # protected until it is (and its first read must not look like a new epoch).
        Policy.inserted(self, key, size)
        self._place(key, self.epoch - 1)

    def removed(self, key: int) -> None:
        super().removed(key)
        self._unplace(key)

    def accessed(self, key: int, hit: bool) -> None:
        if not hit:
            return
        last = self._last.get(key)
        if last is None:
            return
        if last == self.epoch and not self._explicit:
            self.epoch += 1
            log.debug("inferred the start of epoch %d", self.epoch)
        self._place(key, self.epoch)

    def begin_epoch(self, epoch: int) -> None:
        self._explicit = True
        if epoch > self.epoch:
            self.epoch = epoch

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
        return take_prefix(self._stale(), self.sizes, size - free)

    def shrink(self, need: int) -> list[int]:
        def order() -> Iterator[int]:
            yield from self._stale()
            yield from self._consumed()
            yield from self._protected()

        victims = take_prefix(order(), self.sizes, need)
        return list(order()) if victims is None else victims

    def describe(self) -> PolicyState:
        source = "sampler" if self._explicit else "inferred"
        return replace(super().describe(), epoch=self.epoch, epoch_source=source)
