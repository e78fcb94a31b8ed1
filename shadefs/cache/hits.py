"""A RAM hit's bookkeeping: what the readers, the policies and the counters make of it
(mixed into the cache, cache/coordinator.py).

The data path's verified reopen (fs/operations.py) pins the resident bytes and answers; the
rest of the hit (the tracker's read, the pending reads, the job's read log, the prefetcher's
progress, both tiers' policies, the counters) waits in a log of up to `HIT_LOG` hits that
`take_hits` takes in together and in order. One by one, each hit met these objects cold in
the daemon (the readers and the kernel ran between two requests): ~3.5 us of CPU a hit,
most of it the tracker's scalar updates. A batch of one job's hits is taken in with a
numpy call per column instead (readers/batch.py, the policies' `accessed_many`).

The log must never let a read be seen out of its order, so it is taken in before anything
else touches that state: every request of the data path other than a hit (fs/guard.py: a
miss, an epoch's announcement, a stats read), every admission to RAM and every removal
(the policy's buckets must hold what the reads did), and the readers' ticks. What runs in
the background in between (the speculator's plans, the SSD tier's writes) may see the last
hits late, by one tick of the readers (50 ms) at most.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from shadefs.cache.entry import Entry
from shadefs.cache.handles import HandleLedger
from shadefs.cache.policies import Policy
from shadefs.cache.ssd.tier import SsdTier
from shadefs.prefetch.prefetcher import Prefetcher
from shadefs.readers.batch import BATCH_MIN
from shadefs.readers.jobs import Job
from shadefs.readers.part import Readers
from shadefs.stats import Metrics

# Hits whose bookkeeping waits (`Hits.hit`) at most. Mostly the readers' tick (50 ms) or
# another request takes the log in first; each numpy call of a batch meets its code cold
# (~100 us a batch of 64 in the daemon), so the longer the batch the less a hit pays for it:
# ~2 us a hit at 64, ~1 at 1024 (bench_cpu's warm passes, timed inside the daemon).
HIT_LOG = 1024


class Hits:
    """The cache's hit bookkeeping; the cache supplies the attributes."""

    metrics: Metrics
    entries: dict[int, Entry]
    readers: Readers
    prefetcher: Prefetcher | None
    policy: Policy
    ssd: SsdTier | None
    handles: HandleLedger
    ram_hits: int

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
        job's batch in numpy where the tracker can (readers/batch.py)."""
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
