"""The work of an order request that grows with the dataset, for worker threads.

Each function reads only its arguments (array snapshots: a copy of the scores, the
registered arrays, which a registration replaces rather than mutates, a list of the cached
keys) and returns new objects, so `Sampling` runs them in a worker thread while the event
loop serves reads (docs/design.md §6; docs/developer-notes.md, "One thread").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from shadefs.readers.pending import PendingReads
from shadefs.sampling import pads, placement
from shadefs.sampling.wire_nodes import NodeOrder

log = logging.getLogger(__name__)


def build(scores: np.ndarray, resident: np.ndarray, params: pads.OrderParams) -> np.ndarray:
    """A global order (in any thread: it reads only its arguments)."""
    t0 = time.perf_counter()
    full = pads.build_global_order(scores, resident, params)
    log.debug(
        "built the order of epoch %d (%d entries) in %.3f s",
        params.epoch,
        len(full),
        time.perf_counter() - t0,
    )
    return full


def share_of(full: np.ndarray, world_size: int, rank: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A rank's share of a global order and its reads per sample id over `n` ids (in any
    thread: it reads only its arguments)."""
    share = pads.rank_slice(full, world_size, rank)
    return share, PendingReads.count(share, n)


def place(
    scores: np.ndarray, replay: float, n: int, msg: NodeOrder
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], np.ndarray, np.ndarray]:
    """A multi-node epoch's (global order, owner of each sample, every rank's share, the
    shares of this node's ranks, their reads per sample id), from the message alone and
    `scores` (in any thread: it reads only its arguments)."""
    order = msg.order
    if not len(order):
        params = pads.OrderParams(
            epoch=msg.epoch, seed=msg.seed, world_size=msg.world_size, rank=0, replay=replay
        )
        union = np.any(msg.resident, axis=0)
        order = pads.build_global_order(scores, np.asarray(union), params)
    owner = placement.owners(msg.node_ids, n)
    shares = placement.locality_shares(order, msg.resident, msg.rank_node, owner)
    nodes = msg.rank_node.tolist()
    mine = [share for share, node in zip(shares, nodes, strict=True) if node == msg.me]
    here = np.concatenate(mine) if mine else np.asarray(order[:0], dtype=np.int64)
    return order, owner, shares, here, PendingReads.count(here, n)


def unowned(
    keys: list[int], sorted_keys: np.ndarray, sorted_ids: np.ndarray, owner: np.ndarray, me: int
) -> list[int]:
    """Those of `keys` (cached keys, in their order) that are samples another node owns
    (sampling/placement.py; `sorted_keys`/`sorted_ids` map keys to sample ids): in any thread."""
    held = np.asarray(keys, dtype=np.int64)
    if not len(sorted_keys):
        return []
    look = np.where(held >= 0, held, 0).astype(np.uint64)  # block keys (< 0): no sample
    pos = np.minimum(np.searchsorted(sorted_keys, look), len(sorted_keys) - 1)
    sample = (held >= 0) & (sorted_keys[pos] == look)
    other = np.zeros(len(held), dtype=bool)
    other[sample] = owner[sorted_ids[pos[sample]]] != me
    out: list[int] = held[other].tolist()
    return out


def resident_among(
    keys: np.ndarray, cached: Sequence[int] | np.ndarray, distinct: bool = False
) -> np.ndarray:
    """Which of `keys` (uint64) are among `cached` (every cached key as a list or an array,
    blocks' negative ones too, which name no sample): in any thread. `distinct`: no key
    occurs twice in `keys` (a plan's, of distinct files), so numpy skips deduplicating both
    sides, about twice as fast (a key both in
    RAM and on the SSD may still occur twice in `cached`: numpy's sort-based test is right
    for any `cached` as long as `keys` is distinct)."""
    held = np.asarray(cached, dtype=np.int64)
    return np.isin(keys, held[held >= 0].astype(np.uint64), assume_unique=distinct)


def build_over(
    scores: np.ndarray,
    keys: np.ndarray,
    cached: Sequence[int] | np.ndarray,
    params: pads.OrderParams,
) -> np.ndarray:
    """`build` with the residency of `keys` among the `cached` keys (a worker thread)."""
    return build(scores, resident_among(keys, cached), params)
