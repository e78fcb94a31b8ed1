"""The SSD tier: which files are on local disk, how they get there, and when they leave.

`ssd_store.SsdStore` does the file I/O and guarantees that no wrong byte is ever served. This
module adds the tier's index and policy, and the background work:

- **Write-behind.** A file fetched from the source is queued for the SSD. One writer task
  takes the queue in batches, admits each entry through the tier's policy, removes victims,
  and writes the batch in the tier's own low-priority thread (`writer.py`), so that the
  write-behind takes the CPU the readers leave rather than the readers' time. The reader
  never waits for the SSD. A full queue (in entries or in bytes) drops the write (counted)
  rather than blocking or buffering without bound.
- **Restore.** After a restart the store's scan runs in a thread in the background and feeds
  the index in chunks, so the mount is ready at once. Lookups go by path straight to the store
  and do not need the index, so entries the scan has not reached yet are still hits.
- **Watermarks.** When the disk holds more than the high watermark of the budget, or the
  cache disk's free space falls below the floor, an evictor shrinks the tier to the low mark
  in the policy's order.
- **Degradation.** A failed write (full disk, I/O error) is refused by the store and logged
  once. The tier then keeps serving what it has and the cache runs on RAM and source. A
  restore or an evictor pass that fails is logged and ends, never the daemon. A cache
  directory deleted under the daemon is noticed by the evictor's next pass: the tier
  forgets its entries, is logged once, and takes no more writes (`lost`).

Index keys are cache keys (inode numbers). After a restart, the key of a restored entry is
derived from the source inode in its signature, the same way the namespace derives it
(`key_of_ino`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import trio

from shadefs.cache.block_keys import block_key, parse_block_relpath
from shadefs.cache.policies import Policy
from shadefs.cache.ssd.format import Verdict, disk_size, entry_size
from shadefs.cache.ssd.store import SsdStore
from shadefs.cache.ssd.writer import QUEUE_BYTES, Pending, WriteQueue
from shadefs.file_version import Signature
from shadefs.prefetch.fetching import Got, Item
from shadefs.stats import RestoreStats, SsdStats

log = logging.getLogger(__name__)

_RESTORE_CHUNK = 2048


class SsdTier:
    """Index, policy and background workers of the SSD tier.

    :store: the entry store (owns the directory lock)
    :policy: decides admission and eviction, in disk bytes
    :index: key -> (relpath, disk bytes) of the entries the tier knows
    """

    def __init__(
        self,
        store: SsdStore,
        policy: Policy,
        key_of_ino: Callable[[int], int],
        *,
        max_entry: int | None = None,
        queue: int = 4096,
        queue_bytes: int = QUEUE_BYTES,
        block_size: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock  # (seconds: how long the restore took)
        self.store = store
        self.policy = policy
        self.key_of_ino = key_of_ino
        self._max_entry = max_entry
        self.index: dict[int, tuple[bytes, int]] = {}
        self.hits = 0
        self.writes = 0
        self.write_failures = 0
        self.dropped_writes = 0
        self.joined = 0  # lookups served from a write still queued or in flight
        self.evictions = 0
        self.restore_done = False
        # The restore walked the whole directory: from then on the index knows every entry
        # (the writer indexes what it puts), so a key it lacks is a miss without asking the
        # disk. Until then a lookup asks the store by path (invariant 8).
        self.indexed = False
        self.restore_entries = 0
        self.restore_seconds = 0.0
        # Queued or being written: a reopen before the write lands reads these bytes
        # rather than fetch the file again (Parquet reads the footer, closes, reopens).
        self._pending = WriteQueue(queue, queue_bytes)
        # Disk bytes of entries being written: room taken before the store counts them, so
        # concurrent writers cannot together overshoot the budget.
        self._reserved = 0
        self._wake_evictor = trio.Event()
        self._limiter = trio.CapacityLimiter(16)
        # The block size of block entries (cache/blocks.py's; 0: none are restored).
        self.block_size = block_size
        # The cache directory was deleted under the daemon: nothing is looked up or written.
        self.lost = False

    @property
    def capacity(self) -> int:
        return self.store.capacity

    @property
    def max_entry(self) -> int:
        if self._max_entry is not None:
            return self._max_entry
        return min(self.store.capacity // 8, 256 << 20)

    @staticmethod
    def disk_size(relpath: bytes, size: int) -> int:
        """What one entry costs on disk (the store's `disk_bytes` accounting)."""
        return disk_size(entry_size(len(relpath), size))

    # --- the read path ------------------------------------------------------------------

    async def lookup(self, key: int, relpath: bytes, sig: Signature, job: int = 0) -> bytes | None:
        """The entry's bytes, or None if it is not (validly) here.

        An entry that is already in the page cache is read inline: a thread hop would cost
        more than the copy. A cold one is read in a worker thread, because inline it would
        stall every other request for the duration of a disk read, and in threads the reads
        of concurrent readers overlap. A file still on its way to the disk (write-behind)
        is served from the queued bytes.
        """
        item = self._pending.get(key)
        if item is not None and item.sig == sig:
            self.hits += 1
            self.joined += 1
            self.policy.accessed(key, key in self.index, job)
            return item.data
        if self.lost or (self.indexed and key not in self.index):
            # A first read's miss costs no disk lookup (the entry's directory entries are
            # rarely cached then, so it would also cost a thread hop).
            data = None
        else:
            try:
                data = self.store.get(relpath, sig, nowait=True)
            except BlockingIOError:
                data = await trio.to_thread.run_sync(
                    self.store.get, relpath, sig, limiter=self._limiter
                )
        self._seen(key, relpath, sig, data, job)
        return data

    def _seen(
        self, key: int, relpath: bytes, sig: Signature, data: bytes | None, job: int = 0
    ) -> None:
        known = key in self.index
        if data is None:
            if known:
                # Corrupt or stale: the store has deleted the file already.
                self._forget(key)
            return
        self.hits += 1
        if not known:
            # Found before the restore reached it: index it now. It is an entry of an earlier
            # run all the same, so it counts as restored (the walk will skip it).
            self._index(key, relpath, sig.size, restored=True)
            if not self.restore_done:
                self.restore_entries += 1
        self.policy.accessed(key, True, job)

    def _index(self, key: int, relpath: bytes, size: int, *, restored: bool = False) -> None:
        disk = self.disk_size(relpath, size)
        self.index[key] = (relpath, disk)
        if restored:
            self.policy.restored(key, disk)
        else:
            self.policy.inserted(key, disk)

    def _forget(self, key: int) -> None:
        if self.index.pop(key, None) is not None:
            self.policy.removed(key)

    def missed(self, key: int, job: int = 0) -> None:
        self.policy.accessed(key, False, job)

    def took(self, key: int, job: int = 0) -> bool:
        """A staged file was opened: True (a hit of this tier) if it is one of its entries."""
        if key not in self.index:
            return False
        self.hits += 1
        self.policy.accessed(key, True, job)
        return True

    async def read_ahead(self, items: Sequence[Item]) -> dict[int, Got]:
        """Of the prefetcher's (key, path, size) `items`, those this tier holds (indexed, or
        queued for the disk), read in one worker thread: after a drop of the page cache,
        one thread hop per SSD hit costs the event loop more than the hit itself. Each comes
        with the version it was written for, which the open that takes it compares (`took`
        counts it then); None where an entry is gone or bad (its lookup will find out). The
        owner fetches the rest from the source."""
        local: dict[int, Got] = {}
        reads: list[tuple[int, bytes]] = []
        for key, _, _ in items:
            where = None if self.lost else self.index.get(key)
            queued = self._pending.get(key)
            if queued is not None:
                local[key] = (queued.data, queued.sig)
            elif where is not None:
                reads.append((key, where[0]))
        if reads:
            got = await trio.to_thread.run_sync(self._read_versions, reads, limiter=self._limiter)
            local.update(got)
        return local

    def _read_versions(self, reads: list[tuple[int, bytes]]) -> list[tuple[int, Got]]:
        return [(key, self.store.get_any(relpath)) for key, relpath in reads]

    def contains(self, key: int) -> bool:
        return key in self.index

    # --- write-behind -------------------------------------------------------------------

    def offer(self, key: int, relpath: bytes, data: bytes, sig: Signature) -> None:
        """Queue a freshly fetched file for the SSD (never blocks)."""
        if len(data) > self.max_entry or key in self.index or key in self._pending or self.lost:
            return
        if not self._pending.put(Pending(key, relpath, data, sig)):
            self.dropped_writes += 1

    @property
    def queued(self) -> int:
        return len(self._pending)

    async def writer(self) -> None:
        """The write-behind: what is queued, taken in batches (one such task runs in the
        daemon's nursery; the writer thread ends with it)."""
        try:
            while True:
                batch = await self._pending.next_batch()
                try:
                    await self._write(batch)
                finally:
                    self._pending.done(batch)
        finally:
            self._pending.thread.close()

    async def _write(self, batch: list[Pending]) -> None:
        """Make room for each entry of `batch` (or refuse it), then write those with room in
        one job of the writer thread."""
        room: list[tuple[Pending, int]] = []
        try:
            for item in batch:
                disk = await self._room(item)
                if disk is not None:
                    # Reserved until the batch has landed: the next entry's room counts it.
                    self._reserved += disk
                    room.append((item, disk))
            if not room:
                return
            items = [item for item, _ in room]
            oks = await self._pending.thread.run_sync(partial(self._put_all, items))
        finally:
            for _, disk in room:
                self._reserved -= disk
        for item, ok in zip(items, oks, strict=True):
            if not ok:
                self.write_failures += 1
                continue
            self.writes += 1
            if item.key not in self.index:
                self._index(item.key, item.relpath, len(item.data))
        if self.store.over_high_watermark():
            self._wake_evictor.set()

    async def _room(self, item: Pending) -> int | None:
        """The entry's disk bytes once the policy admitted it and its victims are gone, or
        None (refused, or someone else took the room meanwhile)."""
        disk = self.disk_size(item.relpath, len(item.data))
        free = self.capacity - self.store.disk_bytes - self._reserved
        victims = self.policy.admit(item.key, disk, free)
        if victims is None:
            return None
        for victim in victims:
            await self._evict(victim)
        if self.store.disk_bytes + self._reserved + disk > self.capacity:
            return None
        return disk

    def _put_all(self, items: list[Pending]) -> list[bool]:
        """The writer thread's job: each entry put, in order (a failure is the store's to log)."""
        return [self.store.put(item.relpath, item.data, item.sig) for item in items]

    async def _evict(self, key: int, stale: bool = False) -> None:
        entry = self.index.get(key)
        if entry is None:
            return
        self._forget(key)
        if stale:
            self.store.ledger.count_bad(Verdict.STALE, os.fsdecode(entry[0]))
        else:
            self.evictions += 1
        await trio.to_thread.run_sync(self.store.remove, entry[0])

    async def evict(self, key: int, *, stale: bool = False) -> bool:
        """Drop `key`'s entry; `stale`: its file has a new version (`stale_entries`)."""
        if key not in self.index:
            return False
        await self._evict(key, stale)
        return True

    # --- restore and watermarks ---------------------------------------------------------

    def start(self, nursery: trio.Nursery) -> None:
        """Start the restore, the evictor and the write-behind in `nursery`."""
        nursery.start_soon(self.restore)
        nursery.start_soon(self.evictor)
        nursery.start_soon(self.writer)

    async def restore(self) -> None:
        """Rebuild the index from the store's scan, in the background."""
        try:
            await self._restore()
        except OSError as exc:
            # A cache disk that fails (or a directory deleted) during the walk ends the
            # restore, not the daemon: what was indexed stays, lookups still go by path.
            log.warning("SSD restore stopped: %s; the tier keeps what it indexed", exc)
            self.restore_done = True
            self._wake_evictor.set()

    async def _restore(self) -> None:
        t0 = self._clock()
        scan = self.store.scan()
        while True:
            chunk = await trio.to_thread.run_sync(_next_chunk, scan)
            for relpath, size, sig in chunk:
                key = self._restored_key(relpath, size, sig)
                if key is None:
                    # A block of another block size: no lookup can find it, so it would
                    # only hold room that the policy cannot free.
                    await trio.to_thread.run_sync(self.store.remove, relpath)
                    continue
                if key not in self.index:
                    self._index(key, relpath, size, restored=True)
                    self.restore_entries += 1
            if len(chunk) < _RESTORE_CHUNK:
                break
        self.restore_done = self.indexed = True
        self.restore_seconds = self._clock() - t0
        log.info(
            "restored %d SSD entries (%.0f MB) in %.1f s",
            self.restore_entries,
            self.store.used_bytes / 1e6,
            self.restore_seconds,
        )
        self._wake_evictor.set()

    def _restored_key(self, relpath: bytes, size: int, sig: Signature) -> int | None:
        """The key of a restored entry: its file's key, or the block key of a block entry
        (None for a block written with another block size, which no lookup can find)."""
        key = self.key_of_ino(sig.ino)
        if b"\0" not in relpath:
            return key
        name = parse_block_relpath(relpath)
        bs = self.block_size
        if name is None or not bs or name.offset % bs:
            return None
        if size != min(bs, name.file_size - name.offset):
            return None  # aligned, but written with another block size
        return block_key(key, name.offset // bs)

    async def evictor(self, interval: float = 5.0) -> None:
        """Keep the tier under its high watermark and the disk above its free floor."""
        while True:
            with trio.move_on_after(interval):
                await self._wake_evictor.wait()
            self._wake_evictor = trio.Event()
            if self.lost:
                continue
            if self.store.lost():
                self._lose()
                continue
            if not self.store.over_high_watermark():
                continue
            victims = self.policy.shrink(self.store.bytes_to_free())
            log.info("SSD tier above its high watermark: evicting %d entries", len(victims))
            for key in victims:
                await self._evict(key)

    def _lose(self) -> None:
        """The cache directory was deleted: forget its entries, run on RAM and source."""
        self.lost = True
        log.error(
            "SSD cache directory %s was deleted while mounted: the SSD tier is off until the "
            "next mount; serving from RAM and the source",
            self.store.root,
        )
        for key in list(self.index):
            self._forget(key)

    async def set_capacity(self, capacity: int) -> None:
        self.store.capacity = capacity
        if self.store.disk_bytes > capacity:
            for key in self.policy.shrink(self.store.disk_bytes - capacity):
                await self._evict(key)

    def describe(self) -> SsdStats:
        restore = RestoreStats(
            done=self.restore_done,
            entries=self.restore_entries,
            seconds=round(self.restore_seconds, 3),
        )
        return SsdStats(
            bytes=self.store.disk_bytes,
            data_bytes=self.store.used_bytes,
            capacity=self.capacity,
            entries=len(self.index),
            hits=self.hits,
            writes=self.writes,
            write_failures=self.write_failures,
            dropped_writes=self.dropped_writes,
            queued_writes=self.queued,
            evictions=self.evictions,
            corrupt_entries=self.store.corrupt_entries,
            stale_entries=self.store.stale_entries,
            disk_free=self.store.disk_free(),
            min_free=self.store.min_free,
            policy=self.policy.describe(),
            restore=restore,
        )


def _next_chunk(scan: Iterator[tuple[bytes, int, Signature]]) -> list[tuple[bytes, int, Signature]]:
    out = []
    for item in scan:
        out.append(item)
        if len(out) >= _RESTORE_CHUNK:
            break
    return out
