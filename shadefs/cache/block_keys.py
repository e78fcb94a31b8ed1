"""The key space and the SSD names of block entries (no imports from the project).

A large file is cached as fixed-size blocks. Each block is an entry of its own in the RAM
tier's `entries` and in the SSD tier's index, under a **negative** key: file keys are inode
numbers (>= 1), so a block key can never collide with one, and `key < 0` tells them apart
in O(1) wherever a tier must (the order builder's resident set counts files only).

On the SSD a block is an ordinary entry of the existing format whose relpath is the file's
relpath, a NUL and ``<offset>+<file size>``. A NUL cannot occur in a real path, so block
entries and whole-file entries never share a name. Because the header's data length must
equal the signed size, a block entry is signed with the block's length in place of the
file's size, and the file's size is carried (and compared byte for byte) in the relpath:
together they still pin (size, mtime_ns, ctime_ns, ino) of the file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

__all__ = [
    "BLOCK_SHIFT",
    "PIECE_BIT",
    "block_index",
    "block_key",
    "block_relpath",
    "by_file",
    "file_key",
    "is_piece",
    "parse_block_relpath",
    "piece_key",
]

# Up to 2**24 indices per file: 2**23 blocks and 2**23 pieces (PIECE_BIT).
BLOCK_SHIFT = 24
_MASK = (1 << BLOCK_SHIFT) - 1


# Block keys are signed 64-bit (the caches keep keys in int64 arrays), which leaves file
# keys below 2**39 room. Larger ones (the namespace's fresh and foreign numbers, from 2**61;
# 64-bit source inode numbers) stand in as the next free number from _BIG up, per process.
_BIG = 1 << 38
_stand_in: dict[int, int] = {}
_stands_for: list[int] = []


def block_key(key: int, index: int) -> int:
    """The cache key of block `index` of the file whose key is `key` (always < 0)."""
    if key >= _BIG:
        small = _stand_in.get(key)
        if small is None:
            small = _stand_in[key] = _BIG + len(_stands_for)
            _stands_for.append(key)
        key = small
    return -((key << BLOCK_SHIFT) | index) - 1


def file_key(bkey: int) -> int:
    """The file key of a block key (identity for a file key)."""
    if bkey >= 0:
        return bkey
    key = (-bkey - 1) >> BLOCK_SHIFT
    return _stands_for[key - _BIG] if key >= _BIG else key


def block_index(bkey: int) -> int:
    """The index of a block key (a piece's with PIECE_BIT set)."""
    return (-bkey - 1) & _MASK


# Pieces (cache/extents.py: the extents of random reads, cached in RAM) share the block key
# space: the top bit of the index marks a piece, so blocks have 2**23 indices (8 TiB at 1
# MiB: a larger file is read through, `Blocks.takes`) and pieces 2**23 (256 GiB at 32 KiB;
# pieces beyond are not cached).
PIECE_BIT = 1 << (BLOCK_SHIFT - 1)


def piece_key(key: int, index: int) -> int | None:
    """The cache key of piece `index` (extent grid over the whole file) of file `key`, or
    None past the pieces' key space."""
    return block_key(key, PIECE_BIT | index) if index < PIECE_BIT else None


def is_piece(bkey: int) -> bool:
    return bkey < 0 and bool(block_index(bkey) & PIECE_BIT)


def block_relpath(relpath: bytes, offset: int, file_size: int) -> bytes:
    """The SSD relpath of the block at `offset` of a file of `file_size` bytes."""
    return b"%s\0%d+%d" % (relpath, offset, file_size)


class BlockName(NamedTuple):
    relpath: bytes
    offset: int
    file_size: int


def parse_block_relpath(name: bytes) -> BlockName | None:
    """The parts of a block relpath, or None for a whole-file relpath (or garbage)."""
    rel, sep, tail = name.partition(b"\0")
    if not sep:
        return None
    off, plus, size = tail.partition(b"+")
    if not plus or not off.isdigit() or not size.isdigit():
        return None
    return BlockName(rel, int(off), int(size))


def by_file(per_file: Callable[[int], float]) -> Callable[[int], float]:
    """`per_file` for file keys, and for a block key its file's value: a block ranks by its
    file's importance (`shade`) and is next used when its file is (`belady`), since the
    sampler and the plans name files, never blocks."""

    def per_key(key: int) -> float:
        return per_file(key if key >= 0 else file_key(key))

    return per_key
