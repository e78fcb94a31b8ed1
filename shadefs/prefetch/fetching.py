"""What the prefetcher and the cache agree on: a fetch call's items and results, the tiers
it is told of, and the mount's prefetch settings.

The cache owns the prefetcher (cache/coordinator.py) and hands it callables of these types;
the SSD tier hands back the entries it holds as the same `Got`s (cache/ssd/tier.py), and the
cache fetches the rest. So neither side imports the other's module for them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from shadefs.file_version import Signature

__all__ = ["RAM", "SSD", "FetchAhead", "Got", "Item", "Of", "PrefetchSettings"]

Item = tuple[int, bytes, int]  # a fetch's (key, path, size)
# The cache's fetch for the prefetcher, of items in one source call: per item (bytes,
# signature), its error, or None when a reader is already fetching the file (the reader
# will cache it); and the source's seconds per file.
Got = tuple[bytes, Signature] | BaseException | None
FetchAhead = Callable[[Sequence[Item]], Awaitable[tuple[list[Got], float]]]
Of = Callable[[int], int]  # of a key: its tier (0: not cached), or its reads still to come
RAM, SSD = 1, 2  # tiers: a file in RAM needs no staging, one on the SSD is read from there


@dataclass(frozen=True)
class PrefetchSettings:
    """How much the prefetcher may stage and fetch at once (the mount's --prefetch-*)."""

    window: int  # bytes staged or in flight
    max_workers: int = 16
    abandon_after: float = 60.0  # seconds without progress before a plan is dropped
