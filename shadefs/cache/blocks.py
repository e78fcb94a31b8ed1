"""Large files (shards) cached as fixed-size blocks: the read path and sequential read-ahead.

A file larger than every tier caches whole (`Cache.whole_max`: `--max-entry` for RAM, the
SSD tier's largest entry) and not above `--passthrough-above` (by default there is no such
limit: a file larger than the whole budget is cached in part) is never fetched whole; nor is
one the SSD tier would cache whole while open handles hold `--handle-limit` (`takes`). Each
block of `block_size` bytes is an entry of its own, under a negative key (`block_keys`), in
the same tiers, budgets and policies as whole files: the RAM tier's `Cache.entries`
(admitted through `Cache.admit`, so the RAM budget counts blocks and the policy chooses
among files and blocks alike) and the SSD tier (write-behind, checksums, restore: one SSD
entry per block, signed by the file).

Reads: `read(handle, off, size)` answers with a memoryview slice of a resident block. A
missing block is loaded once (single flight per block): from the SSD tier, else from the
source in a worker thread, signed by an fstat on the same descriptor after the read (bytes
of a file that changed meanwhile are never cached). An open's first read counts it as a hit
or a miss (cache/block_files.py).

Sequential or random (cache/extents.py): a handle streams while its reads continue one
another. A random read of a block that is not resident and would not be kept gets the asked
range rounded out to 32 KiB extents, never the whole block (kept in a small LRU within the
read-ahead window, and offered to the RAM tier as pieces that compete for the budget under
the policy); with room on the SSD tier, the block is loaded in the background too.

Read-ahead: every streaming read of block i starts loading the next blocks, up to `window`
bytes over all open files (the prefetch window). Opening a file fetches nothing: a reader
that only reads the footer pays for the footer. A block that read-ahead loaded but the
policy did not admit waits in its handle (`staged`) until the reader takes it; staged
bytes and kept extents count against the window, so read-ahead never holds more than it.

Revalidation: each block-cached file's signature is remembered; an open that sees another
signature (at the path too: `open` answers None), or a new version under another key
(`retire`), drops every block of the file in both tiers. Policies see a block like any
entry: `epoch` consumes a shard's blocks as its reader takes them (once per handle);
`lru` and `belady` order blocks; `shade` ranks a block by its file's importance.

Concurrency: all in the trio thread but the source reads; state is re-read after each await.
A descriptor is closed once no read of it is in flight (`BlockHandle.users`)."""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable

import pyfuse3
import trio

from shadefs.cache.block_files import block_tier, count_open, drop_blocks
from shadefs.cache.block_handle import BlockHandle
from shadefs.cache.block_keys import PIECE_BIT, block_key, block_relpath
from shadefs.cache.coordinator import Cache
from shadefs.cache.extents import EXTENT, Ranges, pread_stat, streak, streams
from shadefs.cache.flights import Flight, flying
from shadefs.file_version import Signature, StatLike
from shadefs.source.part import Source
from shadefs.source.reads import advise
from shadefs.stats import BlockStats

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_BLOCK_SIZE", "BlockHandle", "Blocks"]

DEFAULT_BLOCK_SIZE = 1 << 20  # (8 MiB made an SSD-served random read cost 3.7x a read through)
NO_LIMIT = 1 << 62  # `passthrough_above` when the operator set none (stats.json: 0)


class Blocks:
    """Block entries of large files over the cache's tiers.

    :threshold: files larger than this are cached in blocks (the cache's whole_max)
    :block_size: bytes per block (the last block of a file is shorter)
    :window: bytes that read-ahead may have in flight or staged, over all files
    """

    def __init__(
        self,
        cache: Cache,
        source: Source,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        window: int = 64 << 20,
        passthrough_above: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.source = source
        self.block_size = block_size
        self.window = max(window, block_size)
        self._passthrough_above = passthrough_above
        self._flights: dict[int, Flight] = {}
        self._sigs: dict[int, Signature] = {}  # file key -> signature its blocks belong to
        self._nursery: trio.Nursery | None = None
        self.ahead_bytes = 0  # read-ahead in flight or staged
        # Random reads' extents (cache/extents.py), within a quarter of the window.
        self.ranges: Ranges[BlockHandle] = Ranges(
            self._pread, block_size, self.window // 4, cache, clock
        )
        self.hits = self.ssd_loads = self.source_loads = 0
        self.read_ahead = self.revalidated = self.opens = 0

    def start(self, nursery: trio.Nursery) -> None:
        """Read-ahead tasks run in `nursery` (without it, there is no read-ahead)."""
        self._nursery = nursery

    @property
    def threshold(self) -> int:
        return self.cache.whole_max

    @property
    def passthrough_above(self) -> int:
        """Files larger than this are read through, never cached: the operator's limit, by
        default none. A file larger than the budget is cached in pieces and blocks, which
        compete for the budget under the policy: its RAM share buys hits in proportion
        (docs/benchmarks.md, "One large file read at random")."""
        limit = self._passthrough_above
        return NO_LIMIT if limit is None else limit

    def takes(self, key: int, size: int) -> bool:
        """Whether an open of file `key` (larger than the RAM tier caches whole) goes to
        blocks: above every tier's whole-file limit, or one the SSD tier would cache whole
        when open handles hold too much to fetch it whole (`--handle-limit`; as blocks it
        still reaches the SSD), or when it was opened in blocks before: its blocks, not
        a whole fetch, serve the reopen (Parquet reopens a file while the release of the
        file read before it, which the kernel sends late, still holds the limit)."""
        if size > self.threshold:  # above every whole-file limit (and the key space's)
            return size <= min(self.passthrough_above, self.block_size * PIECE_BIT)
        cache, ssd = self.cache, self.cache.ssd
        if ssd is None or key in ssd.index or size > self.passthrough_above:
            return False
        held, limit = cache.handles.held, cache.handle_limit
        return held + size > limit or key in self._sigs or block_key(key, 0) in ssd.index

    # --- open / release ---------------------------------------------------------------

    async def open(self, key: int, path: bytes, st: StatLike) -> tuple[BlockHandle, bool] | None:
        """A handle on the file, and whether every block is resident in RAM (keep_cache)."""
        sig = Signature.of(st)
        old = self._sigs.get(key)
        if old is not None and old != sig:
            await self._invalidate(key, old)
        self._sigs[key] = sig
        self.opens += 1
        h = BlockHandle(key, path, sig, self.block_size)
        entries = self.cache.entries
        resident = True
        for i in range(h.nblocks):
            e = entries.get(block_key(key, i))
            if e is None or e.sig != sig:
                resident = False
                break
        if not resident:
            # Opened now (`st`'s version), like a pass-through handle: it reads what it opened.
            h.fd, now = await self.source.open_file(path)
            if Signature.of(now) == sig:
                return h, False
            await self.source.close_fd(h.fd)
            return None
        # keep_cache: the kernel may serve every read from its pages and never ask us, so
        # the open is the shard's read as far as the policy can tell (as for whole files).
        h.counted = True
        self.cache.count_block_open(True)
        accessed = self.cache.block_accessed
        for i in range(h.nblocks):
            h.seen[i] = 1
            accessed(block_key(key, i), True)
        return h, True

    async def release(self, h: BlockHandle) -> None:
        if h.pending and h.fd >= 0:
            # The extents read since the last signed read: one fstat proves them of the
            # opened version, so a short pass (under CHECK_PERIOD) keeps its pieces too.
            pending, h.pending = h.pending, []
            h.users += 1
            try:
                st = await self.source.run(os.fstat, h.fd)
            except pyfuse3.FUSEError:
                st = None
            finally:
                h.users -= 1
            if st is not None and Signature.of(st) == h.sig:
                self.ranges.confirm(h, pending)
        h.closed = True
        h.cur_data = b""
        for data in h.staged.values():
            self.ahead_bytes -= len(data)
        h.staged.clear()
        if h.users == 0 and h.fd >= 0:
            fd, h.fd = h.fd, -1
            await self.source.close_fd(fd)

    async def _invalidate(self, key: int, old: Signature) -> None:
        self.revalidated += 1  # (the file changed: every block of the old version goes)
        log.debug("file %d changed: dropping its blocks", key)
        await drop_blocks(self.cache, key, old.size, self.block_size)

    def tier_of(self, key: int) -> int:
        """`Cache.tier_of` of a file this daemon cached in blocks (0 for any other)."""
        sig = self._sigs.get(key)
        return 0 if sig is None else block_tier(self.cache, key, sig.size, self.block_size)

    async def retire(self, key: int) -> None:  # a new version has another key (fs/namespace.py)
        if (sig := self._sigs.pop(key, None)) is not None:
            await self._invalidate(key, sig)

    async def evict(self, key: int) -> bool:
        """Drop a block-cached file's blocks from both tiers (`ctl evict PATH`)."""
        sig = self._sigs.get(key)
        return sig is not None and await drop_blocks(self.cache, key, sig.size, self.block_size)

    # --- reads ------------------------------------------------------------------------

    async def read(self, h: BlockHandle, off: int, size: int) -> bytes:
        end = min(off + size, h.size)
        if off >= end:
            return b""
        if not h.counted:
            h.counted = True
            count_open(self.cache, h.key, off // self.block_size)
        h.streak, h.run = streak(h.streak, h.run, h.next_off, off, end)
        h.next_off = end
        stream = streams(h.streak, h.run)
        if stream == h.random and h.fd >= 0:
            h.random = not stream
            advise(h.fd, h.random)
        bs = self.block_size
        first, last = off // bs, (end - 1) // bs
        if first == last:
            base = first * bs
            if not stream and self._partial(h, first):
                return await self._range(h, first, off, end)
            data = await self._block(h, first)
            if stream:
                self._read_ahead(h, first + 1)
            # A slice of the block, not a copy: pyfuse3 takes any buffer.
            return memoryview(data)[off - base : end - base]  # type: ignore[return-value]
        parts: list[bytes | memoryview] = []
        for i in range(first, last + 1):
            base = i * bs
            lo, hi = max(off, base), min(end, base + bs)
            if not stream and self._partial(h, i):
                parts.append(await self._range(h, i, lo, hi))
                continue
            data = await self._block(h, i)
            parts.append(memoryview(data)[lo - base : hi - base])
        if stream:
            self._read_ahead(h, last + 1)
        return b"".join(parts)

    def _partial(self, h: BlockHandle, i: int) -> bool:
        """Whether a random read of block i takes extents (cache/extents.py): the block is
        not at hand, and would not stay in RAM, or loads in the background meanwhile."""
        if h.cur == i or i in h.staged:
            return False
        bkey = block_key(h.key, i)
        entry = self.cache.entries.get(bkey)
        if entry is not None and entry.sig == h.sig:
            return False
        cache, bs, ssd = self.cache, self.block_size, self.cache.ssd
        if ssd is not None and bkey in ssd.index:
            return False  # local: a whole block costs no link
        n, coming = min(bs, h.size - i * bs), self.ahead_bytes  # loading: room soon taken
        if n <= EXTENT:
            return False  # its extent would be the whole block, fetched again as the block
        if bkey in self._flights:
            return self._nursery is not None  # extents until it lands, not an 8 MiB wait
        ram = self.ranges.touches.worth_whole(bkey, n, bs, cache.capacity, cache.used + coming)
        room = ssd is not None and ssd.capacity - ssd.store.disk_bytes - coming >= n
        if (ram or room) and self._fill(h, i):
            return True  # it loads in the background: this read from an extent
        return not ram

    async def _range(self, h: BlockHandle, i: int, off: int, end: int) -> bytes:
        if not h.seen[i]:
            h.seen[i] = 1
            self.cache.block_accessed(block_key(h.key, i), False)
        return await self.ranges.read(h, i, off, end)

    async def _block(self, h: BlockHandle, i: int) -> bytes:
        if h.cur == i:
            return h.cur_data
        data = await self._find(h, i)
        entry = self.cache.entries.get(block_key(h.key, i))
        if entry is None or entry.data is not data:
            # Not kept by the RAM tier: the handle keeps it while it reads there. A read of
            # a resident block elsewhere (a B-tree's leaf page amid a scan) must not drop
            # it, or the scan's next read would load it again.
            h.cur, h.cur_data = i, data
        return data

    async def _find(self, h: BlockHandle, i: int) -> bytes:
        h.pos = i
        bkey = block_key(h.key, i)
        entry = self.cache.entries.get(bkey)
        if entry is not None and entry.sig == h.sig:
            self.hits += 1
            if not h.seen[i]:
                h.seen[i] = 1
                self.cache.block_accessed(bkey, True)
            return entry.data
        data = h.staged.pop(i, None)
        if data is not None:
            self.ahead_bytes -= len(data)
            return data
        if not h.seen[i]:
            h.seen[i] = 2
            self.cache.block_accessed(bkey, False)
        return await self._load(h, i)

    async def _load(self, h: BlockHandle, i: int) -> bytes:
        """Block i from the SSD tier or the source, as the one flight for its key; admitted
        to the RAM tier if the policy lets it."""
        bkey = block_key(h.key, i)
        flight = self._flights.get(bkey)
        if flight is not None:
            return await flight.result()
        flight = Flight()
        with flying(self._flights, bkey, flight):
            data = await self._fetch(h, i, bkey)
            flight.data = data
        return data

    async def _fetch(self, h: BlockHandle, i: int, bkey: int) -> bytes:
        off = i * self.block_size
        n = min(self.block_size, h.size - off)
        ssd = self.cache.ssd
        rel = block_relpath(h.path, off, h.size)
        bsig = h.sig._replace(size=n)
        if ssd is not None:
            data = await ssd.lookup(bkey, rel, bsig)
            if data is not None:
                self.ssd_loads += 1
                self._admit(h, bkey, data)
                return data
            ssd.missed(bkey)
        data, clean = await self._pread(h, n, off)
        self.source_loads += 1
        if clean:
            self._admit(h, bkey, data)
            if ssd is not None:
                ssd.offer(bkey, rel, data, bsig)
        return data

    def _admit(self, h: BlockHandle, bkey: int, data: bytes) -> None:
        if self._sigs.get(h.key) == h.sig:  # not if the file changed meanwhile
            self.cache.admit(bkey, data, h.sig)

    async def _pread(
        self, h: BlockHandle, n: int, off: int, signed: bool = True
    ) -> tuple[bytes, bool]:
        """n bytes at off from the source; clean is False if the file changed meanwhile
        (`signed`: checked by an fstat after the read; else only whether it is whole)."""
        if h.fd < 0:
            fd = await self.source.open_fd(h.path)
            if h.fd < 0 and not h.closed:
                h.fd = fd
            else:  # another read opened one meanwhile, or the handle is gone
                await self.source.close_fd(fd)
                if h.closed:
                    raise pyfuse3.FUSEError(errno.EBADF)
        h.users += 1
        try:
            piece = self.source.piece if h.random else 0
            data, st = await self.source.run(pread_stat, h.fd, n, off, signed, piece)
        finally:
            h.users -= 1
            if h.closed and h.users == 0 and h.fd >= 0:
                fd, h.fd = h.fd, -1
                await self.source.close_fd(fd)
        self.source.bytes_read += len(data)
        return data, len(data) == n and (st is None or Signature.of(st) == h.sig)

    # --- read-ahead -------------------------------------------------------------------

    def _read_ahead(self, h: BlockHandle, start: int) -> None:
        """Start loading blocks from `start` on, within the window; never awaits."""
        if (nursery := self._nursery) is None:
            return
        bs = self.block_size
        # Ramped: a stream that just began (a random reader's first read at offset 0,
        # say) gets one block ahead, a long one the whole window.
        ahead = min(self.window // bs, max(1, h.streak // 4))
        i, stop = max(start, h.ahead_to), min(h.nblocks, start + ahead)
        entries = self.cache.entries
        held = self.ahead_bytes + self.ranges.extents.bytes
        while i < stop and held + bs <= self.window:
            bkey = block_key(h.key, i)
            if bkey not in entries and bkey not in self._flights and i not in h.staged:
                self.ahead_bytes += bs
                held += bs
                self.read_ahead += 1
                nursery.start_soon(self._ahead, h, i)
            i += 1
        h.ahead_to = max(h.ahead_to, i)

    def _fill(self, h: BlockHandle, i: int) -> bool:
        """Start loading block i for a random reader, within the window; never awaits."""
        bs, nursery = self.block_size, self._nursery
        if nursery is None or self.ahead_bytes + self.ranges.extents.bytes + bs > self.window:
            return False
        self.ahead_bytes += bs
        self.read_ahead += 1
        nursery.start_soon(self._ahead, h, i, False)
        return True

    async def _ahead(self, h: BlockHandle, i: int, stage: bool = True) -> None:
        """Load block i ahead of the reader; if the policy does not admit it, keep it for
        the reader (`stage`: a stream's next blocks) or let it go (a random reader's block,
        loaded for the tiers: it may never come back to it, and staged bytes hold the
        window until it does)."""
        bs = self.block_size
        try:
            if h.closed:
                return
            if not h.seen[i]:
                h.seen[i] = 2
                self.cache.block_accessed(block_key(h.key, i), False)
            data = await self._load(h, i)
        except pyfuse3.FUSEError as exc:
            log.debug("read-ahead of block %d of %r failed: %s", i, h.path, exc)
            return
        finally:
            self.ahead_bytes -= bs
        if not stage or h.closed or i <= h.pos or block_key(h.key, i) in self.cache.entries:
            return  # gone, already taken by the reader (it joined the flight), or cached
        # Not admitted (the policy refused it): keep it for this reader, within the window.
        h.staged[i] = data
        self.ahead_bytes += len(data)

    def describe(self) -> BlockStats:
        return BlockStats(
            block_size=self.block_size,
            threshold=self.threshold,
            passthrough_above=self._passthrough_above or 0,
            opens=self.opens,
            hits=self.hits,
            ssd_loads=self.ssd_loads,
            source_loads=self.source_loads,
            read_ahead=self.read_ahead,
            ahead_bytes=self.ahead_bytes,
            range_loads=self.ranges.loads,
            range_bytes=self.ranges.bytes,
            extent_hits=self.ranges.extents.hits,
            extent_bytes=self.ranges.extents.bytes,
            revalidated=self.revalidated,
            piece_hits=self.ranges.piece_hits,
            pieces_admitted=self.ranges.pieces_admitted,
        )
