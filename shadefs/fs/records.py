"""Records built on demand: FUSE attributes from snapshot rows, a node as callers see it,
`resolve`'s answer arrays, and statfs replies."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import pyfuse3

from shadefs.fs.snapshots import Stat

# The kernel keeps a 32-bit generation per inode (i_generation).
_GEN_MASK = 0xFFFFFFFF
_S_IFMT = 0o170000
_S_IFDIR = 0o040000


def generation(mode: int, ctime_ns: int) -> int:
    """The FUSE generation of an entry: the low bits of its ctime, 0 for a directory.

    A file's identity is (device, inode, the version the daemon saw). When a lookup answers
    an inode number the kernel knows with another generation, the kernel retires its old
    inode (I/O on it fails, its dentries are looked up again) and starts a new one with an
    empty page cache: a reused inode number, or a file replaced since the kernel looked it
    up, can never be served under the old entry's name or pages. ctime moves with every
    change (a writer cannot set it back). A directory keeps generation 0: its ctime moves
    whenever an entry is added, and retiring it would break every open handle below it.
    """
    return 0 if mode & _S_IFMT == _S_IFDIR else ctime_ns & _GEN_MASK


def attrs_of_row(ino: int, row: tuple[int, ...], timeout: float) -> pyfuse3.EntryAttributes:
    """attrs() of a snapshot row's tolist() (readdir's loop: no Stat built)."""
    a = pyfuse3.EntryAttributes()
    a.st_ino = ino
    a.generation = 0 if row[0] & _S_IFMT == _S_IFDIR else row[7] & _GEN_MASK
    a.entry_timeout = timeout
    a.attr_timeout = timeout
    (
        a.st_mode,
        a.st_nlink,
        a.st_uid,
        a.st_gid,
        a.st_size,
        a.st_atime_ns,
        a.st_mtime_ns,
        a.st_ctime_ns,
        _,
        a.st_blocks,
        a.st_rdev,
        a.st_blksize,
    ) = row
    return a


def attrs(ino: int, st: Stat | os.stat_result, timeout: float) -> pyfuse3.EntryAttributes:
    if type(st) is Stat:  # a row's tuple (lookups, getattr): one unpacking
        return attrs_of_row(ino, st, timeout)
    a = pyfuse3.EntryAttributes()
    a.st_ino = ino
    a.generation = generation(st.st_mode, st.st_ctime_ns)
    a.entry_timeout = timeout
    a.attr_timeout = timeout
    a.st_mode = st.st_mode
    a.st_nlink = st.st_nlink
    a.st_uid = st.st_uid
    a.st_gid = st.st_gid
    a.st_rdev = st.st_rdev
    a.st_size = st.st_size
    a.st_blksize = st.st_blksize
    a.st_blocks = st.st_blocks
    a.st_atime_ns = st.st_atime_ns
    a.st_mtime_ns = st.st_mtime_ns
    a.st_ctime_ns = st.st_ctime_ns
    return a


class Node(NamedTuple):
    """A looked-up entry as callers see it, built on demand from its snapshot row."""

    path: bytes
    st: Stat
    lookups: int
    checked: float


class Resolved(NamedTuple):
    """What `resolve` found for each path: FUSE inode, size and mode (0: missing)."""

    ino: np.ndarray
    size: np.ndarray
    mode: np.ndarray

    @classmethod
    def empty(cls, n: int) -> Resolved:
        return cls(np.zeros(n, np.uint64), np.zeros(n, np.int64), np.zeros(n, np.uint32))

    def fill(
        self,
        idxs: list[int],
        want: list[bytes],
        names: list[bytes],
        rows: np.ndarray,
        inos: np.ndarray,
    ) -> None:
        """Paths `idxs` (named `want` in a directory of `names`, `rows`, `inos`)."""
        index = {name: j for j, name in enumerate(names)}
        at = np.fromiter((index.get(w, -1) for w in want), np.int64, len(want))
        found = at >= 0
        dst = np.asarray(idxs, dtype=np.int64)[found]
        src = at[found]
        self.ino[dst] = inos[src]
        self.size[dst] = rows["st_size"][src]
        self.mode[dst] = rows["st_mode"][src]


def local_inos(
    rows: np.ndarray, devs: np.ndarray, dev: int, root_ino: int, offset: int
) -> tuple[np.ndarray, np.ndarray]:
    """(FUSE inode of each row on the root's device, mask of rows on other devices)."""
    src = rows["st_ino"]
    out = src + np.uint64(offset)
    local = devs == np.uint64(dev)
    out[local & (src == np.uint64(root_ino))] = pyfuse3.ROOT_INODE
    return out, ~local


def by_parent(
    paths: Sequence[bytes],
) -> tuple[list[tuple[bytes, bytes, bytes]], dict[bytes, list[int]]]:
    """Each path split at its last slash, and the path indices grouped by parent."""
    splits = [p.rpartition(b"/") for p in paths]
    groups: dict[bytes, list[int]] = {}
    for i, (parent, _, _) in enumerate(splits):
        groups.setdefault(parent, []).append(i)
    return splits, groups


_STATVFS_FIELDS = (
    "f_bsize",
    "f_frsize",
    "f_blocks",
    "f_bfree",
    "f_bavail",
    "f_files",
    "f_ffree",
    "f_favail",
    "f_namemax",
)


def statfs_reply(sv: os.statvfs_result) -> pyfuse3.StatvfsData:
    """The FUSE statfs answer of a filesystem's statvfs (the mount and the emulator)."""
    out = pyfuse3.StatvfsData()
    for field in _STATVFS_FIELDS:
        setattr(out, field, getattr(sv, field))
    return out
