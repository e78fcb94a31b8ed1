"""Bytes that open file handles keep alive outside the RAM tier's budget.

An open handle holds the bytes it opened, not the cache entry (docs/developer-notes.md,
invariant 6): eviction drops the cache's reference and the bytes live on until `release`.
Without a bound, many long-open handles could keep any amount of evicted data alive above
`--ram`. This ledger counts, per distinct bytes object, how many handles hold it and whether
the RAM tier still holds it too. `held` is what the handles alone keep alive: the memory the
budget does not see. Past `limit`, the coordinator serves new opens of non-resident files
without keeping a copy (pass-through reads), so `held` stays bounded.

Bytes objects are told apart by identity: while a pin exists its handle references the
object, so the id cannot be reused. Everything here runs in the trio thread.
"""

from __future__ import annotations

__all__ = ["HandleLedger"]


class _Pin:
    __slots__ = ("count", "size", "resident")

    def __init__(self, size: int, resident: bool) -> None:
        self.count = 0
        self.size = size
        self.resident = resident


class HandleLedger:
    """Which bytes objects open handles reference, and how many of those bytes only they do.

    :held: bytes referenced by open handles and not by the RAM tier
    :handles: open handles that hold bytes
    """

    def __init__(self) -> None:
        self._pins: dict[int, _Pin] = {}
        self.held = 0
        self.handles = 0

    def pin(self, data: bytes, resident: bool) -> None:
        """A handle now holds `data`; `resident` says whether the RAM tier holds it too."""
        pin = self._pins.get(id(data))
        if pin is None:
            pin = self._pins[id(data)] = _Pin(len(data), resident)
            if not resident:
                self.held += pin.size
        pin.count += 1
        self.handles += 1

    def unpin(self, data: bytes) -> None:
        """A handle that held `data` was released."""
        pin = self._pins.get(id(data))
        if pin is None:
            return
        pin.count -= 1
        self.handles -= 1
        if pin.count == 0:
            del self._pins[id(data)]
            if not pin.resident:
                self.held -= pin.size

    def evicted(self, data: bytes) -> None:
        """The RAM tier dropped `data`: from now on only its handles keep it alive."""
        pin = self._pins.get(id(data))
        if pin is not None and pin.resident:
            pin.resident = False
            self.held += pin.size

    def admitted(self, data: bytes) -> None:
        """The RAM tier holds `data` (again): its handles no longer add to the memory used."""
        pin = self._pins.get(id(data))
        if pin is not None and not pin.resident:
            pin.resident = True
            self.held -= pin.size
