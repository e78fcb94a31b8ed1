"""Random reads inside block-cached files: fetch the range asked for, not the whole block.

A block-cached file (cache/blocks.py) is read either as a stream (tar shards, a sequential
scan) or at random offsets (LMDB, HDF5, np.memmap, Parquet footers and column chunks). A
sequential reader is served whole blocks with read-ahead. A random reader of a block that
the RAM tier will not keep would pay a whole block (8 MiB) per small read, loaded and then
refused or evicting another: 1,000 random 4 KiB reads over 4 x 12 MiB files with 14 MiB of
RAM pulled 2 GiB from the source. So, per open file:

- **Sequential or random.** A read that starts where the previous read of its handle ended
  continues a stream; the start of the file counts as the end of a read. The kernel sends
  a streaming reader's reads in order and back to back (at its read-ahead size,
  `read_ahead_kb`), and a random reader's at the size asked, rounded to pages. A handle
  streams from its second read in a row that continues the last (its first at offset 0):
  one random read that happens to follow another does not buy a block and its read-ahead.
- **Extents.** A random read of a block that is not resident fetches the asked range
  rounded out to a grid of `EXTENT` bytes (32 KiB, a quarter of the kernel's default
  read-ahead of 128 KiB): a 4 KiB read costs one 32 KiB source read. The extents are kept
  in a small LRU (`Extents`) keyed by block and extent index, checked against the file's
  signature, so that a reader that comes back near where it was reads from memory. They
  count against the block read-ahead window, like staged blocks: bytes outside the RAM
  budget that the window bounds (a quarter of it at most).
- **When a whole block is worth it.** The whole block is loaded anyway when the RAM tier has
  free room for it (it will be admitted without evicting anything), or on a block's second
  random touch when the blocks that random readers touch all fit in half the RAM budget
  (the working set fits: the block will stay). The touch log remembers twice as many
  blocks as the budget holds, so it forgets a working set the readers left. Otherwise the
  block would only thrash.

Everything here runs in the trio thread and never awaits; blocks.py does the reads.
"""

from __future__ import annotations

from collections import OrderedDict

from shadefs.cache.ssd_format import Signature

__all__ = ["EXTENT", "Extents", "TouchLog", "extent_span", "streak"]

EXTENT = 32 << 10


class Extents:
    """Fetched extents of random reads, least recently used first, within `limit` bytes."""

    __slots__ = ("_items", "bytes", "limit", "hits")

    def __init__(self, limit: int) -> None:
        self._items: OrderedDict[tuple[int, int], tuple[Signature, bytes]] = OrderedDict()
        self.bytes = 0
        self.limit = limit
        self.hits = 0

    def get(self, bkey: int, index: int, sig: Signature) -> bytes | None:
        item = self._items.get((bkey, index))
        if item is None:
            return None
        if item[0] != sig:
            self._drop((bkey, index))
            return None
        self._items.move_to_end((bkey, index))
        return item[1]

    def span(self, bkey: int, first: int, stop: int, sig: Signature) -> bytes | None:
        """Extents first..stop-1 of a block joined, or None unless every one is kept."""
        got = []
        for x in range(first, stop):
            data = self.get(bkey, x, sig)
            if data is None:
                return None
            got.append(data)
        self.hits += 1
        return got[0] if len(got) == 1 else b"".join(got)

    def store(self, bkey: int, first: int, sig: Signature, data: bytes, extent: int) -> None:
        """Keep `data`, fetched from extent `first` on, as extents of `extent` bytes."""
        for x in range(-(-len(data) // extent)):
            self.put(bkey, first + x, sig, data[x * extent : (x + 1) * extent])

    def put(self, bkey: int, index: int, sig: Signature, data: bytes) -> None:
        """Keep `data` (one extent), dropping the least recently used beyond the limit."""
        k = (bkey, index)
        if k in self._items:
            self._drop(k)
        if len(data) > self.limit:
            return
        while self._items and self.bytes + len(data) > self.limit:
            self._drop(next(iter(self._items)))
        self._items[k] = (sig, data)
        self.bytes += len(data)

    def _drop(self, k: tuple[int, int]) -> None:
        _, data = self._items.pop(k)
        self.bytes -= len(data)


class TouchLog:
    """How often random readers touched each block lately (bounded: oldest forgotten)."""

    __slots__ = ("_touches",)

    def __init__(self) -> None:
        self._touches: OrderedDict[int, int] = OrderedDict()

    def worth_whole(self, bkey: int, n: int, bs: int, capacity: int, used: int) -> bool:
        """Count a random touch of `bkey` (n bytes); whether loading it whole pays: the RAM
        tier has free room for it, or it is touched again and the blocks touched lately
        fit in half the budget. The log remembers twice the blocks the budget holds."""
        touches = self._touches.pop(bkey, 0) + 1
        self._touches[bkey] = touches
        while len(self._touches) > max(2 * capacity // bs, 1):
            self._touches.popitem(last=False)
        if capacity - used >= n:
            return True  # admitted without evicting anything
        return touches >= 2 and len(self._touches) * bs <= capacity // 2

    def __len__(self) -> int:
        return len(self._touches)


def streak(prev: int, next_off: int, off: int) -> int:
    """A handle's run of reads that each continued the previous one, after a read at `off`
    (`next_off`: where the last ended; a fresh handle has run 1 and next_off 0). The read is
    part of a stream when the result is 2 or more."""
    return prev + 1 if off == next_off else 0


def extent_span(off: int, end: int, base: int, extent: int) -> tuple[int, int]:
    """(first, stop): the extents of the block at `base` that [off, end) touches (the grid
    starts at the block's start, so no extent straddles two blocks)."""
    return (off - base) // extent, -(-(end - base) // extent)
