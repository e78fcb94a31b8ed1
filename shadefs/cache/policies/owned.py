"""Ownership-aware admission: in a multi-node job a node caches mainly what it owns.

Each node of a job that spans several nodes owns a distinct part of the dataset
(``shadefs.sampling.placement.owners``).  ``Owned`` wraps any policy: a sample the node does
not own (a guest) is admitted only into free room and never evicts anything, and an owned
miss that needs room takes it from the guests that were read since the epoch began first
(oldest first), then lets the inner policy choose among the rest, unread guests included.
A guest still to be read this epoch is one of this node's hits (the epoch's shares send it
here), so it goes once it has served them.  So the nodes' caches converge on disjoint
parts, and N nodes with a fraction f each act as one cache of N·f.

Outside a multi-node job ``owns`` says yes to everything and the hit path is not
lengthened: ``accessed`` is the inner policy's bound method itself until ``reclassify``
(ownership became known) switches to the method that notes reads of guests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from shadefs.cache.policies.base import Policy, take_prefix
from shadefs.stats import PolicyState


class Owned(Policy):
    """`inner`, with admission restricted to the keys `owns` accepts (see the module)."""

    def __init__(self, inner: Policy, owns: Callable[[int], bool]) -> None:
        super().__init__()
        self.inner = inner
        self.owns = owns
        self.name = inner.name
        self.sizes = inner.sizes  # one table of resident sizes, the inner policy's
        self.accessed = inner.accessed  # type: ignore[method-assign]  # no extra frame on a hit
        # Resident keys this node does not own, oldest first (a dict keeps insertion order),
        # and those of them read since the epoch began.
        self.guests: dict[int, None] = {}
        self.read: dict[int, None] = {}

    def __getattr__(self, name: str) -> Any:
        # Policy-specific state (an epoch policy's epoch, for instance) is the inner one's.
        return getattr(self.__dict__["inner"], name)

    def accessed(self, key: int, hit: bool, job: int = 0) -> None:  # replaced per instance
        self.inner.accessed(key, hit, job)
        if key in self.guests:
            self.read[key] = None

    def accessed_many(self, keys: list[int], job: int, ids: np.ndarray, ranks: np.ndarray) -> None:
        self.inner.accessed_many(keys, job, ids, ranks)
        guests = self.guests
        if guests:
            for key in keys:
                if key in guests:
                    self.read[key] = None

    def inserted(self, key: int, size: int) -> None:
        self.inner.inserted(key, size)
        if not self.owns(key):
            self._guest(key)
            self.read[key] = None  # admitted because a reader just read it

    def restored(self, key: int, size: int) -> None:
        self.inner.restored(key, size)
        if not self.owns(key):
            self._guest(key)

    def _guest(self, key: int) -> None:
        self.guests[key] = None
        # Ownership is in force (a policy made after it was installed): note reads.
        self.__dict__.pop("accessed", None)

    def removed(self, key: int) -> None:
        self.inner.removed(key)
        self.guests.pop(key, None)
        self.read.pop(key, None)

    def reclassify(self, guests: list[int] | None = None) -> None:
        """Ownership changed (a job's nodes became known or changed): sort the resident
        entries into owned and guests again, the oldest guests first as before. `guests`:
        the resident keys not owned, in the order of `sizes`, if computed already (in a
        worker thread: asking `owns` of every entry holds the event loop 0.5 s at 256 k)."""
        if guests is None:
            guests = [key for key in self.sizes if not self.owns(key)]
        sizes = self.sizes
        self.guests = {key: None for key in guests if key in sizes}
        self.read = {}
        self.__dict__.pop("accessed", None)  # from now on the class's method notes reads

    def admit(self, key: int, size: int, free: int) -> list[int] | None:
        if not self.owns(key):
            return [] if size <= free else None
        need = size - free
        if need <= 0 or not self.read:
            return self.inner.admit(key, size, free)
        victims = take_prefix(self.read, self.sizes, need)
        if victims is not None:
            return victims
        # Every read guest goes, and the inner policy finds the rest among the others.
        victims = list(self.read)
        freed = sum(self.sizes[v] for v in victims)
        more = self.inner.admit(key, size, free + freed)
        if more is None:
            return None
        return victims + [v for v in more if v not in self.read]

    def shrink(self, need: int) -> list[int]:
        victims = take_prefix(self.guests, self.sizes, need)
        if victims is not None:
            return victims
        victims = list(self.guests)
        need -= sum(self.sizes[v] for v in victims)
        return victims + [v for v in self.inner.shrink(need) if v not in self.guests]

    def begin_epoch(self, epoch: int, job: int | None = None) -> None:
        self.inner.begin_epoch(epoch, job)
        self.read = {}

    def describe(self) -> PolicyState:
        return self.inner.describe()
