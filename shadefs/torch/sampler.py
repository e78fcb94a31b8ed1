"""PyTorch side of the sampler channel: ``ShadeSampler``.

This module owns the training job's half of the ``MOUNT/.shadefs`` sampler protocol
(``docs/control-protocol.md``): it registers the dataset's file list, fetches each epoch's
order (PADS, computed by the daemon because only the daemon knows what is cached), attributes
the per-sample losses of every trained batch to the indices it handed out, and sends them in
buffered binary messages.  The filesystem never imports torch; this module does, and
so do the demo helpers built on it (``shadefs.demo.digits``, ``shadefs.demo.run``).

Typical use (three lines added to an ordinary loop)::

    sampler = ShadeSampler(train_set)                       # finds the mount by itself
    loader = DataLoader(train_set, batch_size=64, sampler=sampler, num_workers=4)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y, reduction="none")
            loss.mean().backward(); opt.step(); opt.zero_grad()
            sampler.record(loss)                            # per-sample, loader order
        sampler.report(train_loss=..., val_accuracy=...)

Attribution: ``record(losses)`` without ``indices`` assigns the losses to the indices this
sampler handed out, in order, with a cursor.  That is exact whenever the loader keeps the
sampler's order, which a DataLoader does (shuffle=False with a sampler, any num_workers, a
batch_size or a BatchSampler, drop_last or not: a dropped tail is simply never recorded).
It is not exact with ``in_order=False``, an IterableDataset, or when some batches are
skipped; then pass the indices the loader returned (``record(losses, indices=idx)``).
The released SHADE code got exactly this wrong (docs/design.md §5).

Distributed jobs: every rank gets its share of one global order; losses are all-gathered
per flush so every node's daemon ingests the whole job's losses.  Ranks that share one
mount (several GPUs of one node) elect one sender, so a daemon never ingests a batch twice.
When the ranks read through several mounts (several nodes), rank 0's daemon builds each
epoch's order from what every node holds, all daemons place it the same way, each node
caches the samples it owns, and each rank's share holds its node's cached samples first
(``shadefs.torch.distributed``).  The constructor, ``set_epoch``, ``iter()``, ``report``,
``flush`` and ``close`` are collective calls then, and every rank must record the same number
of batches between them, which is what equal shares (the daemon pads them like
DistributedSampler) and an equal batch size give.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from shadefs.sampling import wire
from shadefs.torch.client import CONTROL_DIR, ControlClient, find_mount
from shadefs.torch.distributed import discover, install_epoch

log = logging.getLogger(__name__)


def _sample_paths(dataset: Any) -> list[str]:
    samples = getattr(dataset, "samples", None)
    if samples is not None:
        return [os.fspath(s[0]) for s in samples]
    if isinstance(dataset, (str, bytes)) or not isinstance(dataset, Sequence):
        raise TypeError(
            "ShadeSampler needs a dataset with .samples (ImageFolder, DatasetFolder) or a "
            f"sequence of file paths, got {type(dataset).__name__}"
        )
    return [os.fspath(p) for p in dataset]


def _relative_paths(paths: list[str], root: str) -> list[str]:
    """Paths relative to the mount root; ValueError for one outside it.

    String prefixes rather than os.path.relpath per path: ImageNet has 1.28 M samples.
    """
    prefix = os.path.join(os.path.abspath(root), "")
    absolute = [os.path.abspath(p) for p in paths]
    outside = next((p for p in absolute if not p.startswith(prefix)), None)
    if outside is not None:
        raise ValueError(f"sample {outside!r} is outside the shadefs mount {prefix[:-1]}")
    cut = len(prefix)
    return [p[cut:] for p in absolute]


def _to_numpy(values: Any, dtype: type) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        # Any device, any dtype, possibly part of the autograd graph.
        values = values.detach().to(dtype=torch.float32 if dtype is np.float32 else torch.int64)
        values = values.cpu().numpy()
    return np.asarray(values, dtype=dtype).reshape(-1)


class ShadeSampler(Sampler[int]):
    """A sampler whose epoch order comes from the shadefs daemon (importance + replay).

    Args:
        dataset: an ImageFolder/DatasetFolder (its ``samples`` give the files) or a sequence
            of file paths; the dataset's index order defines the sample ids.
        mountpoint: the shadefs mount root; default: found above the first sample.
        num_replicas, rank: like DistributedSampler; default from torch.distributed when it
            is initialised, else 1 and 0.
        seed: shared by all ranks; with the epoch it decides the order.
        replay: None lets the daemon adapt the replay factor r; a number >= 1 fixes it.
        flush_every: batches buffered per losses message (and per all-gather when
            distributed).
        group: the sweep group this job belongs to: every job of a group (concurrent
            trainings over one dataset on one mount) gets the same order each epoch, so
            that each file is fetched from the source once for all of them.
        job: this job's name in the mount's stats (default: ``GROUP/pid:PID`` in a group,
            else the daemon's ``pid:PID``).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        mountpoint: str | os.PathLike[str] | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        replay: float | None = None,
        flush_every: int = 64,
        group: str | None = None,
        job: str | None = None,
    ) -> None:
        paths = _sample_paths(dataset)
        if not paths:
            raise ValueError("ShadeSampler needs a non-empty dataset")
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        if replay is not None and not (math.isfinite(replay) and replay >= 1):
            raise ValueError(f"replay must be None or a number >= 1, got {replay}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self._distributed = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if self._distributed else 1
        if rank is None:
            rank = dist.get_rank() if self._distributed else 0
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"invalid rank {rank} for num_replicas {num_replicas}")
        # Collectives only make sense over the default group these ranks belong to.
        self._distributed = self._distributed and num_replicas == dist.get_world_size()
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = int(seed)
        self.flush_every = int(flush_every)
        self.num_samples = len(paths)

        if mountpoint is None:
            mountpoint = find_mount(paths[0])
            if mountpoint is None:
                raise ValueError(
                    f"no shadefs mount above {paths[0]!r} (no {CONTROL_DIR}/ctl found); "
                    "pass mountpoint="
                )
        self.mountpoint = os.path.abspath(os.fspath(mountpoint))
        relative = _relative_paths(paths, self.mountpoint)
        self._client = ControlClient(self.mountpoint)

        self.epoch = 0
        self._epoch_set = False  # set_epoch since the last __iter__?
        self._iterated = False
        self._order: np.ndarray = np.empty(0, dtype=np.int64)
        self._cursor = 0
        self._pending_idx: list[np.ndarray] = []
        self._pending_loss: list[np.ndarray] = []
        self._pending_lengths: list[int] = []
        self._batches = 0  # record() calls since the last flush
        self._closed = False
        self.messages_sent = 0  # losses messages written to this rank's mount

        # One sender per mount: ranks on one node that share a mount would otherwise make
        # its daemon ingest every batch (and every report) once per rank.
        self._nodes = discover(self.mountpoint, rank, num_replicas) if self._distributed else None
        self._sender = self._nodes is None or self._nodes.sender(rank)
        if self._sender:
            self._client.register(wire.encode_dataset(relative))
            self._client.ctl("replay auto" if replay is None else f"replay {replay:g}")
        if group is not None or job is not None:
            # From this process: the daemon names the job of the writing process.
            name = job if job is not None else f"{group}/pid:{os.getpid()}"
            self._client.ctl(f"job {name}" + (f" group={group}" if group else ""))
        self.group = group
        if self._distributed:
            dist.barrier()  # nobody asks for an order before the table exists
        log.debug(
            "ShadeSampler: %d samples on %s, rank %d of %d, sender %s",
            self.num_samples,
            self.mountpoint,
            self.rank,
            self.num_replicas,
            self._sender,
        )

    # -- the Sampler interface ---------------------------------------------------------------

    def __len__(self) -> int:
        if self._iterated and len(self._order):
            return len(self._order)
        # PADS's global list is N long and rank_slice pads it to a multiple of the world.
        return -(-self.num_samples // self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        # Not a generator: the order is fetched, and the attribution cursor reset, when the
        # loader calls iter(), not lazily at the first next().
        if self._iterated and not self._epoch_set:
            # set_epoch was not called: advance anyway, or every epoch would reuse the
            # same coverage stratum and the daemon would never see the job move on.
            self.epoch += 1
            log.debug("set_epoch not called; advancing to epoch %d", self.epoch)
        # Losses recorded so far should shape this order.
        self.flush()
        if self._nodes is not None and self._nodes.count > 1:
            # Several nodes: one global order, shares placed by what each node holds.
            install_epoch(
                self._client, self._nodes, self.epoch, self.seed, self.num_samples, self.rank
            )
        self._order = self._fetch_order(self.epoch, self.rank, self.num_replicas)
        self._cursor = 0
        self._iterated = True
        self._epoch_set = False
        expected = -(-self.num_samples // self.num_replicas)
        if len(self._order) != expected:
            log.warning("daemon order has %d entries, expected %d", len(self._order), expected)
        return iter(self._order.tolist())

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: flushes the losses of the last one, tells the daemon."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.flush()
        self.epoch = int(epoch)
        self._epoch_set = True
        if self._sender:
            self._client.ctl(f"epoch {self.epoch}")

    # -- losses --------------------------------------------------------------------------------

    def record(self, losses: Any, indices: Any = None) -> None:
        """Attribute the per-sample losses of the batch just trained (loader order).

        ``losses``: reduction='none' losses, a tensor on any device, an array or a list.
        ``indices``: the dataset indices of those samples; default: the next ones of the
        order this sampler handed out.
        """
        if np.ndim(losses) == 0:
            raise ValueError("record() needs per-sample losses (reduction='none'), got a scalar")
        loss = _to_numpy(losses, np.float32)
        # Flushes are triggered by the number of record() calls, not by what they held, so
        # ranks that record equally many batches flush (all-gather) at the same points.
        self._batches += 1
        try:
            self._add(loss, indices)
        finally:
            if self._batches >= self.flush_every:
                self.flush()

    def _add(self, loss: np.ndarray, indices: Any) -> None:
        if len(loss) == 0:
            return
        if indices is None:
            end = self._cursor + len(loss)
            if end > len(self._order):
                raise RuntimeError(
                    f"record() got {len(loss)} losses but only {len(self._order) - self._cursor}"
                    " indices of this epoch's order are left: call it once per trained batch "
                    "with per-sample losses (reduction='none'), or pass indices="
                )
            idx = self._order[self._cursor : end]
            self._cursor = end
        else:
            idx = _to_numpy(indices, np.int64)
            if len(idx) != len(loss):
                raise ValueError(f"{len(idx)} indices but {len(loss)} losses")
            if len(idx) and (idx.min() < 0 or idx.max() >= self.num_samples):
                raise ValueError(f"indices must be in [0, {self.num_samples})")
        if not np.isfinite(loss).all():
            # One diverged batch must not poison the daemon's write (it would reject it).
            log.warning("dropping a batch with non-finite losses")
            return
        self._pending_idx.append(idx)
        self._pending_loss.append(loss)
        self._pending_lengths.append(len(loss))

    def flush(self) -> None:
        """Send the buffered losses (collective when distributed: call it on every rank)."""
        batch = (
            np.concatenate(self._pending_idx) if self._pending_idx else np.empty(0, np.int64),
            np.concatenate(self._pending_loss) if self._pending_loss else np.empty(0, np.float32),
            np.asarray(self._pending_lengths, dtype=np.int64),
        )
        self._pending_idx, self._pending_loss, self._pending_lengths = [], [], []
        self._batches = 0
        if self._distributed:
            gathered: list[Any] = [None] * self.num_replicas
            dist.all_gather_object(gathered, batch)
            parts = [g for g in gathered if g is not None and len(g[2])]
        else:
            parts = [batch] if len(batch[2]) else []
        if not parts or not self._sender:
            return
        idx = np.concatenate([p[0] for p in parts])
        loss = np.concatenate([p[1] for p in parts])
        lengths = np.concatenate([p[2] for p in parts])
        for message in _loss_messages(idx, loss, lengths):
            self._client.send_losses(message)
            self.messages_sent += 1

    def report(self, train_loss: float | None = None, val_accuracy: float | None = None) -> None:
        """End of an epoch: flush, then tell the daemon the training progress.

        ``val_accuracy`` is a fraction in [0, 1].  When distributed, the values of all
        ranks are averaged (ranks that pass None are left out), so every node's daemon
        adapts the replay factor the same way.
        """
        self.flush()
        values: tuple[float | None, float | None] = (train_loss, val_accuracy)
        if self._distributed:
            gathered: list[Any] = [None] * self.num_replicas
            dist.all_gather_object(gathered, values)
            values = (_mean([g[0] for g in gathered]), _mean([g[1] for g in gathered]))
        if not self._sender:
            return
        words = [f"report epoch={self.epoch}"]
        for name, value in zip(("train_loss", "val_accuracy"), values, strict=True):
            if value is not None:
                if not math.isfinite(value):
                    log.warning("not reporting non-finite %s", name)
                    continue
                words.append(f"{name}={float(value):.6g}")
        self._client.ctl(" ".join(words))

    def close(self) -> None:
        """Flush what is buffered.  Collective when distributed."""
        if not self._closed:
            self.flush()
            self._closed = True

    def __del__(self) -> None:
        try:
            if self._closed or not self._pending_lengths:
                return
            if self._distributed:
                # A collective from a finaliser could hang; losing a few batches is better.
                log.warning(
                    "ShadeSampler dropped %d unsent batches; call close() on every rank",
                    len(self._pending_lengths),
                )
                return
            self.close()
        except Exception:  # interpreter shutdown, mount gone: never raise from __del__
            pass

    # -- helpers -------------------------------------------------------------------------------

    def order(self, epoch: int | None = None, rank: int | None = None) -> np.ndarray:
        """The daemon's order for (epoch, rank) of this job, without handing it out."""
        return self._fetch_order(
            self.epoch if epoch is None else epoch,
            self.rank if rank is None else rank,
            self.num_replicas,
        )

    def _fetch_order(self, epoch: int, rank: int, world: int) -> np.ndarray:
        request = wire.encode_order_request(epoch, rank, world, self.seed)
        raw = self._client.order(request)
        try:
            got_epoch, indices = wire.decode_order_response(raw, self.num_samples)
        except wire.WireError as exc:
            raise RuntimeError(f"bad order response from {self.mountpoint}: {exc}") from None
        if got_epoch != epoch:
            raise RuntimeError(f"asked {self.mountpoint} for epoch {epoch}, got {got_epoch}")
        return indices


def _mean(values: list[float | None]) -> float | None:
    present = [float(v) for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _loss_messages(idx: np.ndarray, loss: np.ndarray, lengths: np.ndarray) -> list[bytes]:
    """Encode batches into as few SHDL messages as the wire's per-message limit allows."""
    messages = []
    start = 0  # first batch of the current message
    offset = 0  # its first sample
    ends = np.cumsum(lengths)
    while start < len(lengths):
        # The last batch that still fits (at least one, or the wire encoder says why not).
        limit = offset + wire.MAX_LOSSES
        stop = max(start + 1, int(np.searchsorted(ends, limit, side="right")))
        end = int(ends[stop - 1])
        messages.append(wire.encode_losses(idx[offset:end], loss[offset:end], lengths[start:stop]))
        start, offset = stop, end
    return messages
