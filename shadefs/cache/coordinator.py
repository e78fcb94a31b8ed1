"""Where a file's bytes are: the RAM tier, its byte accounting, admission and eviction.

The cache decides hit or miss when a regular file is opened (one sample = one file),
fetches misses whole from the source (one fetch per file at a time, however many readers
open it concurrently; at the first read when the open was deferred, cache/deferred.py), and
asks the policy whether the fetched bytes may stay and what to evict. It never chooses
victims itself. Files above `max_entry` are `cache/blocks.py`'s: block entries in these
same tiers (`admit`, `remove`; negative keys), or read through on a source descriptor.

The cache owns its SSD tier and its prefetcher, which it hands the callables it needs (the
prefetch part does not import this module), and builds both tiers' policies by name.
`start(nursery)` starts the tiers' and the prefetcher's tasks. Who reads what (jobs,
epochs, demand, pending reads) is the readers part's (readers/part.py): every open tells
it in one call, and the policies and the fetch log read its tracker.

Concurrency (docs/developer-notes.md): everything runs in the trio thread; the code between
two awaits is a critical section. The data path awaits the SSD lookup and the source fetch;
after each, the state is re-read rather than trusted from before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

import numpy as np
import pyfuse3
import trio

from shadefs.cache.block_keys import by_file
from shadefs.cache.deferred import Deferred
from shadefs.cache.entry import Entry
from shadefs.cache.fetchlog import FetchLog
from shadefs.cache.flights import FileFlight, fly_many, flying
from shadefs.cache.handles import HandleLedger
from shadefs.cache.policies import Owned, Policy, make_policy
from shadefs.cache.ssd.store import SsdStore
from shadefs.cache.ssd.tier import SsdTier
from shadefs.file_version import Signature, StatLike, serves
from shadefs.kernel.pages import KernelPages
from shadefs.prefetch.fetching import Got, Item, PrefetchSettings
from shadefs.prefetch.prefetcher import Prefetcher
from shadefs.readers.jobs import Job
from shadefs.readers.part import SETTLE, Readers
from shadefs.readers.tracker import BATCH_MIN
from shadefs.source.part import Source
from shadefs.stats import CacheStats, Metrics, RamStats

log = logging.getLogger(__name__)

# Hits whose bookkeeping waits (`Cache.hit`) at most. Mostly the readers' tick (50 ms) or
# another request takes the log in first; each numpy call of a batch meets its code cold
# (~100 us a batch of 64 in the daemon), so the longer the batch the less a hit pays for it:
# ~2 us a hit at 64, ~1 at 1024 (bench_cpu's warm passes, timed inside the daemon).
HIT_LOG = 1024


class Cache:
    """The RAM tier under a byte budget that is never exceeded (counting file bytes), and
    the owner of the SSD tier and of the prefetcher. :capacity: the budget in bytes; :used:
    bytes of resident file data; :max_entry: the largest file cached whole in RAM; :ssd: the
    SSD tier, :prefetcher: the prefetcher (None when off)"""

    def __init__(
        self,
        source: Source,
        metrics: Metrics,
        *,
        capacity: int,
        policy: str = "epoch",
        score_of: Callable[[int], float] | None = None,
        max_entry: int | None = None,
        ssd: SsdStore | None = None,
        key_of_ino: Callable[[int], int] | None = None,
        prefetch: PrefetchSettings | None = None,
        handle_limit: int | None = None,
        readers: Readers | None = None,
        owns: Callable[[int], bool] | None = None,
        block_size: int = 0,
        kernel_pages: KernelPages | None = None,
        clock: Callable[[], float] = time.monotonic,
        no_open: bool = False,
    ) -> None:
        """`policy`: every tier's (ValueError if unknown); `score_of`: importance for
        `shade`; `owns`: a multi-node job's ownership; `ssd`: an SSD tier's store (restored
        entries get keys from `key_of_ino`); `handle_limit`: what open handles keep alive
        outside the RAM budget (None: the budget); `readers` (fresh if None): who reads
        what; `block_size`: that of large files' blocks (cache/blocks.py); `kernel_pages`:
        which files the kernel may hold pages of (the service's, fresh if None); `clock`:
        seconds, for the time opens wait on the source; `no_open`: the mount serves with
        kernel hits (kernel/no_open.py)."""
        self._clock = clock
        self.no_open = no_open
        self.source = source
        self.metrics = metrics
        self.capacity = capacity
        self._max_entry = max_entry
        self.whole_max = 0  # refresh_limits()
        self.ram_max = 0  # max_entry as a plain attribute (every open compares with it)
        self._score_of = score_of
        self._owns = owns
        self.readers = readers if readers is not None else Readers()
        self.pending = self.readers.pending
        self._init_hits()
        self.entries: dict[int, Entry] = {}
        # Entries that an open found to be their node's version (`verify`), until the
        # node's next check is due: the hit path's (`reopen`). A record leaves with its
        # entry, or when the node changes (`unverify`). A record: (entry, when the node's
        # check is due, the file's tracker id or -1, the entry's bytes).
        self._reopens: dict[int, tuple[Entry, float, int, bytes]] = {}
        self.used = self.admitted = self.evictions = self.refused = 0  # bytes; counters
        self.shared_fetches = self.ram_hits = 0
        self.blocked = 0.0  # seconds that opens spent waiting for the source
        self._flights: dict[int, FileFlight] = {}
        self.fetchlog = FetchLog(self.readers.tracker)  # refetches within an epoch
        self.handles = HandleLedger(kernel_pages)
        self._handle_limit = handle_limit
        self.handle_passthrough = 0  # opens read through because handles held too much
        settings, reads_left = prefetch, self.pending.group_reads_left
        kernel = self.handles.kernel
        self.prefetcher = (
            Prefetcher.with_settings(
                settings, self.fetch_ahead, self.tier_of, reads_left, clock, kernel, no_open
            )
            if settings
            else None
        )
        self.policy = self._make_policy(policy)
        self.ssd: SsdTier | None = None
        if ssd is not None:
            if key_of_ino is None:
                raise ValueError("an SSD tier needs key_of_ino")
            self.ssd = SsdTier(
                ssd, self._make_policy(policy), key_of_ino, block_size=block_size, clock=clock
            )
        self.refresh_limits()

    def start(self, nursery: trio.Nursery) -> None:
        """Start the background tasks of the tiers, the prefetcher and the readers' tick."""
        nursery.start_soon(self._ticking)
        if self.ssd is not None:
            self.ssd.start(nursery)
        if self.prefetcher is not None:
            self.prefetcher.start(nursery)

    async def _ticking(self) -> None:
        """`tick_readers` every SETTLE seconds, until cancelled."""
        while True:
            await trio.sleep(SETTLE)
            self.tick_readers()

    def tick_readers(self) -> None:
        """Tell the readers part the hits logged since the last time, then tick it (its
        universes settle, idle jobs end): the cache logs the hit path's reads, so it is
        the one to tick the part that counts them."""
        self.take_hits()
        self.readers.tick()

    def close(self) -> None:
        """Release the SSD store (its directory lock); after the tasks have stopped."""
        self.take_hits()
        if self.ssd is not None:
            self.ssd.store.close()

    @property
    def max_entry(self) -> int:
        # By default a file may take an eighth of the budget (larger ones pass through).
        if self._max_entry is not None:
            return min(self._max_entry, self.capacity)
        return min(self.capacity // 8, 256 << 20)

    def refresh_limits(self) -> None:
        """After a budget changes: the largest file RAM / some tier caches whole (blocks above)."""
        self.ram_max = self.max_entry
        self.whole_max = max(self.ram_max, self.ssd.max_entry if self.ssd else 0)

    @property
    def handle_limit(self) -> int:
        return self.capacity if self._handle_limit is None else self._handle_limit

    # --- the data path ----------------------------------------------------------------

    async def open(self, key: int, path: bytes, st: StatLike, pid: int = 0) -> bytes | None:
        entry = await self.open_entry(key, path, st, pid)  # its bytes only
        assert not isinstance(entry, Deferred)
        return None if entry is None else entry.data

    async def open_entry(
        self,
        key: int,
        path: bytes,
        st: StatLike,
        pid: int = 0,
        lazy: bool = False,
        sig: Signature | None = None,
    ) -> Entry | Deferred | None:
        """Bytes for a new handle (pinned till `unpin`) and their version's signature, or
        None: read it through. `pid`: the reader (the readers part finds its job); `sig`:
        `st`'s, if known. A miss may meet another version than `st`'s, or only its start if
        it grew past the bound. `lazy`: a miss that would fetch returns its fetch instead."""
        if self._hits:
            self.take_hits()
        sig = Signature.of(st) if sig is None else sig
        reader = self._read(key, pid)
        entry = self.entries.get(key)
        if entry is not None:
            if entry.sig == sig and entry.where == hash(path):
                self._hit(key, entry.data, entry.sig.size, reader)
                return entry
            log.debug("RAM entry for %r is stale, dropping it", path)
            self._remove(key)
        got = await self._miss(key, path, st, sig, reader, lazy)
        if type(got) is Entry:  # a Deferred is pinned when its first read fetches
            self._pin(key, got)
        return got

    def reopen(self, key: int, pid: int) -> bytes | None:
        """The hit path: the bytes of `key`'s resident entry, pinned, if an open verified
        them (`verify`) and the node's check is not due, and RAM still serves the file whole
        (not blocks, after a budget shrank); else None (open it). A hit of reader `pid`."""
        rec = self._reopens.get(key)
        if rec is None:
            return None
        # (The record's fields by index, its entry untouched: each object read is a likely
        # cache miss on a warm open, where the kernel and the readers ran in between.)
        data = rec[3]
        if self._clock() >= rec[1] or len(data) > self.ram_max:
            return None
        self.hit(key, data, pid, rec[2])
        return data

    def verified_bytes(self, key: int) -> bytes | None:
        """What `reopen` would serve, unpinned and uncounted (a later read of it)."""
        rec = self._reopens.get(key)
        if rec is None or self._clock() >= rec[1] or len(rec[3]) > self.ram_max:
            return None
        return rec[3]

    def verify(self, key: int, data: bytes, sig: Signature, path: bytes, until: float) -> None:
        """An open found that `data`, which it serves, is version `sig` of the file at `path`,
        checked at the source until `until`: if they are `key`'s resident entry, `reopen`
        serves them till then. (Bytes read through another path or version are not: the
        next open decides again.)"""
        entry = self.entries.get(key)
        if entry is None or entry.data is not data or entry.where != hash(path):
            return
        if serves(entry.sig, len(data), sig):
            # (the tracker id: the hit path's read needs no lookup; -1 if none yet)
            i = self.readers.tracker.id_of.get(key, -1)
            self._reopens[key] = (entry, until, -1 if i is None else i, data)

    def unverify(self, key: int) -> None:
        """Node `key` changed or the kernel forgot it: its next open decides again."""
        self._reopens.pop(key, None)

    def _pin(self, key: int, got: Entry) -> None:
        entry = self.entries.get(key)
        self.handles.pin(got.data, entry is not None and entry.data is got.data)

    async def _miss(
        self, key: int, path: bytes, st: StatLike, sig: Signature, reader: Job, lazy: bool
    ) -> Entry | Deferred | None:
        """`open` past the RAM tier: the SSD tier, staging, pass-through or a fetch."""
        ssd, prefetcher, job = self.ssd, self.prefetcher, reader.row
        self.policy.accessed(key, False, job)
        room = self.handles.held + st.st_size <= self.handle_limit
        keep = lazy and (ssd is None or key not in ssd.index)  # staged for a first read: fetch
        staged = prefetcher.take(key, sig) if prefetcher is not None and room and not keep else None
        data = None
        if ssd is not None and (staged is not None or st.st_size <= ssd.max_entry):
            if staged is None:
                data = await ssd.lookup(key, path, sig, job)
                room = self.handles.held + st.st_size <= self.handle_limit  # (after the await)
            elif ssd.took(key, job):
                data = staged  # staged from the SSD tier: its hit
            if data is None:
                ssd.missed(key, job)
        if data is not None:  # the SSD tier's, staged from it or read now
            self._tally(1, st.st_size, reader)
            self._admit(key, data, sig, hash(path))
            return Entry(data, sig)
        self.metrics.misses += 1
        reader.misses += 1
        reader.bytes += st.st_size
        if staged is not None:
            return self._adopt(key, path, staged, sig)
        if st.st_size > self.max_entry and (ssd is None or st.st_size > ssd.max_entry):
            self.metrics.passthrough_opens += 1
            return None
        if not room:
            # Open handles already keep too much evicted data alive: read this one through
            # rather than hold another copy outside the budget.
            self.metrics.passthrough_opens += 1
            self.handle_passthrough += 1
            return None
        if lazy and st.st_size and key not in self._flights:  # (empty: no read would come)
            ledger = self.handles
            return Deferred(self.fetch, ledger, ledger.kernel, self.metrics, key, path, st)
        return await self.fetch(key, path, st, pin=False)

    async def fetch(self, key: int, path: bytes, st: StatLike, pin: bool = True) -> Entry:
        """A miss's fetch, pinned if `pin`; staged bytes first (a lazy open leaves them)."""
        b = self.prefetcher.take(key, sig := Signature.of(st)) if self.prefetcher else None
        t0 = self._clock()
        try:  # (b: the bytes staged for the file, if any)
            got = await self._fetch(key, path, st) if b is None else self._adopt(key, path, b, sig)
        finally:
            self.blocked += self._clock() - t0
        if pin:
            self._pin(key, got)
        return got

    async def _fetch(self, key: int, path: bytes, st: StatLike) -> Entry:
        flight = self._flights.get(key)
        if flight is not None:
            self.shared_fetches += 1  # someone is fetching this file: wait for their bytes
            if flight.ahead and self.prefetcher is not None:
                self.prefetcher.joined(key)  # the prefetch serves this open, late
            try:
                data = await flight.result()
            except pyfuse3.FUSEError:
                # A prefetch batch failed, maybe for another of its files: fetch it alone.
                if not flight.ahead or not self.source.healthy:
                    raise
                return await self._fetch(key, path, st)
            assert flight.sig is not None
            if flight.ahead and flight.clean and flight.sig.ino == st.st_ino:
                if self.prefetcher is not None:  # just in time: now an ordinary miss
                    self.prefetcher.take(key, flight.sig)
                self._adopt(key, path, data, flight.sig)
            return Entry(data, flight.sig)
        flight = FileFlight()
        data, sig = await self._fly(key, path, flight, st.st_size)
        if flight.clean and sig.ino == st.st_ino:  # else the path leads to another file now
            self._adopt(key, path, data, sig)
        return Entry(data, sig)

    async def _fly(
        self, key: int, path: bytes, flight: FileFlight, size: int | None
    ) -> tuple[bytes, Signature]:
        """Fetch `path` (looked up at `size` bytes) from the source as the one flight for `key`."""
        with flying(self._flights, key, flight):
            data, st = await self.source.read_file(path, size)
            self.fetchlog.note(key, len(data))
            # Whole (never torn) unless it grew past the bound; maybe not the version looked up.
            flight.land(data, st)
        assert flight.sig is not None
        return data, flight.sig

    async def fetch_ahead(self, items: Sequence[Item]) -> tuple[list[Got], float]:
        """The prefetcher's fetch of (key, path, size) `items` in one source call: shares
        single flight with readers, admits nothing. Per item None when a reader is fetching
        the file (and will cache it) or it grew past the bound; and the source's seconds
        per file."""
        if self.ssd is None:
            return await self._fly_many(items)
        local = await self.ssd.read_ahead(items)  # the SSD tier's entries, read from there
        rest = [item for item in items if item[0] not in local]
        fetched, seconds = await self._fly_many(rest) if rest else ([], 0.0)
        by_key = dict(zip([key for key, _, _ in rest], fetched, strict=True))
        return [local[key] if key in local else by_key[key] for key, _, _ in items], seconds

    async def _fly_many(self, items: Sequence[Item]) -> tuple[list[Got], float]:
        src, note = self.source, self.fetchlog.note_many
        return await fly_many(self._flights, items, src.read_files, note, src.read_now)

    def _adopt(self, key: int, path: bytes, data: bytes, sig: Signature) -> Entry:
        """A file that a reader missed: the tiers' policies decide whether it stays."""
        self._admit(key, data, sig, hash(path))
        if self.ssd is not None:
            self.ssd.offer(key, path, data, sig)
        return Entry(data, sig)

    def _admit(self, key: int, data: bytes, sig: Signature, where: int) -> None:
        if len(data) <= self.max_entry:  # larger ones are the SSD tier's or passed through
            self.admit(key, data, sig, where)

    def admit(self, key: int, data: bytes, sig: Signature, where: int = 0) -> None:
        """Admit `data` under `key` if the policy makes room (blocks come in here too)."""
        if self._hits:
            self.take_hits()
        size = len(data)
        if key in self.entries:
            self._remove(key)
        victims = self.policy.admit(key, size, self.capacity - self.used)
        if victims is None:
            self.refused += 1
            if not self._let_go(key, data, sig):
                self.pending.refused(key)  # a read to come that no tier bridges
            return
        for victim in victims:
            gone = self.entries[victim]
            self._remove(victim)
            self.evictions += 1
            self._let_go(victim, gone.data, gone.sig)
        if self.used + size > self.capacity:
            # A policy bug must not break the budget: refuse rather than overshoot.
            log.error("policy %s returned too few victims; refusing", self.policy.name)
            self.refused += 1
            return
        self.entries[key] = Entry(data, sig, where)
        self.used += size
        self.admitted += 1
        self.policy.inserted(key, size)
        self.handles.admitted(data)

    def _let_go(self, key: int, data: bytes, sig: Signature) -> bool:
        """A file the RAM tier refuses or evicts while reads of it are still to come (a
        sweep group's, other jobs'): staged for them within the prefetch window, not
        fetched again (prefetcher.py `hold`), unless the SSD tier holds it. Whether so."""
        pf, ssd = self.prefetcher, self.ssd
        if pf is None or key < 0 or (ssd is not None and key in ssd.index):
            return False
        return pf.hold(key, data, sig, self.readers.tracker.wanted(key))

    def _remove(self, key: int) -> None:
        """Drop a resident entry (also a block of a file that changed)."""
        if self._hits:
            self.take_hits()  # (while it is resident: its logged hits move its entry)
        entry = self.entries.pop(key)
        self._reopens.pop(key, None)
        self.used -= len(entry.data)
        self.policy.removed(key)
        self.handles.evicted(entry.data)

    remove = _remove  # blocks.py drops the blocks of a file that changed

    def unpin(self, data: bytes) -> None:
        """A handle that held `data` was released."""
        self.handles.unpin(data)

    # --- hits -------------------------------------------------------------------------
    #
    # A RAM hit's bookkeeping: what the readers, the policies and the counters make of it.
    #
    # The data path's verified reopen (`reopen`) pins the resident bytes and answers; the
    # rest of the hit (the tracker's read, the pending reads, the job's read log, the
    # prefetcher's progress, both tiers' policies, the counters) waits in a log of up to
    # `HIT_LOG` hits that `take_hits` takes in together and in order. One by one, each hit
    # met these objects cold in the daemon (the readers and the kernel ran between two
    # requests): ~3.5 us of CPU a hit, most of it the tracker's scalar updates. A batch of
    # one job's hits is taken in with a numpy call per column instead (the tracker's
    # `read_many`, the policies' `accessed_many`).
    #
    # The log must never let a read be seen out of its order, so it is taken in before
    # anything else touches that state: every request of the data path other than a hit
    # (fs/guard.py: a miss, an epoch's announcement, a stats read), every admission to RAM
    # and every removal (the policy's buckets must hold what the reads did), and the
    # readers' ticks. What runs in the background in between (the speculator's plans, the
    # SSD tier's writes) may see the last hits late, by one tick of the readers (50 ms) at
    # most.

    def _init_hits(self) -> None:
        self._jobs_of_pids = self.readers.jobs.pids  # (the hit path's: reader pid -> job)
        self._hits: list[tuple[int, int, Job, int]] = []  # `hit`'s log: (key, size, job, id)

    def hit(self, key: int, data: bytes, pid: int, i: int = -1) -> None:
        """A RAM hit of `key` (tracker id `i`, -1: unknown) by reader `pid`, whose resident
        bytes `data` (whole) the caller found to serve without checking them again (the
        data path's verified reopen, fs/operations.py). The bytes are pinned now, the rest
        is logged (module doc). A reader's first open is taken in at once: its job is
        found from /proc while the process lives."""
        job = self._jobs_of_pids.get(pid)
        if job is None:
            self.take_hits()
            self._hit(key, data, len(data), self._read(key, pid, i))
            return
        self.handles.pin_resident(data)
        hits = self._hits
        hits.append((key, len(data), job, i))
        if len(hits) >= HIT_LOG:
            self.take_hits()

    def take_hits(self) -> None:
        """Take the logged hits in (`hit`), as one by one they would have been: one
        job's batch in numpy where the tracker can (`Tracker.read_many`)."""
        hits = self._hits
        if not hits:
            return
        self._hits = []
        job = hits[0][2]
        if len(hits) >= BATCH_MIN and all(h[2] is job for h in hits):
            keys = [h[0] for h in hits]
            ids = [h[3] for h in hits]
            ranks = self.readers.read_many(keys, job, ids)
            if ranks is not None:
                self._count_hits(keys, sum(h[1] for h in hits), job, ids, ranks)
                return
        for key, size, job, i in hits:
            self._read_by(key, job, i)
            self._count_hit(key, size, job)

    def _count_hits(
        self, keys: list[int], size: int, reader: Job, ids: list[int], ranks: np.ndarray
    ) -> None:
        """`_count_hit` of every key of a batch that the tracker took in (`ranks`)."""
        self._observe(keys)
        self.policy.accessed_many(keys, reader.row, np.asarray(ids, dtype=np.int64), ranks)
        self._counted(keys, size, reader)

    def _read(self, key: int, pid: int, i: int = -1) -> Job:
        """The readers' read of `key` by reader `pid` (before the policies hear of it)."""
        jobs = self.readers.jobs
        job = jobs.pids.get(pid) or jobs.job_of(pid)
        self._read_by(key, job, i)
        return job

    def _read_by(self, key: int, job: Job, i: int) -> None:
        """The readers' read of `key` by `job`, and the prefetcher's."""
        self.readers.read_by(key, job, i)
        self._observe((key,))

    def _observe(self, keys: Iterable[int]) -> None:
        """The prefetcher's progress: its plans' readers opened `keys`."""
        pf = self.prefetcher
        if pf is not None and (pf.plans or pf.holds.left):
            for key in keys:
                pf.observe(key)

    def _hit(self, key: int, data: bytes, size: int, reader: Job) -> None:
        """Count a RAM hit, tell both tiers' policies of it, and pin its bytes."""
        self._count_hit(key, size, reader)
        self.handles.pin_resident(data)

    def _tally(self, hits: int, size: int, reader: Job) -> None:
        """`hits` opens served without the source, `size` bytes in all, by `reader`: the one
        place the mount's and the job's hit counts grow (a tier counts its own as well:
        `ram_hits`, `SsdTier.hits`)."""
        self.metrics.hits += hits
        reader.hits += hits
        reader.bytes += size

    def count_block_open(self, hit: bool) -> None:
        """An open of a large file (cache/blocks.py): a hit if the block its first read
        needed was cached, in the mount's counts (a block's reads count in its tiers')."""
        if hit:
            self.metrics.hits += 1
        else:
            self.metrics.misses += 1

    def _count_hit(self, key: int, size: int, reader: Job) -> None:
        self.policy.accessed(key, True, reader.row)
        self._counted((key,), size, reader)

    def _counted(self, keys: Sequence[int], size: int, reader: Job) -> None:
        """The counters and the SSD tier's policy: RAM hits of `keys`, `size` bytes in all."""
        n = len(keys)
        self.ram_hits += n
        self._tally(n, size, reader)
        ssd = self.ssd
        if ssd is not None:
            index, accessed, job = ssd.index, ssd.policy.accessed, reader.row
            for key in keys:
                accessed(key, key in index, job)

    # --- control ----------------------------------------------------------------------

    def set_capacity(self, capacity: int) -> None:
        """Change the budget; shrinking evicts at once, in the policy's order."""
        self.capacity = capacity
        self.refresh_limits()
        self.take_hits()
        if self.used > capacity:
            for victim in self.policy.shrink(self.used - capacity):
                self._remove(victim)
                self.evictions += 1
        # Entries that are now above max_entry stay until evicted: they are still valid.

    def _make_policy(self, name: str) -> Policy:
        pf, score_of = self.prefetcher, self._score_of
        return make_policy(
            name,
            by_file(score_of) if score_of is not None else None,
            by_file(pf.next_use) if pf is not None else None,
            self._owns,
            self.pending.pending,
            self.readers.tracker,
        )

    def _policies(self) -> list[Policy]:
        return [self.policy] if self.ssd is None else [self.policy, self.ssd.policy]

    def set_policy(self, name: str) -> None:
        """Switch every tier to a fresh policy `name` (ValueError if none) with every entry."""
        policy = self._make_policy(name)
        ssd_policy = self._make_policy(name)
        for key, entry in self.entries.items():
            policy.inserted(key, len(entry.data))
        self.policy = policy
        if self.ssd is not None:
            for key, (_, disk) in self.ssd.index.items():
                ssd_policy.inserted(key, disk)
            self.ssd.policy = ssd_policy

    async def reclassify(self, unowned: Callable[[list[int]], Awaitable[list[int] | None]]) -> None:
        """A multi-node job's ownership changed: each tier's policy, where it tells owned
        entries from guests (`Owned`), sorts its entries again. `unowned(keys)` names the
        guests (off the loop; None if the ownership changed meanwhile); the policy in force
        then takes them (entries admitted meanwhile were sorted on insertion)."""
        for i in range(len(self._policies())):
            policy = self._policies()[i]
            if isinstance(policy, Owned):
                guests = await unowned(list(policy.sizes))
                policy = self._policies()[i]
                if guests is not None and isinstance(policy, Owned):
                    policy.reclassify(guests)

    def begin_epoch(self, epoch: int, job: int | None = None) -> None:
        """A sampler announced epoch `epoch` for job `job` (None: for every job), with a
        new order: the tracker takes the epoch, the policies drop what the old order kept."""
        self.readers.announce(epoch, job)
        for policy in self._policies():
            policy.begin_epoch(epoch, job)

    def block_accessed(self, key: int, hit: bool) -> None:
        """A read of block `key` (cache/blocks.py): the tracker's read, then the policy's."""
        self.readers.read_block(key)
        self.policy.accessed(key, hit)

    def drop(self) -> int:
        """Forget every file cached in RAM (the SSD tier is kept); returns how many."""
        n = len(self.entries)
        for key in list(self.entries):
            self._remove(key)
        return n

    def tier_of(self, key: int) -> int:
        """0: not cached, 1: RAM, 2: SSD only."""
        if key in self.entries:
            return 1
        return 2 if self.ssd is not None and key in self.ssd.index else 0

    def cached_keys(self, ram: bool = True, ssd: bool = True) -> list[int]:
        """The keys in RAM and on the SSD (blocks' too): a list copied at C speed for a worker
        thread (`resident_among`), where a set union would stall the loop at 1.28 M files."""
        tier = self.ssd
        on_ssd = list(tier.index) if ssd and tier is not None else []
        return list(self.entries) + on_ssd if ram else on_ssd

    async def evict(self, key: int, *, stale: bool = False) -> bool:
        """Drop `key` from every tier; False if it was not cached. `stale`: its file has a
        new version under another key (`Namespace.fresh_stat`): not counted as an eviction."""
        found = key in self.entries
        if found:
            self._remove(key)
            self.evictions += not stale
        if self.ssd is not None:
            found = await self.ssd.evict(key, stale=stale) or found
        return found

    def describe(self) -> CacheStats:
        return CacheStats(
            ram=RamStats(self.used, self.capacity, len(self.entries), self.ram_hits),
            max_entry=self.max_entry,
            admitted=self.admitted,
            evictions=self.evictions,
            refused=self.refused,
            fetches_shared=self.shared_fetches,
            blocked_seconds=round(self.blocked, 6),
            policy=self.policy.describe(),
            handles=self.handles.describe(self.handle_limit, self.handle_passthrough),
            ssd=self.ssd.describe() if self.ssd is not None else None,
            fetches=self.fetchlog.describe(),
        )
