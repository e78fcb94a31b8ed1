"""The daemon's side of importance-aware sampling: the registered dataset and its table.

The torch sampler registers its file list once (its index order defines the sample ids),
reports per-sample losses, and asks for each epoch's order. This module owns:

- the sample id <-> cache key mapping (cache keys are inode numbers): a numpy array of the
  key of every sample, plus a sorted copy for key -> sample id lookups by binary search, and
  the paths in one bytes buffer with an offset array (`PathTable`), so per-sample state
  stays in compact arrays even at 14 M samples;
- the importance table (importance.py) and the replay factor (pads.ReplayController, or a
  fixed r);
- the epoch order (pads.py), built once per (epoch, seed, world size) and then sliced for
  each rank. Building it once matters for correctness, not just speed: the table and the
  resident set change while an epoch runs, and ranks that asked at different moments must
  still get disjoint shares of one global list. The jobs of a sweep group (several
  trainings over one dataset) share one order per (group, epoch, world size), whatever
  seed each passes: the group's first request decides it, and the others get the same
  list, so that each file is fetched once for all of them.

It makes no I/O of its own: resolving paths goes through the namespace given to it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import overload

import numpy as np
import trio

from shadefs.readers.pending import PendingReads
from shadefs.sampling import builds, pads, wire
from shadefs.sampling.importance import NEUTRAL_SCORE, ImportanceTable
from shadefs.sampling.wire_nodes import NodeOrder
from shadefs.stats import SamplerStats

log = logging.getLogger(__name__)

# How many global orders to keep (the current one and a straggler's, per group).
_ORDERS_KEPT = 8
# How many installed epochs of a multi-node job to keep (8 bytes per entry each).
_SHARES_KEPT = 3


class SamplingError(ValueError):
    """Input the sampler channel rejects (EINVAL); the message says why."""


class PathTable(Sequence[bytes]):
    """Relative paths in one bytes buffer (newline-separated) plus an array of their starts:
    no object per path.

    Indexing builds the one path asked for; `take(ids)` is a view of some of them in another
    order (what a prefetch plan reads), sharing the buffer.
    """

    __slots__ = ("_buf", "_starts", "_ids")

    def __init__(self, buf: bytes, starts: np.ndarray, ids: np.ndarray | None = None) -> None:
        self._buf = buf
        self._starts = starts  # n + 1 entries: path i is buf[starts[i] : starts[i + 1] - 1]
        self._ids = ids

    @classmethod
    def of(cls, paths: Sequence[str]) -> PathTable:
        # One join and one scan for the separators: no per-path work in Python.
        buf = "\n".join(paths).encode("utf-8", "surrogateescape") + b"\n" if paths else b""
        nl = np.flatnonzero(np.frombuffer(buf, dtype=np.uint8) == 10)
        starts = np.zeros(len(nl) + 1, dtype=np.int64)
        starts[1:] = nl + 1
        return cls(buf, starts)

    def __len__(self) -> int:
        return len(self._starts) - 1 if self._ids is None else len(self._ids)

    @overload
    def __getitem__(self, i: int) -> bytes: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[bytes]: ...
    def __getitem__(self, i: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if self._ids is not None:
            i = int(self._ids[i])
        elif i < 0:
            i += len(self)
        if not 0 <= i < len(self._starts) - 1:
            raise IndexError(i)
        return self._buf[int(self._starts[i]) : int(self._starts[i + 1]) - 1]

    def all(self) -> list[bytes]:
        """Every path, as a transient list (one C-level split)."""
        assert self._ids is None
        return self._buf.split(b"\n")[:-1] if self._buf else []

    def take(self, ids: np.ndarray) -> PathTable:
        assert self._ids is None
        return PathTable(self._buf, self._starts, ids)

    def same(self, other: PathTable) -> bool:
        return self._buf == other._buf


def _order_key(request: wire.OrderRequest, group: str) -> tuple[str, int, int, int]:
    """(group, epoch, seed, world size): a group's order is whichever seed came first."""
    return (group, request.epoch, -1 if group else request.seed, request.world_size)


class Sampling:
    """The registered dataset, its importance table, and the epoch orders handed out."""

    def __init__(self) -> None:
        self.paths = PathTable(b"", np.zeros(1, dtype=np.int64))
        self.keys = np.zeros(0, dtype=np.uint64)
        self.sizes = np.zeros(0, dtype=np.int64)
        self._sorted_keys = np.zeros(0, dtype=np.uint64)
        self._sorted_ids = np.zeros(0, dtype=np.int64)
        self.table = ImportanceTable(0)
        self.pending = PendingReads(self.sample_of)  # reads to come of the known orders
        self.replay = pads.ReplayController()
        self.fixed_replay: float | None = None
        self.epoch = 0
        self.registered_at = 0.0
        self.orders_served = 0
        self.losses_ingested = 0
        self.reports = 0
        self.last_report: dict[str, float] = {}
        self._orders: OrderedDict[tuple[str, int, int, int], np.ndarray] = OrderedDict()
        self._building: dict[tuple[str, int, int, int], trio.Event] = {}  # orders in flight
        self._generation = 0  # registrations so far: a build for an older one is dropped
        # A multi-node job's installed epochs: (epoch, seed, world) -> every rank's share.
        self._shares: OrderedDict[tuple[int, int, int], list[np.ndarray]] = OrderedDict()
        self._here: dict[tuple[int, int, int], np.ndarray] = {}  # the ranks on this node
        self.orders_elsewhere = 0  # shares asked for ranks on other nodes: not prefetched
        # (owner node of each sample, this node's index) once a multi-node job installed one.
        self.partition: tuple[np.ndarray, int] | None = None
        self._nodes = 0
        self._owned = 0

    @property
    def n(self) -> int:
        return len(self.keys)

    # --- registration -----------------------------------------------------------------

    async def register(
        self,
        paths: Sequence[str],
        resolve: Callable[[list[bytes]], Awaitable[tuple[np.ndarray, np.ndarray]]],
    ) -> None:
        """Adopt `paths` as the dataset; `resolve` maps them to (cache keys, sizes) or raises."""
        table = PathTable.of(paths)
        if self.n and table.same(self.paths):
            log.info("dataset re-registered unchanged (%d samples): keeping the table", self.n)
            return
        keys, sizes = await resolve(table.all())
        order = np.argsort(keys, kind="stable")
        self.paths = table
        self.keys = keys
        self.sizes = sizes
        self._sorted_keys = keys[order]
        self._sorted_ids = order.astype(np.int64)
        self.table = ImportanceTable(len(paths))
        self.pending.reset(len(paths))
        self._generation += 1
        self._orders.clear()
        self._shares.clear()
        self._here.clear()
        self.partition = None
        self.registered_at = time.time()
        log.info("registered a dataset of %d samples", len(paths))

    def sample_of(self, key: int) -> int:
        """The sample id of cache key `key`, or -1 when it is not a registered sample."""
        sk = self._sorted_keys
        if key < 0:
            return -1
        # A Python int against uint64 keys makes numpy convert the whole array (O(n) per
        # call: 4 ms at 1.28 M); the same dtype is a binary search.
        i = int(np.searchsorted(sk, np.uint64(key)))
        if i < len(sk) and int(sk[i]) == key:
            return int(self._sorted_ids[i])
        return -1

    def score_of(self, key: int) -> float:
        """The importance of cache key `key` (neutral for files outside the dataset)."""
        sid = self.sample_of(key)
        return float(self.table.scores[sid]) if sid >= 0 else NEUTRAL_SCORE

    # --- losses and progress ----------------------------------------------------------

    def ingest(self, message: bytes | bytearray | memoryview) -> int:
        """Decode one SHDL message and feed the table; returns the number of losses."""
        if not self.n:
            raise SamplingError("no dataset registered: write .shadefs/dataset first")
        indices, losses, lengths = wire.decode_losses(message, self.n)
        self.table.ingest(indices, losses, lengths)
        self.losses_ingested += len(indices)
        return len(indices)

    def report(
        self, epoch: int | None, train_loss: float | None, val_accuracy: float | None
    ) -> str:
        for name, value in (("train_loss", train_loss), ("val_accuracy", val_accuracy)):
            if value is not None and not math.isfinite(value):
                raise SamplingError(f"{name} must be finite")
        if epoch is not None:
            self.begin_epoch(epoch)
        self.reports += 1
        self.last_report = {
            k: v
            for k, v in (("train_loss", train_loss), ("val_accuracy", val_accuracy))
            if v is not None
        }
        r = self.replay.report(train_loss=train_loss, val_accuracy=val_accuracy)
        if self.fixed_replay is None:
            return f"replay factor now {r:.2f}"
        return f"replay fixed at {self.fixed_replay:.2f}"

    def set_replay(self, value: float | None) -> None:
        if value is not None and not (math.isfinite(value) and 1.0 <= value <= 64.0):
            raise SamplingError("replay must be between 1 and 64, or auto")
        self.fixed_replay = value

    @property
    def r(self) -> float:
        return self.fixed_replay if self.fixed_replay is not None else self.replay.r

    def begin_epoch(self, epoch: int) -> None:
        self.epoch = max(self.epoch, epoch)

    # --- orders -----------------------------------------------------------------------

    def order(
        self,
        request: wire.OrderRequest,
        resident: Callable[[np.ndarray], np.ndarray],
        group: str = "",
        job: int | None = None,
        members: int = 1,
    ) -> np.ndarray:
        """This rank's share of the epoch (sample ids); `resident(keys)` says which keys are
        cached. The members of sweep group `group` ("" for none) share one order, which
        each member reads whole. The share counts as job `job`'s reads still to come
        (readers/pending.py; None: the node's), and, at the group's first request of the
        epoch, as the reads of its other `members - 1` members. Builds in the caller's
        thread: the daemon uses `order_async`."""
        full = self._known(request, group)
        if full is None:
            params = self._params(request)
            full = builds.build(self.table.scores, resident(self.keys), params)
            self._keep(_order_key(request, group), full)
        return self._serve(request, full, job, group=group, members=members)

    async def order_async(
        self,
        request: wire.OrderRequest,
        cached: Callable[[], Sequence[int] | np.ndarray],
        group: str = "",
        job: int | None = None,
        members: int = 1,
    ) -> np.ndarray:
        """`order`, with the build over snapshots (the scores, `cached()`: every cached key,
        blocks' negative ones included, as a list or an array) in a worker thread, so that
        the event loop goes on serving reads. One build per order at a time (a second
        request waits for it), and its result is kept only if the dataset is still the one
        it was built for."""
        full = self._known(request, group)
        if full is not None:
            return await self._serve_async(request, full, job, group, members)
        key = _order_key(request, group)
        building = self._building.get(key)
        if building is not None:
            await building.wait()
            return await self.order_async(request, cached, group, job, members)
        done = self._building[key] = trio.Event()
        generation = self._generation
        try:
            scores, keys, params = self.table.scores.copy(), self.keys, self._params(request)
            snapshot = cached()  # a copy: the thread must not read the live tiers
            full = await trio.to_thread.run_sync(builds.build_over, scores, keys, snapshot, params)
        finally:
            del self._building[key]
            done.set()
        if generation != self._generation:
            raise SamplingError("the dataset was registered anew while its order was built")
        self._keep(key, full)
        return await self._serve_async(request, full, job, group, members)

    def _known(self, request: wire.OrderRequest, group: str) -> np.ndarray | None:
        """The epoch's order if it is built (a multi-node job's shares: the rank's share)."""
        if not self.n:
            raise SamplingError("no dataset registered: write .shadefs/dataset first")
        self.begin_epoch(request.epoch)
        shares = self._shares.get((request.epoch, request.seed, request.world_size))
        if shares is not None:
            return shares[request.rank]
        return self._orders.get(_order_key(request, group))

    def _params(self, request: wire.OrderRequest) -> pads.OrderParams:
        return pads.OrderParams(
            epoch=request.epoch,
            seed=request.seed,
            world_size=request.world_size,
            rank=0,
            replay=self.r,
        )

    def _keep(self, key: tuple[str, int, int, int], full: np.ndarray) -> None:
        self._orders[key] = full
        while len(self._orders) > _ORDERS_KEPT:
            self._orders.popitem(last=False)

    def _serve(
        self,
        request: wire.OrderRequest,
        full: np.ndarray,
        job: int | None,
        sliced: tuple[np.ndarray, np.ndarray] | None = None,
        group: str = "",
        members: int = 1,
    ) -> np.ndarray:
        """The rank's share of `full`, counted as `job`'s reads to come (and its group's
        other members', readers/pending.py); `sliced`: the share and its reads per
        sample, if `_serve_async` computed them."""
        self.orders_served += 1
        if (request.epoch, request.seed, request.world_size) in self._shares:
            return full  # a multi-node share, counted when it was installed
        share, counts = sliced or (pads.rank_slice(full, request.world_size, request.rank), None)
        ws, rank = request.world_size, request.rank
        self.pending.expect(request.epoch, share, job, (ws, rank), counts, group, members)
        return share

    async def _serve_async(
        self,
        request: wire.OrderRequest,
        full: np.ndarray,
        job: int | None,
        group: str = "",
        members: int = 1,
    ) -> np.ndarray:
        """`_serve`, with the slice and its bincount (over an epoch) in a worker thread."""
        generation, n = self._generation, len(self.pending.left)
        if (request.epoch, request.seed, request.world_size) not in self._shares:
            ws, rank = request.world_size, request.rank
            sliced = await trio.to_thread.run_sync(builds.share_of, full, ws, rank, n)
            if generation != self._generation:
                raise SamplingError("the dataset was registered anew while its order was served")
            return self._serve(request, full, job, sliced, group, members)
        return self._serve(request, full, job)

    def install(self, msg: NodeOrder) -> np.ndarray:
        """Adopt a multi-node job's epoch: the global order (built here from the union of
        every node's residency when the message carries none), each rank's locality-aware
        share of it, and the ownership of the samples. Returns the global order. Computes
        in the caller's thread: the daemon uses `install_async`."""
        if not self.n:
            raise SamplingError("no dataset registered: write .shadefs/dataset first")
        return self._adopt(msg, *builds.place(self.table.scores, self.r, self.n, msg))

    async def install_async(self, msg: NodeOrder) -> np.ndarray:
        """`install`, with the order, the ownership and the shares computed in a worker
        thread (a copy of the scores); adopted only if the dataset is still the same."""
        if not self.n:
            raise SamplingError("no dataset registered: write .shadefs/dataset first")
        generation = self._generation
        scores = self.table.scores.copy()
        placed = await trio.to_thread.run_sync(builds.place, scores, self.r, self.n, msg)
        if generation != self._generation:
            raise SamplingError("the dataset was registered anew while its shares were placed")
        return self._adopt(msg, *placed)

    def _adopt(
        self,
        msg: NodeOrder,
        order: np.ndarray,
        owner: np.ndarray,
        shares: list[np.ndarray],
        here: np.ndarray,
        counts: np.ndarray,
    ) -> np.ndarray:
        """Install a placed epoch; `here`: its reads on this node's ranks, `counts` theirs
        per sample id (counted in the node's pending pool)."""
        self.begin_epoch(msg.epoch)
        self.partition = (owner, msg.me)
        self._nodes = len(msg.node_ids)
        self._owned = int(np.count_nonzero(owner == msg.me))
        self.pending.expect(msg.epoch, here, None, counts=counts)
        key = (msg.epoch, msg.seed, msg.world_size)
        self._shares[key] = shares
        self._here[key] = msg.rank_node == msg.me
        while len(self._shares) > _SHARES_KEPT:
            self._here.pop(self._shares.popitem(last=False)[0], None)
        return order

    def reads_here(self, request: wire.OrderRequest) -> bool:
        """Whether the rank of `request` reads through this node: not when another node's
        rank trains that share of an installed multi-node epoch (any rank may ask for every
        rank's share; the service prefetches only the shares read here)."""
        here = self._here.get((request.epoch, request.seed, request.world_size))
        if here is None or bool(here[request.rank]):
            return True
        self.orders_elsewhere += 1
        return False

    async def unowned(self, keys: list[int]) -> list[int] | None:
        """Those of `keys` (in their order) that another node owns, computed in a worker
        thread; None when the ownership changed meanwhile."""
        partition = self.partition
        if partition is None:
            return []
        owner, me = partition
        sk, ids = self._sorted_keys, self._sorted_ids
        found = await trio.to_thread.run_sync(builds.unowned, keys, sk, ids, owner, me)
        return found if self.partition is partition else None

    def owns_key(self, key: int) -> bool:
        """Whether this node should cache key `key`: in a multi-node job, only the samples
        it owns (and files outside the dataset); otherwise everything."""
        if self.partition is None:
            return True
        sid = self.sample_of(key) if key >= 0 else -1
        owner, me = self.partition
        return sid < 0 or int(owner[sid]) == me

    def describe(self) -> SamplerStats:
        return SamplerStats(
            samples=self.n,
            epoch=self.epoch,
            replay=round(self.r, 3),
            replay_mode="auto" if self.fixed_replay is None else "fixed",
            orders_served=self.orders_served,
            losses_ingested=self.losses_ingested,
            reports=self.reports,
            last_report=dict(self.last_report),
            table=self.table.describe() if self.n else None,
            unbridged=self.pending.unbridged,
            orders_elsewhere=self.orders_elsewhere,
            **self._partition_stats(),
        )

    def _partition_stats(self) -> dict[str, int]:
        if self.partition is None:
            return {}
        return {"nodes": self._nodes, "node": self.partition[1], "owned": self._owned}
