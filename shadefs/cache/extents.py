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
- **When a whole block is worth it.** The whole block is loaded when the RAM tier has free
  room for it (it will be admitted without evicting anything), on a block's second random
  touch when the blocks that random readers touch all fit in half the RAM budget (the
  working set fits: the block will stay), or when the SSD tier has room for it. It loads
  in the background (block read-ahead, within its window) while the random reads that
  come meanwhile take extents: an 8 MiB load never stalls a 4 KiB read. The touch log
  remembers twice as many blocks as the budget holds, so it forgets a working set the
  readers left. Otherwise the block would only thrash.
- **One fstat a second, not one a read.** A whole block is signed by an fstat on its
  descriptor after the read. An extent is too small to pay that (on a filer without
  attribute caching it is a second round trip per 4 KiB read), so a handle's extent reads
  go without one, and wait in the handle (`pending`, unserved to others) until the handle's
  next signed read, at most `CHECK_PERIOD` later: a signature that still matches then
  proves the file unchanged since the open (any change moves its ctime), so the extents
  read before it are of the opened version and join the LRU. A mismatch drops them.

Everything here runs in the trio thread; reads go through the `PRead` callable that
blocks.py hands in (its positional read, behind the source's limiter and timeout).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

from shadefs.cache.block_keys import block_key
from shadefs.cache.ssd_format import Signature
from shadefs.source_reads import pread_spread

__all__ = [
    "EXTENT",
    "Extents",
    "Ranges",
    "TouchLog",
    "advise",
    "extent_span",
    "pread_stat",
    "streak",
]

EXTENT = 32 << 10
CHECK_PERIOD = 1.0  # seconds between the signed extent reads of one handle


class RangeHandle(Protocol):
    """What `Ranges` reads of a block handle (cache/blocks.py `BlockHandle`)."""

    key: int
    size: int
    sig: Signature
    checked: float  # when its last signed read was dispatched
    pending: list[tuple[int, int, bytes]]  # (block key, first extent, bytes) unconfirmed


H = TypeVar("H", bound=RangeHandle)


class Ranges(Generic[H]):
    """Random reads served from extents: the LRU, the touch log and the counters."""

    def __init__(
        self,
        pread: Callable[[H, int, int, bool], Awaitable[tuple[bytes, bool]]],
        block_size: int,
        limit: int,
    ) -> None:
        """`pread(handle, n, offset, signed)` -> (bytes, clean): clean is False if a signed
        read found the file changed; an unsigned read is clean when it is whole."""
        self._pread = pread
        self.block_size = block_size
        self.extent = min(EXTENT, block_size)
        self.extents = Extents(limit)
        self.touches = TouchLog()
        self.check_period = CHECK_PERIOD
        self.loads = 0
        self.bytes = 0

    async def read(self, h: H, i: int, off: int, end: int) -> bytes:
        """[off, end) of block i from its extents, fetching the missing ones in one read."""
        bs, ext = self.block_size, self.extent
        base = i * bs
        bkey = block_key(h.key, i)
        first, stop = extent_span(off, end, base, ext)
        data = self.extents.span(bkey, first, stop, h.sig)
        if data is None:
            lo = base + first * ext
            n = min(base + stop * ext, base + bs, h.size) - lo
            now = time.monotonic()
            signed = now - h.checked >= self.check_period
            confirm: list[tuple[int, int, bytes]] = []
            if signed:
                h.checked, confirm, h.pending = now, h.pending, []
            data, clean = await self._pread(h, n, lo, signed)
            self.loads += 1
            self.bytes += len(data)
            if clean:
                if signed:
                    for k, x, d in confirm:
                        self.extents.store(k, x, h.sig, d, ext)
                    self.extents.store(bkey, first, h.sig, data, ext)
                elif sum(len(d) for _, _, d in h.pending) < self.extents.limit:
                    h.pending.append((bkey, first, data))
        skip = off - base - first * ext
        return memoryview(data)[skip : skip + end - off]  # type: ignore[return-value]


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


def advise(fd: int, random: bool) -> None:
    """Tell the kernel how a source descriptor is read. The reads that reach the daemon
    were already sized by the mount's own read-ahead; a random reader's would otherwise
    set off the source filesystem's read-ahead as well, which fetches pages nobody reads
    (measured over the emulator: lmdb through the mount pulled twice what it pulled direct).
    Inline: fadvise only sets a flag on the open file, it does no I/O."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM if random else os.POSIX_FADV_NORMAL)
    except OSError:
        pass


def pread_stat(
    fd: int, n: int, off: int, signed: bool, piece: int = 0
) -> tuple[bytes, os.stat_result | None]:
    """One worker-thread call (blocks and extents): read, then, if `signed`, fstat the same
    descriptor to sign the bytes. `piece`: a random reader's descriptor, whose large reads
    go in pieces of that size at once (source_reads.py)."""
    data = pread_spread(fd, n, off, piece)
    while 0 < len(data) < n:  # short reads of NFS are legal
        more = os.pread(fd, n - len(data), off + len(data))
        if not more:
            break
        data += more
    return data, os.fstat(fd) if signed else None
