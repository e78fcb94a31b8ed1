"""Clairvoyant prefetching: fetch the upcoming misses of a known order before they are read.

Once the daemon knows the future, a miss should cost bandwidth but not a stall (NoPFS). The
future comes from *plans* (prefetch/plans.py): a rank's share of an epoch's PADS order, a
job's `.shadefs/plan`, or speculation's guess. The reader's position in a plan is inferred
from its opens, so the reading processes need not cooperate.

Prefetched files go into a *staging buffer*, bounded in bytes by the lookahead window and
separate from the cache budget (NoPFS's staging class): prefetching never evicts anything.
A reader that opens a staged file is served from staging, and the cache's policy decides,
as for any miss, whether it stays. The Belady policy uses `next_use`.

Scheduling (Lobster):

- per-reader balance: the next fetch goes to the plan with the fewest entries buffered ahead
  of its reader, so the reader closest to a stall is served first;
- adaptive concurrency: by Little's law, the fetches in flight needed to keep up are the
  readers' consumption rate times the source latency (both measured, EWMA), at most
  `max_workers`: the readers never starve, the source is never flooded;
- batches: one fetch call reads as many files in one worker thread as the source reads in
  about `_BATCH_SECONDS` (a thread hop costs more CPU than reading a small file from a fast
  source; a slow one, NFS, gets one file per call, and parallel calls). A round runs when a
  batch lands, when a take frees room in a window that held the last round back, or when a
  reader's pace (measured anew every 16 reads: `Plan.paced`) allows more calls: never per open.
  A landed file is staged if the plan it was taken for still reads it at that position, or
  another plan reads it (one numpy pass per plan, run only when there are several).

A sweep group's plan has several readers (`Plan.readers`: members reading one order at
their own paces; the cursor follows the fastest). What is staged for it, and a file the RAM
tier lets go while other jobs still open it this epoch (`hold`), stays staged for those
opens (holds.py).

Every byte fetched once: an entry its reader already opened is never fetched, a reader that
opens a file being prefetched joins that flight (`late`), and a file a known order replays
stays staged for its next read (within the window's reach of the plan, or anywhere while
such replays hold at most a quarter of the window). A speculative plan (speculate.py) is
staged like any other, but the policies' `planned` and `next_use` ignore it (a guess). A
plan ends when its reader reaches the end, is replaced, or is abandoned (no progress for
`abandon_after` s): its staged leftovers are dropped (`wasted`), and so is what lands for
it later (`unused`). The cache hands it `fetch_ahead` (a fetch that shares single flight
with readers and admits nothing; an SSD tier's entries are read from there) and `tier_of`
(RAM: no staging; SSD: staged, up to 16 per batch whatever the source's pace), and
`kernel_serves`: a planned file whose reads the kernel's own pages will serve is left to
them (`kernel_held`): staged, it would be fetched and never read.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
import pyfuse3
import trio

from shadefs.file_version import Signature
from shadefs.kernel.pages import KernelPages
from shadefs.prefetch.fetching import RAM, SSD, FetchAhead, Item, Of, PrefetchSettings
from shadefs.prefetch.holds import Holds
from shadefs.prefetch.plans import Plan
from shadefs.stats import PrefetchStats

__all__ = ["Plan", "Prefetcher"]

log = logging.getLogger(__name__)

_Origin = tuple[Plan, int]  # the plan and position a fetched item was taken from
_Landed = list[tuple[int, bytes, Signature]]  # fetched files: key, bytes, signature
_Pick = tuple[Plan, int, int, int, int]  # the next file to fetch: plan, position, key, size, tier

_EWMA = 0.2
# A batch reads about this long in its worker thread (the source's own time per file).
_BATCH_SECONDS = 0.002
_BATCH_FILES = 16
_BATCH_BYTES = 4 << 20
_COUNTERS = ("fetched", "fetched_bytes", "served", "wasted", "errors", "skipped", "plans_done",
             "plans_abandoned", "kept", "late", "unused", "kernel_held")  # fmt: skip


class Prefetcher:
    """Fetches the upcoming misses of every active plan into a bounded staging buffer."""

    @classmethod
    def with_settings(
        cls,
        settings: PrefetchSettings,
        fetch_ahead: FetchAhead,
        tier_of: Of,
        reads_left: Of,
        clock: Callable[[], float] = time.monotonic,
        kernel: KernelPages | None = None,
        no_open: bool = False,
    ) -> Prefetcher:
        return cls(
            fetch_ahead,
            tier_of,
            reads_left,
            clock=clock,
            kernel=kernel,
            no_open=no_open,
            **dataclasses.asdict(settings),
        )

    def __init__(
        self,
        fetch_ahead: FetchAhead,
        tier_of: Of,
        reads_left: Of | None = None,
        *,
        window: int,
        max_workers: int = 16,
        abandon_after: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        kernel: KernelPages | None = None,
        no_open: bool = False,
    ) -> None:
        """`clock`: seconds, for the plans' pace and idleness and the fetches' latency.
        `kernel`: which files the kernel may hold pages of (`_kernel_serves`); `no_open`:
        the mount serves with kernel hits (kernel/no_open.py)."""
        self._clock = clock
        self._kernel = kernel
        self._no_open = no_open
        self._trusted = kernel.trusted if kernel is not None else False
        self._fetch_ahead = fetch_ahead
        self._tier_of = tier_of
        self._reads_left = reads_left  # a key's reads to come while a sweep group reads
        self.window = window
        self.max_workers = max_workers
        self.abandon_after = abandon_after
        self.plans: dict[str, Plan] = {}
        self.staged: dict[int, tuple[bytes, Signature]] = {}
        self.staged_bytes = 0
        self.holds = Holds()  # staged keys that a sweep group's members will still open
        self._inflight: dict[int, int] = {}  # key -> size
        self._calls = 0  # fetch calls (batches) in flight
        self._held_back = False  # the last round stopped at a full window
        self._replays: set[int] = set()  # staged keys held for a replay beyond the window
        self._replay_bytes = 0
        self._inflight_bytes = 0
        self._wake = trio.Event()
        self.latency = 0.01  # seconds per fetch call, EWMA
        self.file_seconds = 0.0005  # the source's own seconds per file, EWMA
        self.fetched = self.fetched_bytes = self.served = self.wasted = 0  # counters
        self.errors = self.skipped = self.plans_done = self.plans_abandoned = self.kept = 0
        self.late = self.unused = 0  # served from a flight; landed unread by any plan
        self.kernel_held = 0  # planned files left to the kernel's pages
        self._joined: set[int] = set()  # keys in flight whose reader waits for the bytes

    # --- plans --------------------------------------------------------------------------

    def add_plan(self, plan: Plan) -> None:
        old = self.plans.pop(plan.name, None)
        if old is not None:
            log.debug("plan %s replaced", plan.name)
        self.plans[plan.name] = plan
        plan.stamp(self._clock())
        if len(plan):
            plan.span = int(self.window // max(1.0, float(plan.sizes.mean())))
        if self.staged or self._inflight:
            # What is staged or on its way needs no fetch: where the plan's order allows,
            # it goes first and the frontier starts past it (a speculative plan's remake).
            ahead = itertools.chain(self.staged, self._inflight)
            keys = np.fromiter((k for k in ahead if k >= 0), dtype=np.uint64)
            plan.frontier = max(plan.frontier, plan.lead(keys))
        self._drop_unplanned()
        self._wake.set()
        log.info("prefetch plan %s: %d reads", plan.name, len(plan))

    def drop_plan(self, name: str) -> bool:
        if self.plans.pop(name, None) is None:
            return False
        self._drop_unplanned()
        return True

    def observe(self, key: int) -> None:
        """Called for every open of a regular file (the readers' progress). A wake per read
        ran a round per open, each fetching the one file whose room the read freed: only a
        new pace that allows more calls wakes the scheduler (module doc)."""
        now = self._clock()
        paced = False
        for plan in self.plans.values():
            if plan.observe(key, now) and plan.paced:
                paced = True
        if paced and self._calls < self.target_workers():
            self._wake.set()
        if key in self.staged and self._tier_of(key) == RAM:
            self._unstage(key)  # kept staged for this read, and cached since: a hit
        self.holds.opened(key)  # one more of a group's opens: the last one releases it

    def planned(self, keys: np.ndarray) -> np.ndarray:
        """Which of `keys` some plan reads from its cursor on (one numpy pass per plan)."""
        mask = np.zeros(len(keys), dtype=bool)
        for plan in self.plans.values():
            if plan.speculative:
                continue
            mask |= np.isin(keys, plan.keys[plan.cursor :].astype(np.int64))
        return mask

    def next_use(self, key: int) -> float:
        """Estimated monotonic time of `key`'s next read over all plans (inf if none).

        Anchored at each plan's last observed progress rather than at "now", so that an
        estimate stays put while the reader keeps its pace (the Belady policy relies on it).
        """
        best = math.inf
        for plan in self.plans.values():
            if plan.speculative:
                continue
            reads = plan.next_use(key)
            if reads != math.inf:
                best = min(best, plan.last_progress + reads / max(plan.rate, 1e-3))
        return best

    # --- the read side --------------------------------------------------------------------

    def take(self, key: int, sig: Signature) -> bytes | None:
        """The staged bytes of `key` if they match the file's current signature."""
        item = self.staged.get(key)
        if item is None:
            return None
        data, staged_sig = item
        if staged_sig == sig and (key in self.holds or self._wanted_again(key, len(data))):
            # A group's member behind the fastest will open it too, or its reader reads it
            # again soon (a replayed sample): keep it staged rather than fetch it twice.
            self.served += 1
            return data
        self._unstage(key)
        if self._held_back and self.staged_bytes + self._inflight_bytes <= self.window - min(
            self.window // 8, _BATCH_BYTES
        ):
            self._wake.set()  # room for a batch in a window that held the last round back
        if staged_sig != sig:
            self.wasted += 1
            return None
        self.served += 1
        return data

    def joined(self, key: int) -> None:
        """A reader waits for the bytes of `key`'s prefetch in flight (`_stage` counts it)."""
        if key in self._inflight:
            self._joined.add(key)

    def hold(self, key: int, data: bytes, sig: Signature, wanted: int = 0) -> bool:
        """Keep bytes the cache let go staged for their reads to come (holds.py): a sweep
        group's, or `wanted` other jobs' this epoch; False without any, or window room."""
        reads = max(self._reads_left(key) if self._reads_left else 0, wanted)
        if reads <= 0:
            return False
        if key not in self.staged:
            if self.staged_bytes + self._inflight_bytes + len(data) > self.window:
                return False
            self.staged[key] = (data, sig)
            self.staged_bytes += len(data)
            self.kept += 1
        self.holds.hold(key, reads, self._clock())
        return True

    def _wanted_again(self, key: int, size: int) -> bool:
        """Whether a known order reads `key` again: within what the window covers of the
        plan, or further on while the replays held that way take a quarter of the window."""
        for plan in self.plans.values():
            if plan.speculative:
                continue
            reads = plan.next_use(key)
            if reads == math.inf:
                continue
            if reads <= max(plan.frontier - plan.cursor, plan.span):
                return True
            if key in self._replays or self._replay_bytes + size <= self.window // 4:
                if key not in self._replays:
                    self._replays.add(key)
                    self._replay_bytes += size
                return True
        return False

    def _unstage(self, key: int) -> None:
        data, _ = self.staged.pop(key)
        self.staged_bytes -= len(data)
        if key in self._replays:
            self._replays.discard(key)
            self._replay_bytes -= len(data)
        self.holds.release(key)

    # --- the fetch side -------------------------------------------------------------------

    def batch_size(self) -> int:
        """Files per fetch call: what the source reads in about _BATCH_SECONDS."""
        return max(1, min(_BATCH_FILES, int(_BATCH_SECONDS / max(self.file_seconds, 1e-6))))

    def target_workers(self) -> int:
        """Fetch calls in flight: each brings `batch_size` files per `latency` seconds."""
        rate = sum(p.rate for p in self.plans.values() if not p.done)
        need = rate * self.latency / self.batch_size()
        return max(1, min(self.max_workers, math.ceil(need) + 1))

    def _next_item(self, active: list[Plan] | None = None) -> _Pick | None:
        """The next file to fetch, of the plans not done (`active`: `_next_batch`'s list)."""
        if active is None:
            active = [p for p in self.plans.values() if not p.done]
        if len(active) > 1:  # Lobster: the reader with the least buffered ahead goes first
            active.sort(key=lambda p: max(p.frontier - p.cursor, 0))
        staged, inflight, tier_of = self.staged, self._inflight, self._tier_of
        for plan in active:
            plan.frontier = max(plan.frontier, plan.cursor)
            keys, sizes, n = plan.keys, plan.sizes, len(plan)
            while plan.frontier < n:
                pos = plan.frontier
                size = int(sizes[pos])
                if self.staged_bytes + self._inflight_bytes + size > self.window:
                    if size > self.window:
                        plan.frontier += 1  # can never fit: the reader fetches it itself
                        self.skipped += 1
                        continue
                    self._held_back = True
                    break  # window full for now: try the next plan
                plan.frontier += 1
                key = int(keys[pos])
                if key in staged or key in inflight:
                    continue
                if plan.consumed(pos):
                    # Its reader already opened it (workers read ahead of the cursor): a
                    # fetch now would bring the same bytes over the link a second time.
                    continue
                tier = tier_of(key)
                if tier != RAM:
                    if self._trusted and self._kernel_serves(key, tier):
                        self.kernel_held += 1
                        continue
                    return plan, pos, key, size, tier
        return None

    def _kernel_serves(self, key: int, tier: int) -> bool:
        """Whether the kernel's own pages will serve the reads of file `key` (in `tier`),
        while most files it was thought to hold turned out held (`_trusted`): one it may
        hold. With opens, not a file on the SSD tier: its open reads the entry whatever
        the kernel holds, and staging it spares the reader that read."""
        kernel = self._kernel
        return kernel is not None and kernel.holds(key) and (self._no_open or tier != SSD)

    def _trust(self) -> None:
        """Take the kernel pages' trust anew for this round. Once it is lost, the plans'
        frontiers go back to their readers: the files left to the kernel are fetched."""
        kernel = self._kernel
        if kernel is None:
            return
        trusted = kernel.trusted
        if self._trusted and not trusted:
            for plan in self.plans.values():
                plan.frontier = plan.cursor
        self._trusted = trusted

    def start(self, nursery: trio.Nursery) -> None:
        """Run the scheduler in `nursery` until it is cancelled (unmount)."""
        nursery.start_soon(self.run)

    async def run(self) -> None:
        """The scheduler; runs until cancelled (unmount)."""
        async with trio.open_nursery() as nursery:
            while True:
                with trio.move_on_after(0.5):
                    await self._wake.wait()
                self._wake = trio.Event()
                self._held_back = False
                self._trust()
                self._expire()
                while self._calls < self.target_workers():
                    batch, origins = self._next_batch()
                    if not batch:
                        break
                    self._calls += 1
                    nursery.start_soon(self._fetch, batch, origins)

    def _next_batch(self) -> tuple[list[Item], list[_Origin]]:
        """The next fetch call's items, counted in flight, and where each was taken from."""
        batch: list[Item] = []
        origins: list[_Origin] = []
        n, nbytes, remote = self.batch_size(), 0, 0
        active = [p for p in self.plans.values() if not p.done]  # (no read in a batch)
        while remote < n and len(batch) < _BATCH_FILES and nbytes < _BATCH_BYTES:
            pick = self._next_item(active)
            if pick is None:
                break
            plan, pos, key, size, tier = pick
            remote += tier != SSD  # an SSD entry is read in no time
            self._inflight[key] = size
            self._inflight_bytes += size
            nbytes += size
            batch.append((key, plan.paths[pos], size))
            origins.append((plan, pos))
        return batch, origins

    async def _fetch(self, batch: Sequence[Item], origins: Sequence[_Origin]) -> None:
        """One fetch call: `batch`'s files read in one worker thread, then staged."""
        t0 = self._clock()
        try:
            got, seconds = await self._fetch_ahead(batch)
        except pyfuse3.FUSEError as exc:
            self.errors += len(batch)
            log.debug("prefetch of %d files failed: errno %d", len(batch), exc.errno)
            return
        finally:
            self._calls -= 1
            for key, _, size in batch:
                del self._inflight[key]
                self._inflight_bytes -= size
            self._wake.set()
            joined = self._joined.intersection([key for key, _, _ in batch])
            self._joined -= joined
        self.latency = (1 - _EWMA) * self.latency + _EWMA * (self._clock() - t0)
        if seconds > 0:
            self.file_seconds = (1 - _EWMA) * self.file_seconds + _EWMA * seconds
        # `_stage` asks the plans, never their planner: a fetch re-enters no planner.
        landed: _Landed = []
        froms: list[_Origin] = []
        for (key, path, _), one, origin in zip(batch, got, origins, strict=True):
            if isinstance(one, BaseException):
                self.errors += 1
                log.debug("prefetch of %r failed: %r", path, one)
            elif one is not None:
                landed.append((key, *one))
                froms.append(origin)
                self.fetched += 1
                self.fetched_bytes += len(one[0])
        if landed:
            self._stage(landed, froms, joined)

    def _stage(self, landed: _Landed, origins: list[_Origin], joined: set[int]) -> None:
        """Stage the fetched files that some plan still reads: the plan an item came from
        is asked at its position, every other plan in one vectorised pass. `joined`: keys
        whose reader waits for these bytes (served late, unless staged for a later read)."""
        plans = self.plans
        readers = [
            plan.readers if plans.get(plan.name) is plan and not plan.consumed(pos) else 0
            for plan, pos in origins
        ]
        if len(plans) > 1 or not all(readers):  # (a replayed key reads on further on)
            keys = np.array([k for k, _, _ in landed], dtype=np.uint64)
            most = np.array(readers, dtype=np.int64)
            for plan in plans.values():
                most = np.maximum(most, np.where(plan.unread(keys), plan.readers, 0))
            readers = most.tolist()
        now = self._clock()
        for (key, data, sig), n in zip(landed, readers, strict=True):
            if n > 1 and self._reads_left is not None:  # all reads to come, not one a member
                n = max(n, self._reads_left(key))
            if not n or key in self.staged or self._tier_of(key) == RAM:
                if key in joined:  # its reader takes the bytes from the flight: served
                    self.late += 1
                    self.served += 1
                else:  # no plan reads it any more (it ended or was replaced in flight)
                    self.unused += 1
                continue
            self.staged[key] = (data, sig)
            self.staged_bytes += len(data)
            if n > 1:
                self.holds.hold(key, n, now)

    def _expire(self) -> None:
        now = self._clock()
        ended = []
        for name, plan in self.plans.items():
            if plan.done:
                self.plans_done += 1
                ended.append(name)
            elif now - plan.last_progress > self.abandon_after:
                self.plans_abandoned += 1
                log.info("prefetch plan %s abandoned at %d of %d", name, plan.cursor, len(plan))
                ended.append(name)
        for name in ended:
            del self.plans[name]
        if self.holds.expire(now, self.abandon_after) or ended:
            self._drop_unplanned()

    def _drop_unplanned(self) -> None:
        """Unstage what no plan reads any more (one vectorised pass per plan: a plan is
        replaced, for speculation several times a second, with thousands staged)."""
        if not self.staged:
            return
        keys = np.fromiter(self.staged, dtype=np.uint64, count=len(self.staged))
        planned = np.zeros(len(keys), dtype=bool)
        for plan in self.plans.values():
            planned |= plan.unread(keys)
        held = self.holds
        for key in keys[~planned].tolist():
            if key not in held:
                self._unstage(key)
                self.wasted += 1

    def describe(self) -> PrefetchStats:
        return PrefetchStats(
            plans=len(self.plans),
            plan_positions={n: (p.cursor, len(p)) for n, p in self.plans.items()},
            staged=len(self.staged),
            staged_bytes=self.staged_bytes,
            inflight=len(self._inflight),
            workers_target=self.target_workers(),
            latency_ms=round(self.latency * 1000, 3),
            window=self.window,
            **{name: getattr(self, name) for name in _COUNTERS},
        )
