"""Random reads inside block-cached files: fetch the range asked for, not the whole block.

A block-cached file (cache/blocks.py) is read either as a stream (tar shards, a sequential
scan) or at random offsets (LMDB, HDF5, np.memmap, Parquet footers and column chunks). A
sequential reader is served whole blocks with read-ahead. A random reader of a block that
the RAM tier will not keep would pay a whole block (8 MiB) per small read, loaded and then
refused or evicting another: 1,000 random 4 KiB reads over 4 x 12 MiB files with 14 MiB of
RAM pulled 2 GiB from the source. So, per open file:

- **Sequential or random.** A read that starts where the previous read of its handle ended,
  or a little after (less than `STREAM_RUN`: the pages in between were the kernel's, as in
  a mapping whose other pages were faulted earlier), continues a run; the start of the file
  counts as the end of a read. The kernel sends a streaming reader's reads in order and back
  to back (at its read-ahead size, `read_ahead_kb`), and a random reader's at the size
  asked, rounded to pages. A handle streams once its run has two reads or more (its first at
  offset 0 counts) and `STREAM_RUN` (64 KiB) bytes or more: one random read that happens to
  follow another, or the three adjacent pages of one LMDB value faulted one at a time
  (`readahead=False`), do not buy a block and its read-ahead; a cursor scan does.
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

from shadefs.cache.block_keys import block_index, block_key, piece_key
from shadefs.cache.entry import Entry
from shadefs.file_version import Signature
from shadefs.source.reads import pread_spread

__all__ = [
    "EXTENT",
    "Extents",
    "PieceTier",
    "Ranges",
    "TouchLog",
    "extent_span",
    "pread_stat",
    "streak",
    "streams",
]

EXTENT = 32 << 10
# A run of reads becomes a stream at this many bytes: half the kernel's default read-ahead
# (128 KiB), which a streaming reader's first read through the kernel already asks for; a
# random reader's few adjacent pages (an LMDB value's 2-4 overflow pages, faulted one by
# one with readahead=False) stay below it.
STREAM_RUN = 2 * EXTENT
CHECK_PERIOD = 1.0  # seconds between the signed extent reads of one handle


class RangeHandle(Protocol):
    """What `Ranges` reads of a block handle (cache/blocks.py `BlockHandle`)."""

    key: int
    size: int
    sig: Signature
    checked: float  # when its last signed read was dispatched
    pending: list[tuple[int, int, bytes]]  # (block key, first extent, bytes) unconfirmed
    pieces: set[int]  # the pieces whose read the policy was told of (once per handle)


class PieceTier(Protocol):
    """The RAM tier as pieces see it (cache/coordinator.py `Cache`)."""

    entries: dict[int, Entry]

    def admit(self, key: int, data: bytes, sig: Signature, where: int = 0) -> None: ...

    def block_accessed(self, key: int, hit: bool) -> None: ...


H = TypeVar("H", bound=RangeHandle)


class Ranges(Generic[H]):
    """Random reads served from extents: the LRU, the touch log and the counters."""

    def __init__(
        self,
        pread: Callable[[H, int, int, bool], Awaitable[tuple[bytes, bool]]],
        block_size: int,
        limit: int,
        ram: PieceTier | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`pread(handle, n, offset, signed)` -> (bytes, clean): clean is False if a signed
        read found the file changed; an unsigned read is clean when it is whole. `ram`: the
        RAM tier that keeps pieces under its policy (None: the LRU alone keeps extents).
        `clock`: seconds, for how often a handle's reads are signed."""
        self._pread = pread
        self._clock = clock
        self.block_size = block_size
        self.extent = min(EXTENT, block_size)
        self.per_block = -(-block_size // self.extent)
        self.extents = Extents(limit)
        self.touches = TouchLog()
        self.check_period = CHECK_PERIOD
        self.ram = ram
        self.loads = 0
        self.bytes = 0
        self.piece_hits = 0  # reads served from pieces in the RAM tier
        self.pieces_admitted = 0

    def _pieces(self, h: H, i: int, first: int, stop: int) -> bytes | None:
        """Extents first..stop-1 of block i from the RAM tier's pieces, else the LRU; None
        unless every one is at hand. Tells the policy of each piece's first read by `h`."""
        ram = self.ram
        if ram is None:
            return self.extents.span(block_key(h.key, i), first, stop, h.sig)
        entries, bkey, got = ram.entries, block_key(h.key, i), []
        from_ram = True
        for x in range(first, stop):
            pkey = piece_key(h.key, i * self.per_block + x)
            entry = entries.get(pkey) if pkey is not None else None
            if entry is not None and entry.sig == h.sig:
                data = entry.data
            else:
                from_ram = False
                got_lru = self.extents.get(bkey, x, h.sig)
                if got_lru is None:
                    return None
                data = got_lru
            got.append(data)
            if pkey is not None and pkey not in h.pieces:
                h.pieces.add(pkey)
                ram.block_accessed(pkey, entry is not None)
        if from_ram:
            self.piece_hits += 1
        else:
            self.extents.hits += 1
        return got[0] if len(got) == 1 else b"".join(got)

    def _missed(self, h: H, i: int, first: int, stop: int) -> None:
        """The policy hears of a fetched piece's read once per handle (as of a block's)."""
        ram = self.ram
        if ram is None:
            return
        for x in range(first, stop):
            pkey = piece_key(h.key, i * self.per_block + x)
            if pkey is not None and pkey not in h.pieces:
                h.pieces.add(pkey)
                ram.block_accessed(pkey, False)

    def _keep(self, bkey: int, key: int, first: int, sig: Signature, data: bytes) -> None:
        """Keep confirmed extents in the LRU (outside the budget, within the read-ahead
        window: what a reader comes back to soon), and as pieces in the RAM tier if its
        policy admits them (what stays): one bytes object, held by both."""
        ext, ram = self.extent, self.ram
        if ram is None:
            self.extents.store(bkey, first, sig, data, ext)
            return
        i = block_index(bkey)
        for x in range(-(-len(data) // ext)):
            piece = data[x * ext : (x + 1) * ext]
            self.extents.put(bkey, first + x, sig, piece)
            pkey = piece_key(key, i * self.per_block + first + x)
            if pkey is not None:
                ram.admit(pkey, piece, sig)
                self.pieces_admitted += pkey in ram.entries

    def confirm(self, h: H, pending: list[tuple[int, int, bytes]]) -> None:
        """Keep `pending` (extents read unsigned by `h`): a signed read or an fstat of the
        handle's descriptor proved the file unchanged since they were read."""
        for k, x, d in pending:
            self._keep(k, h.key, x, h.sig, d)

    async def read(self, h: H, i: int, off: int, end: int) -> bytes:
        """[off, end) of block i from its extents, fetching the missing ones in one read."""
        bs, ext = self.block_size, self.extent
        base = i * bs
        bkey = block_key(h.key, i)
        first, stop = extent_span(off, end, base, ext)
        data = self._pieces(h, i, first, stop)
        if data is None:
            self._missed(h, i, first, stop)
            lo = base + first * ext
            n = min(base + stop * ext, base + bs, h.size) - lo
            now = self._clock()
            signed = now - h.checked >= self.check_period
            confirm: list[tuple[int, int, bytes]] = []
            if signed:
                h.checked, confirm, h.pending = now, h.pending, []
            data, clean = await self._pread(h, n, lo, signed)
            self.loads += 1
            self.bytes += len(data)
            if clean:
                if signed:
                    self.confirm(h, confirm)
                    self._keep(bkey, h.key, first, h.sig, data)
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
        tier has free room for it and the blocks touched lately fit in the budget, or it is
        touched again and they fit in half of it. The log remembers twice the blocks the
        budget holds."""
        touches = self._touches.pop(bkey, 0) + 1
        self._touches[bkey] = touches
        while len(self._touches) > max(2 * capacity // bs, 1):
            self._touches.popitem(last=False)
        if capacity - used >= n and len(self._touches) * bs <= capacity:
            # Admitted without evicting anything, and the blocks touched lately fit: when
            # they do not, the pieces of random reads (cached in RAM too) would evict it,
            # freeing the room to load it again, over and over.
            return True
        return touches >= 2 and len(self._touches) * bs <= capacity // 2

    def __len__(self) -> int:
        return len(self._touches)


def streak(prev: int, run: int, next_off: int, off: int, end: int) -> tuple[int, int]:
    """A handle's (reads, bytes) in its sequential run after a read of [off, end)
    (`next_off`: where the last ended; a fresh handle has (1, 0) and next_off 0). A read
    continues the run when it starts where the last ended or skips ahead by less than
    `STREAM_RUN` (pages the kernel already had, as in a mapping, are never asked for); only
    the bytes read count, so that random reads landing near each other by chance rarely
    add up. The read is part of a stream when the run has 2 reads or more and `STREAM_RUN`
    bytes or more (`streams`)."""
    if next_off <= off <= next_off + STREAM_RUN:
        return prev + 1, run + end - off
    return 0, end - off


def streams(reads: int, run: int) -> bool:
    """Whether a run of `reads` reads and `run` bytes is a stream (`streak`)."""
    return reads >= 2 and run >= STREAM_RUN


def extent_span(off: int, end: int, base: int, extent: int) -> tuple[int, int]:
    """(first, stop): the extents of the block at `base` that [off, end) touches (the grid
    starts at the block's start, so no extent straddles two blocks)."""
    return (off - base) // extent, -(-(end - base) // extent)


def pread_stat(
    fd: int, n: int, off: int, signed: bool, piece: int = 0
) -> tuple[bytes, os.stat_result | None]:
    """One worker-thread call (blocks and extents): read, then, if `signed`, fstat the same
    descriptor to sign the bytes. `piece`: a random reader's descriptor, whose large reads
    go in pieces of that size at once (source/reads.py)."""
    data = pread_spread(fd, n, off, piece)
    while 0 < len(data) < n:  # short reads of NFS are legal
        more = os.pread(fd, n - len(data), off + len(data))
        if not more:
            break
        data += more
    return data, os.fstat(fd) if signed else None
