"""Where a file's bytes are: the RAM tier, its byte accounting, admission and eviction.

The cache decides hit or miss when a regular file is opened (one sample = one file),
fetches misses whole from the source (one fetch per file at a time, however many readers
open it concurrently), and asks the policy whether the fetched bytes may stay and what to
evict for them. It never chooses victims itself.

Files larger than `max_entry` are not cached: they are read through (pass-through) with
positional reads on a source descriptor, so they read correctly whatever the budget.

Concurrency (see docs/developer-notes.md): everything here runs in the trio thread, and
the code between two awaits is a critical section. The only await is the source fetch in
`_fetch`; after it, the state is re-read rather than trusted from before.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from typing import TYPE_CHECKING

import numpy as np
import pyfuse3
import trio

from shadefs.cache.policies import Policy
from shadefs.cache.ssd_format import Signature
from shadefs.cache.ssd_tier import SsdTier
from shadefs.source import Source
from shadefs.stats import Metrics

if TYPE_CHECKING:
    from shadefs.cache.prefetch import Prefetcher

log = logging.getLogger(__name__)


class Entry:
    """A resident file: its bytes and the signature of the source file they came from."""

    __slots__ = ("data", "sig")

    def __init__(self, data: bytes, sig: Signature) -> None:
        self.data = data
        self.sig = sig


class _Flight:
    __slots__ = ("done", "data", "sig", "error", "ahead")

    def __init__(self, ahead: bool = False) -> None:
        self.done = trio.Event()
        self.data: bytes | None = None
        self.sig: Signature | None = None
        self.error: BaseException | None = None
        self.ahead = ahead  # started by the prefetcher, not by a reader


class Cache:
    """The RAM tier under a byte budget that is never exceeded (counting file bytes).

    :capacity: the budget in bytes
    :max_entry: files larger than this are read through, never cached
    :used: bytes of resident file data
    """

    def __init__(
        self,
        source: Source,
        policy: Policy,
        metrics: Metrics,
        *,
        capacity: int,
        max_entry: int | None = None,
        ssd: SsdTier | None = None,
    ) -> None:
        self.source = source
        self.policy = policy
        self.metrics = metrics
        self.capacity = capacity
        self._max_entry = max_entry
        self.ssd = ssd
        self.entries: dict[int, Entry] = {}
        self.used = 0
        self.admitted = 0
        self.evictions = 0
        self.refused = 0
        self.shared_fetches = 0
        self.ram_hits = 0
        self.blocked = 0.0  # seconds that opens spent waiting for the source
        self.prefetcher: Prefetcher | None = None
        self._flights: dict[int, _Flight] = {}

    @property
    def max_entry(self) -> int:
        # By default a single file may take an eighth of the budget: larger ones would
        # push out many small samples for one read (and pass through instead).
        if self._max_entry is not None:
            return min(self._max_entry, self.capacity)
        return min(self.capacity // 8, 256 << 20)

    # --- the data path ----------------------------------------------------------------

    async def open(self, key: int, path: bytes, st: os.stat_result) -> bytes | None:
        """The file's bytes for a new handle, or None when it must be read through."""
        sig = Signature.of(st)
        ssd = self.ssd
        prefetcher = self.prefetcher
        if prefetcher is not None and prefetcher.plans:
            prefetcher.observe(key)
        entry = self.entries.get(key)
        if entry is not None:
            if entry.sig == sig:
                self.metrics.hits += 1
                self.ram_hits += 1
                self.policy.accessed(key, True)
                if ssd is not None:
                    ssd.policy.accessed(key, key in ssd.index)
                return entry.data
            log.debug("RAM entry for %r is stale, dropping it", path)
            self._remove(key)
        self.policy.accessed(key, False)
        if ssd is not None and st.st_size <= ssd.max_entry:
            data = await ssd.lookup(key, path, sig)
            if data is not None:
                self.metrics.hits += 1
                self._admit(key, data, sig)
                return data
            ssd.missed(key)
        self.metrics.misses += 1
        if prefetcher is not None:
            data = prefetcher.take(key, sig)
            if data is not None:
                self._adopt(key, path, data, sig)
                return data
        if st.st_size > self.max_entry and (ssd is None or st.st_size > ssd.max_entry):
            self.metrics.passthrough_opens += 1
            return None
        t0 = time.monotonic()
        try:
            return await self._fetch(key, path)
        finally:
            self.blocked += time.monotonic() - t0

    async def _fetch(self, key: int, path: bytes) -> bytes:
        flight = self._flights.get(key)
        if flight is not None:
            # Someone is already fetching this file: wait for their bytes.
            self.shared_fetches += 1
            await flight.done.wait()
            if flight.error is not None:
                raise flight.error
            assert flight.data is not None and flight.sig is not None
            if flight.ahead:
                # The prefetcher got it just in time: from here on it is an ordinary miss.
                if self.prefetcher is not None:
                    self.prefetcher.take(key, flight.sig)
                self._adopt(key, path, flight.data, flight.sig)
            return flight.data
        data, sig = await self._fly(key, path, _Flight())
        self._adopt(key, path, data, sig)
        return data

    async def _fly(self, key: int, path: bytes, flight: _Flight) -> tuple[bytes, Signature]:
        """Fetch `path` from the source as the one flight for `key`."""
        self._flights[key] = flight
        try:
            data, st = await self.source.read_file(path)
            flight.data = data
            flight.sig = Signature.of(st)
        except BaseException as exc:
            flight.error = exc if isinstance(exc, pyfuse3.FUSEError) else None
            if flight.error is None:
                # Cancellation or a bug: waiters get EIO, the original exception propagates.
                flight.error = pyfuse3.FUSEError(errno.EIO)
            raise
        finally:
            del self._flights[key]
            flight.done.set()
        return data, flight.sig

    async def fetch_ahead(self, key: int, path: bytes) -> tuple[bytes, Signature] | None:
        """The prefetcher's fetch: shares single-flight with readers, admits nothing.

        None when a reader is already fetching the file (the reader will cache it).
        """
        if key in self._flights:
            return None
        return await self._fly(key, path, _Flight(ahead=True))

    def _adopt(self, key: int, path: bytes, data: bytes, sig: Signature) -> None:
        """A file that a reader missed: the tiers' policies decide whether it stays."""
        self._admit(key, data, sig)
        if self.ssd is not None:
            self.ssd.offer(key, path, data, sig)

    def _admit(self, key: int, data: bytes, sig: Signature) -> None:
        size = len(data)
        if size > self.max_entry:
            return
        if key in self.entries:
            self._remove(key)
        victims = self.policy.admit(key, size, self.capacity - self.used)
        if victims is None:
            self.refused += 1
            return
        for victim in victims:
            self._remove(victim)
            self.evictions += 1
        if self.used + size > self.capacity:
            # A policy bug must not break the budget: refuse rather than overshoot.
            log.error("policy %s returned too few victims; refusing", self.policy.name)
            self.refused += 1
            return
        self.entries[key] = Entry(data, sig)
        self.used += size
        self.admitted += 1
        self.policy.inserted(key, size)

    def _remove(self, key: int) -> None:
        entry = self.entries.pop(key)
        self.used -= len(entry.data)
        self.policy.removed(key)

    # --- control ----------------------------------------------------------------------

    def set_capacity(self, capacity: int) -> None:
        """Change the budget; shrinking evicts at once, in the policy's order."""
        self.capacity = capacity
        if self.used > capacity:
            for victim in self.policy.shrink(self.used - capacity):
                self._remove(victim)
                self.evictions += 1
        # Entries that are now above max_entry stay until evicted: they are still valid.

    def set_policy(self, policy: Policy, ssd_policy: Policy | None = None) -> None:
        """Switch policies, handing the new ones every resident entry."""
        for key, entry in self.entries.items():
            policy.inserted(key, len(entry.data))
        self.policy = policy
        if self.ssd is not None and ssd_policy is not None:
            for key, (_, disk) in self.ssd.index.items():
                ssd_policy.inserted(key, disk)
            self.ssd.policy = ssd_policy

    def begin_epoch(self, epoch: int) -> None:
        self.policy.begin_epoch(epoch)
        if self.ssd is not None:
            self.ssd.policy.begin_epoch(epoch)

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

    def resident_keys(self) -> np.ndarray:
        """Every cached key in any tier, as uint64 (the order builder's resident set)."""
        keys = self.entries.keys()
        if self.ssd is not None:
            keys = keys | self.ssd.index.keys()
        return np.fromiter(keys, dtype=np.uint64, count=len(keys))

    async def evict(self, key: int) -> bool:
        """Drop `key` from every tier; False if it was not cached."""
        found = key in self.entries
        if found:
            self._remove(key)
            self.evictions += 1
        if self.ssd is not None:
            found = await self.ssd.evict(key) or found
        return found

    def describe(self) -> dict[str, object]:
        tiers: dict[str, object] = {
            "ram": {
                "bytes": self.used,
                "capacity": self.capacity,
                "entries": len(self.entries),
                "hits": self.ram_hits,
            }
        }
        if self.ssd is not None:
            tiers["ssd"] = self.ssd.describe()
        return tiers
