"""Bytes that open file handles keep alive outside the RAM tier's budget.

An open handle holds the bytes it opened, not the cache entry (docs/developer-notes.md,
invariant 6): eviction drops the cache's reference and the bytes live on until `release`.
Without a bound, many long-open handles could keep any amount of evicted data alive above
`--ram`. This ledger counts, per distinct bytes object, how many handles hold it, and which
of those objects the RAM tier no longer holds. `held` is what the handles alone keep alive:
the memory the budget does not see, plus the sizes of deferred opens (cache/deferred.py) that
their first read will fetch, reserved at the open so that the limit holds once they have.
Past the cache's limit, the coordinator serves new opens of uncached files without keeping
a copy (pass-through reads), so `held` stays bounded.

Bytes objects are told apart by identity: while a pin exists its handle references the
object, so the id cannot be reused. Pinning sits on the hit path (every open and release),
so it is two dict operations on ints and allocates nothing. Everything here runs in the trio
thread.
"""

from __future__ import annotations

from shadefs.kernel.pages import KernelPages
from shadefs.stats import HandleStats

__all__ = ["HandleLedger"]


class HandleLedger:
    """Which bytes objects open handles reference, and how many of those bytes only they do.

    :held: bytes referenced by open handles and not by the RAM tier
    :handles: open handles that hold bytes
    """

    __slots__ = ("_count", "_outside", "held", "handles", "deferred", "unread", "kernel")

    def __init__(self, kernel: KernelPages | None = None) -> None:
        self._count: dict[int, int] = {}  # id(bytes) -> handles holding it
        self._outside: dict[int, int] = {}  # id(bytes) -> size, for pinned bytes not in RAM
        self.held = 0
        self.handles = 0
        self.deferred = 0  # opens answered before their fetch (cache/deferred.py)
        self.unread = 0  # of those, released without a read: nothing fetched
        # What the kernel may serve itself (deferred opens): the service's one map.
        self.kernel = kernel if kernel is not None else KernelPages()

    def pin(self, data: bytes, resident: bool) -> None:
        """A handle now holds `data`; `resident` says whether the RAM tier holds it too."""
        k = id(data)
        n = self._count.get(k)
        if n is None:
            self._count[k] = 1
            if not resident:
                self._outside[k] = len(data)
                self.held += len(data)
        else:
            self._count[k] = n + 1
        self.handles += 1

    def pin_resident(self, data: bytes) -> None:
        """`pin(data, True)`: a handle now holds `data`, which the RAM tier holds (a hit)."""
        count = self._count
        k = id(data)
        count[k] = count.get(k, 0) + 1
        self.handles += 1

    def unpin(self, data: bytes) -> None:
        """A handle that held `data` was released."""
        k = id(data)
        n = self._count.get(k)
        if n is None:
            return
        self.handles -= 1
        if n > 1:
            self._count[k] = n - 1
            return
        del self._count[k]
        if self._outside:  # (mostly empty: bytes that the RAM tier dropped while held)
            size = self._outside.pop(k, None)
            if size is not None:
                self.held -= size

    def evicted(self, data: bytes) -> None:
        """The RAM tier dropped `data`: from now on only its handles keep it alive."""
        k = id(data)
        if k in self._count and k not in self._outside:
            self._outside[k] = len(data)
            self.held += len(data)

    def admitted(self, data: bytes) -> None:
        """The RAM tier holds `data` (again): its handles no longer add to the memory used."""
        size = self._outside.pop(id(data), None)
        if size is not None:
            self.held -= size

    def reserve(self, size: int) -> None:
        """A deferred open will hold `size` bytes once read: count them from now."""
        self.held += size

    def unreserve(self, size: int) -> None:
        """A deferred open was read (its bytes are pinned instead) or released unread."""
        self.held -= size

    def describe(self, limit: int, passthrough_opens: int) -> HandleStats:
        return HandleStats(
            bytes=self.held,
            limit=limit,
            open=self.handles,
            passthrough_opens=passthrough_opens,
            deferred=self.deferred,
            unread=self.unread,
        )
