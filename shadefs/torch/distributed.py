"""The multi-node half of ``ShadeSampler``: which ranks share a node, and one global order.

This module owns the collectives a job that spans several shadefs mounts runs over
``torch.distributed`` (any backend; the objects are small):

- ``discover``: every rank names its mount (host name, the mount's device number, its
  path); ranks with the same (host, device) share one node, that is one daemon and one
  cache, and the first of them is the node's sender.  A node's id for ownership is a hash
  of (host, mount path), which a restarted daemon keeps.
- ``install_epoch``: at each epoch, every node's sender reads its daemon's residency bitmap
  (``np.packbits`` over sample ids, 160 kB at 1.28 M samples) and all ranks all-gather
  them.  Rank 0's daemon builds the global order from the union of the bitmaps and its
  importance table; rank 0 broadcasts it; every other node's daemon is handed the same
  order and bitmaps.  Each daemon then derives every rank's locality-aware share from those
  identical inputs (``shadefs.sampling.placement``), so the shares agree even when the
  daemons' tables do not (a daemon that restarted has an empty table and a fresh replay
  controller): one node decides the order, and every node only places it.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.distributed as dist

from shadefs.sampling import wire, wire_nodes
from shadefs.sampling.placement import node_id
from shadefs.torch.client import ControlClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Nodes:
    """The job's nodes as every rank sees them (identical on all ranks)."""

    rank_node: tuple[int, ...]  # node index of each rank
    node_ids: tuple[int, ...]  # stable id of each node
    senders: tuple[int, ...]  # the first rank of each node

    @property
    def count(self) -> int:
        return len(self.node_ids)

    def sender(self, rank: int) -> bool:
        return self.senders[self.rank_node[rank]] == rank


def discover(mountpoint: str, rank: int, world: int) -> Nodes:
    """Collective: group the ranks by the mount they read through."""
    host = socket.gethostname()
    # (host, device) names a mount: a FUSE mount has its own st_dev on its host.
    me = (host, os.stat(mountpoint).st_dev, node_id(host, mountpoint))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, me)
    index: dict[tuple[str, int], int] = {}
    rank_node: list[int] = []
    ids: list[int] = []
    senders: list[int] = []
    for r, (h, dev, nid) in enumerate(everyone):
        k = index.setdefault((h, dev), len(index))
        if k == len(ids):
            ids.append(int(nid))
            senders.append(r)
        rank_node.append(k)
    if len(set(ids)) != len(ids):
        raise RuntimeError("two shadefs mounts of this job have the same host and path")
    return Nodes(tuple(rank_node), tuple(ids), tuple(senders))


def install_epoch(
    client: ControlClient, nodes: Nodes, epoch: int, seed: int, n: int, rank: int
) -> np.ndarray | None:
    """Collective: make every node's daemon hold this epoch's shares of one global order.

    Returns the global order this rank's daemon installed (rank 0's built it, every other
    node's sender handed it the same), or None on the other ranks of a node."""
    sender = nodes.sender(rank)
    bitmap = None
    if sender:
        raw = client.order(wire_nodes.encode_resident_request(n))
        try:
            bitmap = wire_nodes.decode_resident(raw, n)
        except wire.WireError as exc:
            raise RuntimeError(f"bad residency bitmap from {client.mountpoint}: {exc}") from None
    gathered: list[Any] = [None] * len(nodes.rank_node)
    dist.all_gather_object(gathered, bitmap)
    bitmaps = [gathered[s] for s in nodes.senders]

    def install(order: np.ndarray | None) -> np.ndarray:
        me = nodes.rank_node[rank]
        message = wire_nodes.encode_node_order(
            epoch, seed, me, nodes.node_ids, nodes.rank_node, bitmaps, n, order
        )
        try:
            return wire.decode_order_response(client.order(message), n)[1]
        except wire.WireError as exc:
            raise RuntimeError(f"bad node order from {client.mountpoint}: {exc}") from None

    box: list[Any] = [None]
    installed = None
    if rank == 0:
        # int32 halves what the broadcast pickles and carries (10 MB at 1.28 M samples).
        installed = install(None)
        box[0] = installed.astype(np.int32) if n < 2**31 else installed
    dist.broadcast_object_list(box, src=0)
    if sender and rank != 0:
        installed = np.asarray(box[0], dtype=np.int64)
        install(installed)  # (a node handed the order gets none back: channel.py)
    dist.barrier()  # no rank asks for its share before its daemon holds the epoch
    return installed
