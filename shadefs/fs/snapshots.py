"""Compact per-file state for the namespace: directory snapshots and the inode table.

A million-file tree must not cost a Python object per file (docs/design.md §6), so:

- a `Snapshot` is one directory's listing: its names in one bytes buffer with an offset
  array, the lstat fields the mount serves in a numpy structured array (84 B a row), the
  FUSE inode number of every entry, and two per-entry columns for the entries the kernel
  references (lookup count, time of the last signature check). Lookup by name bisects the
  names' hashes (two arrays, 16 B a name, built at the first lookup), or for a short
  listing the sorted names themselves (the source lists them sorted).
- the `InodeTable` maps a FUSE inode number to (snapshot slot, row) in two flat arrays,
  open addressing with linear probing: 16 B a slot, at most 2/3 full.
- `Stat` is the small typed record built on demand from a row where a caller needs one
  entry's attributes (attrs(), the cache's open); nothing keeps one per file.

The inode table never holds an entry without a row: the node *is* the row it points at.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import os
import struct
from array import array
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# The row layout, in the order of Stat's fields (a row's tolist() is a Stat's tuple).
STAT_DTYPE = np.dtype(
    [
        ("st_mode", "<u4"),
        ("st_nlink", "<u4"),
        ("st_uid", "<u4"),
        ("st_gid", "<u4"),
        ("st_size", "<i8"),
        ("st_atime_ns", "<i8"),
        ("st_mtime_ns", "<i8"),
        ("st_ctime_ns", "<i8"),
        ("st_ino", "<u8"),
        ("st_blocks", "<i8"),
        ("st_rdev", "<u8"),
        ("st_blksize", "<u4"),
    ]
)


# One C-level read of a stat_result: the row's fields, then st_dev.
_FIELDS = operator.attrgetter(*(STAT_DTYPE.names or ()), "st_dev")
_SCAN_DTYPE = np.dtype([(f, "<i8") for f in (*(STAT_DTYPE.names or ()), "st_dev")])


class Stat(NamedTuple):
    """One entry's attributes, as os.stat_result names them (duck-types it for readers)."""

    st_mode: int
    st_nlink: int
    st_uid: int
    st_gid: int
    st_size: int
    st_atime_ns: int
    st_mtime_ns: int
    st_ctime_ns: int
    st_ino: int
    st_blocks: int
    st_rdev: int
    st_blksize: int

    @classmethod
    def of(cls, st: os.stat_result | Stat) -> Stat:
        return cls(*(getattr(st, f) for f in cls._fields))


def scan_rows(
    entries: list[tuple[bytes, os.stat_result]],
) -> tuple[list[bytes], np.ndarray, np.ndarray]:
    """(names, rows, st_dev per row) of a sorted listing; runs in the source's thread."""
    names = [e[0] for e in entries]
    try:
        # One C-level pass into int64 records, then one cast to the row layout: a first
        # walk pays this for every file, in the worker thread that holds the GIL.
        scan = np.fromiter(
            map(_FIELDS, (e[1] for e in entries)), dtype=_SCAN_DTYPE, count=len(entries)
        )
    except OverflowError:  # a field above 2^63 (an odd st_ino or st_rdev): field by field
        devs = np.array([e[1].st_dev for e in entries], dtype=np.uint64)
        return names, np.array([_row(e[1]) for e in entries], dtype=STAT_DTYPE), devs
    rows = scan[list(STAT_DTYPE.names or ())].astype(STAT_DTYPE)
    return names, rows, scan["st_dev"].astype(np.uint64)


def _row(st: os.stat_result) -> tuple[int, ...]:
    return (
        st.st_mode,
        st.st_nlink,
        st.st_uid,
        st.st_gid,
        st.st_size,
        st.st_atime_ns,
        st.st_mtime_ns,
        st.st_ctime_ns,
        st.st_ino,
        st.st_blocks,
        st.st_rdev,
        st.st_blksize,
    )


_new_tuple = tuple.__new__
# Listings longer than this find names by their hashes (Snapshot.find).
_HASHED_FROM = 16
# A row's bytes as Stat's tuple: half the cost of rows.item(i) (every open and lookup
# builds one). STAT_DTYPE is packed, little-endian, in this order.
_ROW_SIZE = STAT_DTYPE.itemsize
_unpack_row = struct.Struct("<4I4qQqQI").unpack_from
assert struct.calcsize("<4I4qQqQI") == _ROW_SIZE


class Snapshot:
    """One directory's listing (or the root's own entry), with its referenced rows' state.

    :dirino: the FUSE inode of the listed directory (0 for the root's own entry)
    :path: the directory's path relative to the source root
    :rows: STAT_DTYPE[n]; :ino: the FUSE inode number of each row (uint64[n])
    :lookups: the kernel's references to each row's inode (uint32[n])
    :checked: the namespace's clock at each row's last signature check (float64[n])
    :xattrs: whether each row has extended attributes, once asked (fs/xattrs.py)
    :refs: how many inode-table entries point into this snapshot
    :slot: its index in the namespace's snapshot list
    :shown: whether the kernel was answered from this listing (namespace.listing)
    """

    __slots__ = (
        "dirino",
        "path",
        "names",
        "offs",
        "rows",
        "ino",
        "lookups",
        "checked",
        "xattrs",
        "stamp",
        "refs",
        "slot",
        "shown",
        "_hashes",
        "_hashed_rows",
    )

    def __init__(
        self,
        dirino: int,
        path: bytes,
        names: list[bytes],
        rows: np.ndarray,
        ino: np.ndarray,
        stamp: float,
    ) -> None:
        self.dirino = dirino
        self.path = path
        self.names = b"".join(names)
        self.offs = array("Q", itertools.accumulate(map(len, names), initial=0))
        self.rows = np.ascontiguousarray(rows, dtype=STAT_DTYPE)  # stat() reads its bytes
        self.ino = ino
        n = len(names)
        self.lookups = np.zeros(n, dtype=np.uint32)
        self.checked = np.full(n, stamp, dtype=np.float64)
        self.xattrs: np.ndarray | None = None  # fs/xattrs.py's "has none" flags, int8[n]
        self.stamp = stamp
        self.refs = 0
        self.slot = 0
        self.shown = False
        self._hashes: array[int] | None = None  # find(): the names' hashes, sorted
        self._hashed_rows: array[int] | None = None  # the row of each

    def __len__(self) -> int:
        return len(self.offs) - 1

    def name(self, i: int) -> bytes:
        offs = self.offs
        return self.names[offs[i] : offs[i + 1]]

    def child_path(self, i: int) -> bytes:
        offs = self.offs
        name = self.names[offs[i] : offs[i + 1]]
        return self.path + b"/" + name if self.path else name

    def name_list(self) -> list[bytes]:
        """Every name, as a transient list."""
        names, offs = self.names, self.offs
        return [names[offs[i] : offs[i + 1]] for i in range(len(offs) - 1)]

    def find(self, name: bytes) -> int:
        """The row of `name`, or -1: a bisection of the names' hashes (in C, from the
        first lookup on, for every listing of more than a few names), else of the names
        (sorted), whose each step slices one out."""
        n = len(self.offs) - 1
        if n > _HASHED_FROM:
            if self._hashes is None:
                self._index_hashes()
            hashes, at = self._hashes, self._hashed_rows
            assert hashes is not None and at is not None
            h = hash(name)
            i = bisect.bisect_left(hashes, h)
            names, offs = self.names, self.offs
            while i < n and hashes[i] == h:
                row = at[i]
                if names[offs[row] : offs[row + 1]] == name:
                    return row
                i += 1
            return -1
        names, offs = self.names, self.offs
        lo, hi = 0, len(offs) - 1
        while lo < hi:
            mid = (lo + hi) >> 1
            if names[offs[mid] : offs[mid + 1]] < name:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(offs) - 1 and names[offs[lo] : offs[lo + 1]] == name:
            return lo
        return -1

    def _index_hashes(self) -> None:
        """hash() of every name, sorted, and their rows (16 B a name, built once)."""
        hashes = np.fromiter(map(hash, self.name_list()), dtype=np.int64, count=len(self))
        order = np.argsort(hashes, kind="stable")
        self._hashes = array("q", hashes[order].tobytes())
        self._hashed_rows = array("q", order.astype(np.int64).tobytes())

    def stat(self, i: int) -> Stat:
        # Unpacked from the row's bytes with tuple.__new__: the cheapest way from a row to
        # a record (on every open).
        return _new_tuple(Stat, _unpack_row(self.rows, i * _ROW_SIZE))  # type: ignore[arg-type]

    def set_stat(self, i: int, st: os.stat_result | Stat) -> None:
        self.rows[i] = _row(st)  # type: ignore[arg-type]


_GOLDEN = 0x9E3779B97F4A7C15


class InodeTable:
    """FUSE inode number -> (snapshot slot << 32 | row), in two flat arrays.

    Open addressing with linear probing and backward-shift deletion (no tombstones), so a
    table that forgets as fast as it learns does not fill up. Key 0 marks a free slot
    (inode 0 is never handed to the kernel).
    """

    __slots__ = ("_keys", "_vals", "_bits", "_mask", "_n")

    def __init__(self, bits: int = 10) -> None:
        self._alloc(bits)
        self._n = 0

    def _alloc(self, bits: int) -> None:
        self._bits = bits
        self._mask = (1 << bits) - 1
        self._keys = array("Q", bytes(8 << bits))
        self._vals = array("Q", bytes(8 << bits))

    def __len__(self) -> int:
        return self._n

    def __contains__(self, ino: object) -> bool:
        return isinstance(ino, int) and self.get(ino) >= 0

    def _home(self, ino: int) -> int:
        # Fibonacci hashing (the top bits of ino * 2^64/phi, mod 2^64): inode numbers come
        # in dense runs that start at multiples of a block group's size, which the low
        # bits alone would pile onto a few slots.
        return ((ino * _GOLDEN) >> (64 - self._bits)) & self._mask

    def get(self, ino: int) -> int:
        """The value of `ino`, or -1."""
        keys, mask = self._keys, self._mask
        i = ((ino * _GOLDEN) >> (64 - self._bits)) & mask
        while True:
            k = keys[i]
            if k == ino:
                return self._vals[i]
            if k == 0:
                return -1
            i = (i + 1) & mask

    def set(self, ino: int, val: int) -> None:
        if self.setdefault(ino, val) >= 0:
            keys, mask = self._keys, self._mask
            i = self._home(ino)
            while keys[i] != ino:
                i = (i + 1) & mask
            self._vals[i] = val

    def setdefault(self, ino: int, val: int) -> int:
        """Add `ino` -> `val` unless `ino` is there: -1 when added, else its value."""
        keys, mask = self._keys, self._mask
        i = ((ino * _GOLDEN) >> (64 - self._bits)) & mask
        while True:
            k = keys[i]
            if k == ino:
                return self._vals[i]
            if k == 0:
                break
            i = (i + 1) & mask
        keys[i] = ino
        self._vals[i] = val
        self._n += 1
        if self._n * 3 > (mask + 1) * 2:
            self._resize(self._bits + 1)
        return -1

    def add_rows(self, inos: np.ndarray, rows: Sequence[int], key: int) -> list[int]:
        """`setdefault(inos[k], key | rows[k])` for each k; the k whose ino was there already
        (or repeats in `inos`). The homes are hashed in numpy and the probing is one plain
        loop: a readdirplus batch adds a few dozen entries, too few for numpy rounds to
        beat it, and a method call per entry would add a tenth to a first walk."""
        while (self._n + len(inos)) * 3 > (self._mask + 1) * 2:
            self._resize(self._bits + 1)
        keys, vals, mask = self._keys, self._vals, self._mask
        inos = np.asarray(inos, dtype=np.uint64)
        homes = ((inos * np.uint64(_GOLDEN)) >> np.uint64(64 - self._bits)).tolist()
        known = []
        n = self._n
        for k, ino in enumerate(inos.tolist()):
            i = homes[k]
            while True:
                cur = keys[i]
                if cur == ino:
                    known.append(k)
                    break
                if cur == 0:
                    keys[i] = ino
                    vals[i] = key | rows[k]
                    n += 1
                    break
                i = (i + 1) & mask
        self._n = n
        return known

    def held(self, inos: list[int]) -> list[int]:
        """The k whose `inos[k]` is in the table (one plain loop, as in add_rows)."""
        keys, mask, shift = self._keys, self._mask, 64 - self._bits
        out = []
        for k, ino in enumerate(inos):
            i = ((ino * _GOLDEN) >> shift) & mask
            while True:
                cur = keys[i]
                if cur == ino:
                    out.append(k)
                    break
                if cur == 0:
                    break
                i = (i + 1) & mask
        return out

    def pop(self, ino: int) -> int:
        """Remove `ino`; its value, or -1 when it was not there."""
        keys, vals, mask = self._keys, self._vals, self._mask
        i = self._home(ino)
        while True:
            k = keys[i]
            if k == ino:
                break
            if k == 0:
                return -1
            i = (i + 1) & mask
        val = vals[i]
        self._n -= 1
        # Backward shift: pull later entries of the probe run into the hole when their
        # home slot is not cyclically between the hole and where they sit.
        j = i
        while True:
            keys[i] = 0
            while True:
                j = (j + 1) & mask
                k = keys[j]
                if k == 0:
                    return val
                h = self._home(k)
                if (j - h) & mask >= (j - i) & mask:
                    break
            keys[i], vals[i] = k, vals[j]
            i = j

    def _resize(self, bits: int) -> None:
        keys = np.frombuffer(self._keys, dtype=np.uint64)
        vals = np.frombuffer(self._vals, dtype=np.uint64)
        live = keys != 0
        keys, vals = keys[live].copy(), vals[live].copy()
        self._alloc(bits)
        nk = np.frombuffer(self._keys, dtype=np.uint64)
        nv = np.frombuffer(self._vals, dtype=np.uint64)
        mask = np.uint64(self._mask)
        pos = (keys * np.uint64(_GOLDEN)) >> np.uint64(64 - bits)  # wraps mod 2^64
        # Linear probing, vectorised: in each round every key still waiting claims its
        # slot if free; of several claimants the first wins, the others move on by one.
        while len(keys):
            free = nk[pos] == 0
            cand = np.flatnonzero(free)
            _, first = np.unique(pos[cand], return_index=True)
            won = cand[first]
            nk[pos[won]] = keys[won]
            nv[pos[won]] = vals[won]
            rest = np.ones(len(keys), dtype=bool)
            rest[won] = False
            keys, vals = keys[rest], vals[rest]
            pos = (pos[rest] + np.uint64(1)) & mask
        self._n = int(np.count_nonzero(nk))
