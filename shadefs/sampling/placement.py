"""Several nodes, one job: which node owns each sample, and which rank trains each entry.

This module owns the two pure functions a multi-node job needs on top of the PADS order
(``pads.py``), both deterministic in their inputs so that every node's daemon computes the
same answer:

- ``owners``: the node that caches each sample, by rendezvous (highest-random-weight)
  hashing of (sample id, node id).  Each node owns about 1/N of the samples, a random and
  so importance-neutral share; a node that joins takes about 1/(N+1) from the others and
  one that leaves hands only its own share on: ownership moves only the moved shares, and
  a node that restarts under the same id owns what it owned before.
- ``locality_shares``: each rank's share of one global epoch list.  The list is padded like
  DistributedSampler's; every entry whose sample is resident on some node goes to one of
  that node's ranks (its owner's if the owner holds it), up to the node's quota of entries,
  and the rest is dealt evenly over what each node has left.  The multiset of entries is
  the global list's, so coverage and replay counts are unchanged; only which rank trains
  an entry changes.  A node's list keeps the global order, so its hits stay spread through
  the epoch as PADS placed them, and its ranks take it in turns.

Everything is numpy over sample ids: at 1.28 M samples and 8 nodes both functions run in a
fraction of a second (``tools/bench/bench_nodes.py --order-only``).
"""

from __future__ import annotations

import functools
import hashlib
import logging

import numpy as np

log = logging.getLogger(__name__)

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def node_id(host: str, mountpoint: str) -> int:
    """A node's stable 64-bit identity: the same host and mount point give the same id
    after a restart, so the node owns the same samples again."""
    digest = hashlib.blake2b(f"{host}\0{mountpoint}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised (wraps modulo 2**64 as intended)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


@functools.lru_cache(maxsize=2)
def owners(node_ids: tuple[int, ...], n: int) -> np.ndarray:
    """The owning node (an index into ``node_ids``) of each of ``n`` samples: int32[n].

    Rendezvous hashing: sample s goes to the node whose hash of (s, node id) is highest.
    Cached: the same membership asks again every epoch.
    """
    if not node_ids:
        raise ValueError("owners needs at least one node")
    ids = np.arange(n, dtype=np.uint64)
    best = np.zeros(n, dtype=np.uint64)
    owner = np.zeros(n, dtype=np.int32)
    with np.errstate(over="ignore"):
        for k, nid in enumerate(node_ids):
            h = _mix(ids * _GOLDEN ^ _mix(np.full(1, nid, dtype=np.uint64)))
            better = h > best
            owner[better] = k
            best = np.where(better, h, best)
    owner.setflags(write=False)
    return owner


def locality_shares(
    order: np.ndarray,
    resident: np.ndarray,
    rank_node: np.ndarray,
    owner: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Each rank's share (int64, all of one length) of the global epoch list ``order``.

    ``resident``: bool[nodes, n], what each node holds; ``rank_node``: the node index of
    each rank; ``owner``: each sample's owning node (preferred among several holders).
    """
    order = np.asarray(order, dtype=np.int64)
    rank_node = np.asarray(rank_node, dtype=np.int64)
    world = len(rank_node)
    nodes = resident.shape[0]
    if world < 1 or rank_node.min() < 0 or rank_node.max() >= nodes:
        raise ValueError(f"bad rank -> node map for {nodes} nodes: {rank_node.tolist()}")
    length = len(order)
    if length == 0:
        return [np.empty(0, dtype=np.int64) for _ in range(world)]
    per_rank = -(-length // world)
    pad = per_rank * world - length
    padded = np.concatenate([order, order[np.arange(pad) % length]]) if pad else order
    # Node indices as small ints: the stable sorts below are then radix sorts (one pass).
    small = np.int16 if nodes < 2**15 else np.int32

    # The node each sample would rather go to: a holder of it (the owner if it is one, else
    # the first holder), or -1 when no node holds it; per sample, then per entry.
    held = resident.any(axis=0)
    first_holder = np.where(held, resident.argmax(axis=0), -1).astype(small)
    if owner is not None:
        own = np.asarray(owner).astype(small)
        owner_holds = resident[own, np.arange(resident.shape[1])]
        first_holder = np.where(owner_holds, own, first_holder)
    pref = first_holder[padded]

    ranks_of = [np.flatnonzero(rank_node == k) for k in range(nodes)]
    quota = np.array([len(r) * per_rank for r in ranks_of], dtype=np.int64)
    # Each node takes the earliest entries that prefer it, up to its quota: group the
    # entries by preference, keeping their order within a group.
    by_pref = np.argsort(pref, kind="stable")
    bounds = np.searchsorted(pref[by_pref], np.arange(-1, nodes + 1))
    node: np.ndarray = np.full(len(padded), -1, dtype=small)
    taken = np.zeros(nodes, dtype=np.int64)
    for k in range(nodes):
        lo, hi = bounds[k + 1], bounds[k + 2]
        wanted = by_pref[lo : min(hi, lo + quota[k])]
        node[wanted] = k
        taken[k] = len(wanted)
    rest = np.flatnonzero(node < 0)
    left = quota - taken
    # Deal the rest so that each node's part of it is spread evenly through the epoch: node
    # k's j-th slot sits at (j + 0.5) / left[k] of the remaining list.
    labels = np.repeat(np.arange(nodes, dtype=np.int64), left)
    first = np.cumsum(left) - left
    slot = np.arange(len(labels), dtype=np.int64) - np.repeat(first, left)
    spot = (slot + 0.5) / np.maximum(left, 1)[labels]
    node[rest] = labels[np.argsort(spot, kind="stable")]

    # Every node's entries in epoch order, from one stable sort by node.
    by_node = padded[np.argsort(node, kind="stable")]
    ends = np.cumsum(quota)
    shares: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * world
    for k in range(nodes):
        mine = by_node[ends[k] - quota[k] : ends[k]]
        for j, rank in enumerate(ranks_of[k]):
            shares[int(rank)] = mine[j :: len(ranks_of[k])]
    return shares


def overlap(shares: list[np.ndarray]) -> float:
    """The fraction of entries whose sample some other rank's share holds too."""
    total = sum(len(s) for s in shares)
    if total == 0:
        return 0.0
    seen = np.concatenate([np.unique(s) for s in shares])
    ids, counts = np.unique(seen, return_counts=True)
    shared = ids[counts > 1]
    return sum(int(np.isin(s, shared).sum()) for s in shares) / total
