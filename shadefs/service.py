"""The daemon's service object: it owns the parts of one mount and does what control asks.

`Service(opts)` builds the parts in the order data flows, each handed what it needs at
construction and nothing wired afterwards:

    source -> namespace -> sampling -> readers -> cache (builds its SSD tier and prefetcher)
           -> control (sees this object as a ControlService) -> operations (pyfuse3)

`start(nursery)` starts every part's background tasks in the nursery the daemon hands it;
`close()` releases what outlives the request loop (the SSD directory lock). The methods
after the parts are what the control directory asks for (control/service.py is the
contract): control parses and validates a request, and each method hands it to the part
that owns it (order plans: prefetch/orders.py; a partition change: the cache's
`reclassify`; listings for the readers: the namespace; the SSD budget: cache/ssd/budget.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import trio

from shadefs.cache.blocks import Blocks
from shadefs.cache.coordinator import Cache
from shadefs.cache.face import CacheFace
from shadefs.cache.policies import POLICIES
from shadefs.cache.ssd.budget import ssd_defaults
from shadefs.cache.ssd.owner import CacheUntrusted
from shadefs.cache.ssd.store import CacheLocked, SsdStore
from shadefs.cache.ssd.tier import SsdTier
from shadefs.common import EXIT_CACHE_LOCKED, EXIT_USAGE, QuietError
from shadefs.control.files import Control
from shadefs.control.service import RESIDENCY_STATES, DatasetInfo, Rejected
from shadefs.fs.namespace import Namespace
from shadefs.fs.operations import Operations
from shadefs.kernel import no_open
from shadefs.kernel.pages import KernelPages
from shadefs.ops.looplag import LoopLag
from shadefs.options import MountOptions
from shadefs.prefetch.fetching import PrefetchSettings
from shadefs.prefetch.orders import OrderPlans
from shadefs.prefetch.plans import ctl_name
from shadefs.prefetch.prefetcher import Plan, Prefetcher
from shadefs.prefetch.speculate import Speculator
from shadefs.readers.jobs import JobTable
from shadefs.readers.part import Readers
from shadefs.sampling.builds import resident_among
from shadefs.sampling.registry import Sampling, SamplingError
from shadefs.sampling.wire import OrderRequest, WireError
from shadefs.sampling.wire_nodes import NodeOrder
from shadefs.source.part import Source
from shadefs.stats import VERSION as STATS_VERSION
from shadefs.stats import JobStats, Metrics, Stats

log = logging.getLogger(__name__)


class Service:
    """The parts of one mount, and the service methods that control calls.

    :source: every access to SRC
    :namespace: inode <-> path, stat snapshots, revalidation
    :metrics: the data path's counters
    :sampling: the sampler's registered dataset, importance table and orders
    :cache: the RAM tier, and the owner of the SSD tier and the prefetcher
    :ssd: the cache's SSD tier, or None without --ssd (read-only)
    :prefetcher: the cache's prefetcher, or None with --no-prefetch (read-only)
    :control: the `.shadefs` directory
    :operations: the pyfuse3 request handlers that the daemon mounts
    """

    def __init__(self, opts: MountOptions, clock: Callable[[], float] = time.monotonic) -> None:
        """Build the parts for `opts`; QuietError when the SSD cache cannot be used. `clock`:
        seconds, the one clock of every part that keeps time (tests hand one they move)."""
        self.mountpoint = os.path.abspath(opts.mountpoint)
        self.source = Source(
            opts.source,
            max_threads=opts.source_threads,
            timeout=opts.source_timeout,
            inline=opts.inline_reads,
            clock=clock,
        )
        self.namespace = Namespace(
            self.source, timeout=opts.revalidate, revalidate=opts.revalidate, clock=clock
        )
        self.metrics = Metrics()
        self.sampling = Sampling()
        listing_of = self.namespace.listing_of_file
        self.readers = Readers(
            JobTable(opts.job_idle, clock=clock), self.sampling.pending, listing_of
        )
        ssd = self._ssd_store(opts) if opts.ssd else None
        prefetch = None
        block_size = max(opts.block_size, 4096)
        if opts.prefetch:
            window = opts.prefetch_window_bytes
            prefetch = PrefetchSettings(window, opts.prefetch_workers, opts.prefetch_abandon)
        self.kernel_hits = no_open.resolve(opts.kernel_hits)
        # Which files the kernel may hold pages of: one map, read by the opens, deferred
        # opens, the prefetcher and speculation.
        self.kernel_pages = KernelPages()
        self.cache = Cache(
            self.source,
            self.metrics,
            capacity=opts.ram,
            policy=opts.policy,
            score_of=self.sampling.score_of,
            max_entry=opts.max_entry,
            handle_limit=opts.handle_limit,
            ssd=ssd,
            key_of_ino=self.namespace.numbers.key_of_ino,
            prefetch=prefetch,
            readers=self.readers,
            owns=self.sampling.owns_key,
            block_size=block_size,
            kernel_pages=self.kernel_pages,
            clock=clock,
            no_open=self.kernel_hits,
        )
        self.speculator = Speculator(
            self.cache, self.kernel_pages, enabled=opts.speculate, clock=clock
        )
        pf = self.cache.prefetcher
        self._orders = OrderPlans(pf) if pf is not None else None  # the sampler's orders
        # Read-ahead inside large files shares the prefetch window's size.
        window = prefetch.window if prefetch is not None else 0
        self.blocks = Blocks(
            self.cache,
            self.source,
            block_size=block_size,
            window=window,
            passthrough_above=opts.passthrough_above,
            clock=clock,
        )
        self.loop_lag = LoopLag()
        self.control = Control(self, self.stats, self.metrics, sessions=self.kernel_hits)
        face = CacheFace(self.cache, self.blocks)
        parts = (self.namespace, face, self.control, self.metrics, self.source)
        self.operations = Operations(
            *parts, kernel_pages=self.kernel_pages, kernel_hits=self.kernel_hits
        )

    @staticmethod
    def _ssd_store(opts: MountOptions) -> SsdStore:
        assert opts.ssd is not None
        try:
            budget, floor = ssd_defaults(opts.ssd, opts.ssd_size, opts.ssd_min_free)
            return SsdStore(Path(opts.ssd), budget, min_free=floor)
        except CacheLocked as exc:
            raise QuietError(str(exc), EXIT_CACHE_LOCKED) from None
        except CacheUntrusted as exc:
            raise QuietError(str(exc), EXIT_USAGE) from None
        except OSError as exc:
            raise QuietError(f"cache directory {opts.ssd}: {exc.strerror}", EXIT_USAGE) from None

    @property
    def ssd(self) -> SsdTier | None:
        """The cache's SSD tier (None without --ssd)."""
        return self.cache.ssd

    @property
    def prefetcher(self) -> Prefetcher | None:
        """The cache's prefetcher (None with --no-prefetch)."""
        return self.cache.prefetcher

    def start(self, nursery: trio.Nursery) -> None:
        """Start the parts' background tasks (SSD restore and writers, prefetching)."""
        self.cache.start(nursery)
        nursery.start_soon(self.speculator.run)
        nursery.start_soon(self.loop_lag.run)
        nursery.start_soon(self.namespace.relist)
        if self.control.sessions:
            nursery.start_soon(self.control.run)
        if self.prefetcher is not None:
            self.blocks.start(nursery)

    def close(self) -> None:
        """Release the SSD cache directory; call after the request loop has ended."""
        self.cache.close()

    def stats(self) -> Stats:
        """Everything stats.json reports, from each part's describe() (in the trio thread)."""
        self.cache.take_hits()
        pf, blocks = self.prefetcher, self.blocks
        return Stats(
            version=STATS_VERSION,
            pid=os.getpid(),
            mountpoint=self.mountpoint,
            uptime_s=round(time.time() - self.metrics.started, 3),
            counters=self.metrics.describe(),
            source=self.source.describe(),
            namespace=self.namespace.describe(),
            cache=self.cache.describe(),
            sampler=self.sampling.describe(),
            prefetch=pf.describe() if pf is not None else None,
            jobs=self.jobs(),
            blocks=blocks.describe() if blocks is not None else None,
            loop_lag_max_ms=self.loop_lag.take(),
        )

    def jobs(self) -> tuple[JobStats, ...]:
        """The active jobs (stats.json `jobs`), each with its epoch from the tracker.
        Reading them changes nothing: the readers' sweep ends idle jobs."""
        return tuple(self.readers.describe())

    # --- ControlService: what can be asked for -------------------------------------------

    @property
    def policy_names(self) -> Sequence[str]:
        return POLICIES

    @property
    def has_ssd(self) -> bool:
        return self.ssd is not None

    @property
    def prefetching(self) -> bool:
        return self.prefetcher is not None

    def plan_names(self) -> list[str]:
        return list(self.prefetcher.plans) if self.prefetcher is not None else []

    async def resolve_files(self, rels: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        found = await self.namespace.resolve(rels)
        bad = np.flatnonzero(found.mode & stat.S_IFMT(0o177777) != stat.S_IFREG)
        if len(bad):
            rel = rels[int(bad[0])]
            raise Rejected(f"{os.fsdecode(rel)!r} is not a regular file in the mount")
        return found.ino, found.size

    async def residency(self, rels: list[bytes]) -> list[str]:
        found = await self.namespace.resolve(rels)
        regular = (found.mode & stat.S_IFMT(0o177777)) == stat.S_IFREG
        # tier_of: 0 not cached, 1 RAM, 2 SSD only; the states list them in that order.
        return [
            RESIDENCY_STATES[self._tier_of(key)] if ok else "missing"
            for key, ok in zip(found.ino.tolist(), regular.tolist(), strict=True)
        ]

    def _tier_of(self, key: int) -> int:
        tier = self.cache.tier_of(key)
        if tier or self.blocks is None:
            return tier
        return self.blocks.tier_of(key)  # a file cached in blocks: all of them

    # --- ControlService: ctl commands -----------------------------------------------------

    def set_policy(self, name: str) -> None:
        try:
            self.cache.set_policy(name)
        except ValueError as exc:  # an unknown name: nothing was changed
            raise Rejected(str(exc)) from None

    def set_ram(self, size: int) -> None:
        self.cache.set_capacity(size)

    async def set_ssd(self, size: int) -> None:
        if self.ssd is None:
            raise Rejected("no SSD tier: mount with --ssd DIR[:SIZE]")
        await self.ssd.set_capacity(size)
        self.cache.refresh_limits()

    def drop_ram(self) -> int:
        return self.cache.drop()

    async def evict(self, keys: np.ndarray) -> int:
        blocks, evicted = self.blocks, 0
        for key in keys.tolist():
            found = await self.cache.evict(key)
            if blocks is not None:
                found = await blocks.evict(key) or found  # a file cached in blocks
            evicted += found
        return evicted

    def prefetch(
        self, rels: list[bytes], keys: np.ndarray, sizes: np.ndarray, name: str | None = None
    ) -> str:
        prefetcher = self.prefetcher
        if prefetcher is None:
            raise Rejected("prefetching is off (mounted with --no-prefetch)")
        name = name or ctl_name(len(prefetcher.plans))
        prefetcher.add_plan(Plan(name, keys, rels, sizes))
        return name

    def drop_plans(self, names: Sequence[str]) -> int:
        if self.prefetcher is None:
            return 0
        return sum(self.prefetcher.drop_plan(name) for name in names)

    def begin_epoch(self, epoch: int, pid: int = 0) -> None:
        self.sampling.begin_epoch(epoch)
        self.cache.begin_epoch(epoch, self._job_row(pid))

    def _job_row(self, pid: int) -> int | None:
        # The job of a control request's writer; None (every job) when it is unknown.
        return self.readers.row_of(pid)

    def name_job(self, pid: int, name: str, group: str) -> None:
        self.readers.name_job(pid, name, group)

    def report(
        self,
        epoch: int | None,
        train_loss: float | None,
        val_accuracy: float | None,
        pid: int = 0,
    ) -> str:
        with _refusing():
            result = self.sampling.report(epoch, train_loss, val_accuracy)
        if epoch is not None:
            self.cache.begin_epoch(epoch, self._job_row(pid))
        return result

    def set_replay(self, value: float | None) -> None:
        with _refusing():
            self.sampling.set_replay(value)

    def set_log_level(self, level: str) -> None:
        logging.getLogger("shadefs").setLevel(level.upper())

    # --- ControlService: the sampler's channel --------------------------------------------

    async def register_dataset(self, paths: list[str]) -> None:
        with _refusing():
            await self.sampling.register(paths, self.resolve_files)
        # The readers' per-file columns take their size now, not by doublings while the
        # jobs read (a doubling at a million files holds the event loop ~50 ms).
        self.readers.tracker.reserve(self.sampling.n)

    def dataset_info(self) -> DatasetInfo:
        s = self.sampling
        return DatasetInfo(samples=s.n, registered_at=s.registered_at, resolved=len(s.keys))

    def ingest_losses(self, message: bytes) -> int:
        with _refusing():
            return self.sampling.ingest(message)

    async def order(self, request: OrderRequest, pid: int = 0) -> np.ndarray:
        group = self.readers.jobs.group_of(pid) if pid > 0 else ""
        members = self.readers.jobs.members(group) if group else 1
        with _refusing():
            share = await self.sampling.order_async(
                request, self.cache.cached_keys, group, self._job_row(pid), members
            )
        self.cache.begin_epoch(request.epoch, self._job_row(pid))
        if self.sampling.reads_here(request) and self._orders is not None:
            # This rank reads through this node: what it reads next is known.
            s = self.sampling
            await self._orders.install(
                epoch=request.epoch,
                seed=request.seed,
                group=group,
                members=members,
                world_size=request.world_size,
                rank=request.rank,
                dataset=(s.keys, s.paths, s.sizes),
                share=share,
            )
        return share

    async def resident_bitmap(self, n: int) -> np.ndarray:
        s = self.sampling
        if n != s.n:
            raise Rejected(f"residency asked for {n} samples, but {s.n} are registered")
        # A set test over every sample: over snapshots, in a worker thread.
        return await trio.to_thread.run_sync(resident_among, s.keys, self.cache.cached_keys())

    async def install_order(self, msg: NodeOrder) -> np.ndarray:
        before = self.sampling.partition
        with _refusing():
            order = await self.sampling.install_async(msg)
        after = self.sampling.partition
        if before is None or after is None or before[0] is not after[0] or before[1] != after[1]:
            await self.cache.reclassify(self.sampling.unowned)
        return order


@contextlib.contextmanager
def _refusing() -> Iterator[None]:
    """The parts' own refusals, as the Rejected that control turns into EINVAL."""
    try:
        yield
    except (SamplingError, WireError) as exc:
        raise Rejected(str(exc)) from None
