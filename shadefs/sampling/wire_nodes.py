"""Binary formats of the multi-node part of the sampler channel (written to ``order``).

This module owns two more message kinds beside ``wire.py``'s, with the same header (magic,
u16 version, u16 flags), the same little-endian layout and the same hostile-input checks:

- ``SHDB`` residency request: ``u64 n`` (the sampler's sample count).  The daemon answers
  ``SHDM``: ``u64 n`` then ``ceil(n / 8)`` bytes, bit i (``np.packbits`` order) set when
  sample i is cached on this node.
- ``SHDI`` node order: one epoch's global order for a job that spans several nodes, with
  what every node holds.  ``u64 epoch, u64 seed, u32 world, u32 nodes, u32 me, u32 0,
  u64 n, u64 length``, then ``u64 node_id[nodes]``, ``u32 rank_node[world]``,
  ``nodes x ceil(n / 8)`` bytes of residency bitmaps and ``i64 order[length]``.  With
  ``length`` 0 the daemon builds the global order itself from the union of the bitmaps;
  either way it answers with the global order as an ``SHDR`` response, and from then on
  serves each rank's locality-aware share of it to plain ``SHDQ`` requests.

``message_length`` covers these and defers every other magic to ``wire.message_length``.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shadefs.sampling import wire
from shadefs.sampling.wire import MAX_SAMPLES, MAX_WORLD_SIZE, VERSION, WireError

log = logging.getLogger(__name__)

MAGIC_RESIDENT_REQUEST = b"SHDB"
MAGIC_RESIDENT = b"SHDM"
MAGIC_NODE_ORDER = b"SHDI"
MAX_NODES = 4096
#: The largest ``SHDI`` message the daemon buffers: 64 nodes' bitmaps of ImageNet-22k's
#: 14 M samples and its order take 0.2 GB; a forged header declaring more is refused.
MAX_NODE_ORDER_BYTES = 1 << 30

_BITS = struct.Struct("<4sHHQ")  # magic, version, flags, n (request and response)
_NODE = struct.Struct("<4sHHQQIIIIQQ")  # ..., epoch, seed, world, nodes, me, 0, n, length


def bitmap_bytes(n: int) -> int:
    return (n + 7) // 8


@dataclass(frozen=True)
class NodeOrder:
    """An ``SHDI`` message, decoded and checked."""

    epoch: int
    seed: int
    me: int
    node_ids: tuple[int, ...]
    rank_node: np.ndarray  # int64[world]
    resident: np.ndarray  # bool[nodes, n]
    order: np.ndarray  # int64[length], empty: build it

    @property
    def world_size(self) -> int:
        return len(self.rank_node)


def _check_node_counts(world: int, nodes: int, me: int, n: int, length: int) -> None:
    if not 1 <= world <= MAX_WORLD_SIZE:
        raise WireError(f"world size {world} not in [1, {MAX_WORLD_SIZE}]")
    if not 1 <= nodes <= min(world, MAX_NODES):
        raise WireError(f"{nodes} nodes for a world of {world}")
    if me >= nodes:
        raise WireError(f"node {me} not in [0, {nodes})")
    if n > MAX_SAMPLES or length > MAX_SAMPLES:
        raise WireError(f"{n} samples / order length {length} above the limit {MAX_SAMPLES}")


def _node_length(nodes: int, world: int, n: int, length: int) -> int:
    return _NODE.size + 8 * nodes + 4 * world + nodes * bitmap_bytes(n) + 8 * length


def message_length(
    prefix: bytes | bytearray | memoryview, samples: int | None = None
) -> int | None:
    """``wire.message_length`` extended to the messages of this module.

    With ``samples`` (the registered sample count), an ``SHDI`` header for another count is
    refused as soon as it is whole, before its bitmaps are buffered.
    """
    head = bytes(prefix[:4])
    if head == MAGIC_RESIDENT_REQUEST:
        return _BITS.size
    if head != MAGIC_NODE_ORDER:
        return wire.message_length(prefix)
    if len(prefix) < _NODE.size:
        return None
    _, version, flags, _, _, world, nodes, me, _, n, length = _NODE.unpack_from(prefix)
    if version != VERSION or flags:
        raise WireError(f"unsupported version {version} or flags 0x{flags:04x}")
    _check_node_counts(world, nodes, me, n, length)
    if samples is not None and n != samples:
        raise WireError(f"node order for {n} samples, but {samples} are registered")
    total = _node_length(nodes, world, n, length)
    if total > MAX_NODE_ORDER_BYTES:
        raise WireError(f"node order of {total} bytes above the limit {MAX_NODE_ORDER_BYTES}")
    return total


def _header(buf: bytes | bytearray | memoryview, magic: bytes, size: int) -> None:
    if len(buf) < size:
        raise WireError(f"{magic.decode()} message too short: {len(buf)} bytes")
    got, version, flags = struct.unpack_from("<4sHH", buf)
    if got != magic:
        raise WireError(f"bad magic {got!r}, expected {magic!r}")
    if version != VERSION or flags:
        raise WireError(f"unsupported version {version} or flags 0x{flags:04x}")


def encode_resident_request(n: int) -> bytes:
    return _BITS.pack(MAGIC_RESIDENT_REQUEST, VERSION, 0, n)


def decode_resident_request(buf: bytes) -> int:
    _header(buf, MAGIC_RESIDENT_REQUEST, _BITS.size)
    if len(buf) != _BITS.size:
        raise WireError(f"residency request is {len(buf)} bytes, expected {_BITS.size}")
    return int(_BITS.unpack_from(buf)[3])


def encode_resident(resident: np.ndarray) -> bytes:
    bits = np.packbits(np.asarray(resident, dtype=bool))
    return _BITS.pack(MAGIC_RESIDENT, VERSION, 0, len(resident)) + bits.tobytes()


def decode_resident(buf: bytes, n: int) -> bytes:
    """The packed bitmap of an ``SHDM`` response for ``n`` samples (checked, not unpacked)."""
    _header(buf, MAGIC_RESIDENT, _BITS.size)
    got = int(_BITS.unpack_from(buf)[3])
    if got != n or len(buf) != _BITS.size + bitmap_bytes(n):
        raise WireError(f"residency bitmap for {got} samples ({len(buf)} bytes), expected {n}")
    return bytes(buf[_BITS.size :])


def encode_node_order(
    epoch: int,
    seed: int,
    me: int,
    node_ids: Sequence[int],
    rank_node: Sequence[int],
    bitmaps: Sequence[bytes],
    n: int,
    order: np.ndarray | None = None,
) -> bytes:
    """An ``SHDI`` message; ``bitmaps`` are packed (``SHDM`` payloads), one per node."""
    idx = np.ascontiguousarray(order if order is not None else [], dtype="<i8").reshape(-1)
    world, nodes = len(rank_node), len(node_ids)
    _check_node_counts(world, nodes, me, n, len(idx))
    if len(bitmaps) != nodes or any(len(b) != bitmap_bytes(n) for b in bitmaps):
        raise WireError(f"need {nodes} bitmaps of {bitmap_bytes(n)} bytes")
    head = _NODE.pack(MAGIC_NODE_ORDER, VERSION, 0, epoch, seed, world, nodes, me, 0, n, len(idx))
    return b"".join(
        [
            head,
            np.asarray(node_ids, dtype="<u8").tobytes(),
            np.asarray(rank_node, dtype="<u4").tobytes(),
            *bitmaps,
            idx.tobytes(),
        ]
    )


def decode_node_order(buf: bytes, n_registered: int) -> NodeOrder:
    """Decode an ``SHDI`` message for a daemon that registered ``n_registered`` samples."""
    _header(buf, MAGIC_NODE_ORDER, _NODE.size)
    _, _, _, epoch, seed, world, nodes, me, _, n, length = _NODE.unpack_from(buf)
    _check_node_counts(world, nodes, me, n, length)
    if len(buf) != _node_length(nodes, world, n, length):
        raise WireError(f"node order message is {len(buf)} bytes, header disagrees")
    if n != n_registered:
        raise WireError(f"node order for {n} samples, but {n_registered} are registered")
    at = _NODE.size
    ids = np.frombuffer(buf, dtype="<u8", count=nodes, offset=at)
    at += 8 * nodes
    rank_node = np.frombuffer(buf, dtype="<u4", count=world, offset=at).astype(np.int64)
    at += 4 * world
    if len(rank_node) and int(rank_node.max()) >= nodes:
        raise WireError(f"a rank on node {int(rank_node.max())} of {nodes}")
    if len(np.unique(rank_node)) != nodes:
        raise WireError("a node without ranks")
    width = bitmap_bytes(n)
    packed = np.frombuffer(buf, dtype=np.uint8, count=nodes * width, offset=at)
    resident = np.unpackbits(packed.reshape(nodes, width), axis=1, count=n).astype(bool)
    at += nodes * width
    order = np.frombuffer(buf, dtype="<i8", count=length, offset=at).astype(np.int64)
    if length and (int(order.min()) < 0 or int(order.max()) >= n):
        raise WireError("sample index out of range in node order")
    return NodeOrder(
        epoch=epoch,
        seed=seed,
        me=me,
        node_ids=tuple(int(i) for i in ids),
        rank_node=rank_node,
        resident=resident,
        order=order,
    )
