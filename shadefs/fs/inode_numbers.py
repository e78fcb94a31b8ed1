"""FUSE inode numbers of source entries, derived from the source's own (st_dev, st_ino).

An entry on the source root's device gets `st_ino + INO_OFFSET`; anything else (a filesystem
mounted inside the source) gets a number from a separate counter, remembered for the life of
the mount. So an inode keeps its number after the kernel forgets it and looks it up again,
and a number names one (device, inode) pair. Which version of that inode a number stands for
is the FUSE generation's business (records.generation).

Except while the kernel still references the number for another file: a FUSE open or read
names the node only, not its generation, so a node id the kernel references for one file is
never handed to a different one. The namespace decides when (`Namespace.claim`: it knows
what the kernel references); this part hands out the fresh number (`renumber`) and keeps it
in two small dicts, both empty but for such races, until the kernel forgets it (`forget`):
then the source inode gets its own number back.

A part the namespace owns: its state is the numbering alone, and it reads nothing of the
namespace's table or snapshots.
"""

from __future__ import annotations

import errno
import os

import numpy as np
import pyfuse3

from shadefs.fs import records

ROOT_INODE = pyfuse3.ROOT_INODE
# Inodes 2..INO_OFFSET-1 belong to the control directory (see control/entries.py).
INO_OFFSET = 16
_FOREIGN_BASE = 1 << 62
# Fresh numbers (see `renumber`): above any foreign one, below 2**63 (the caches keep keys
# as signed 64-bit integers).
_FRESH_BASE = 3 << 61
_MAX_INO = (1 << 64) - 1


class InodeNumbers:
    """The numbering of one source tree, whose root is inode `root_ino` on device `dev`."""

    def __init__(self, dev: int, root_ino: int) -> None:
        self.dev = dev
        self.root_ino = root_ino
        self._foreign: dict[tuple[int, int], int] = {}
        #: source-derived number -> the fresh number of the file that took it over while the
        #: kernel referenced it for another file, and back (both empty but for such races)
        self._renumbered: dict[int, int] = {}
        self._base_of: dict[int, int] = {}
        self._fresh_count = 0

    def key_of_ino(self, st_ino: int) -> int:
        """The inode number of a source inode on the root's device (for restored entries)."""
        ino = st_ino + INO_OFFSET
        return ROOT_INODE if st_ino == self.root_ino else ino

    def ino_of(self, st: os.stat_result) -> int:
        ino = self._ino_of(st)
        return self._renumbered.get(ino, ino) if self._renumbered else ino

    def _ino_of(self, st: os.stat_result) -> int:
        if st.st_dev == self.dev:
            if st.st_ino == self.root_ino:
                return ROOT_INODE
            ino = st.st_ino + INO_OFFSET
            if ino < _FOREIGN_BASE:
                return ino
        return self._foreign_ino(st.st_dev, st.st_ino)

    def _foreign_ino(self, dev: int, st_ino: int) -> int:
        key = (dev, st_ino)
        known = self._foreign.get(key)
        if known is not None:
            return known
        ino = _FOREIGN_BASE + len(self._foreign)
        if ino > _MAX_INO:
            raise pyfuse3.FUSEError(errno.EOVERFLOW)
        self._foreign[key] = ino
        return ino

    def inos(self, rows: np.ndarray, devs: np.ndarray) -> np.ndarray:
        """ino_of for a whole listing: vectorised, foreign entries one by one."""
        out, odd = records.local_inos(rows, devs, self.dev, self.root_ino, INO_OFFSET)
        for j in np.flatnonzero(odd | (out >= np.uint64(_FOREIGN_BASE))).tolist():
            out[j] = self._foreign_ino(int(devs[j]), int(rows["st_ino"][j]))
        for base, fresh in self._renumbered.items():
            out[out == np.uint64(base)] = fresh
        return out

    def renumber(self, ino: int) -> int:
        """A fresh number for the file that takes over `ino` (a source-derived number, or a
        fresh one) while the kernel references `ino` for another: from now on the file's
        source inode maps to it, until the kernel forgets it."""
        base = self._base_of.pop(ino, ino)
        fresh = _FRESH_BASE + self._fresh_count
        self._fresh_count += 1
        prev = self._renumbered.get(base)
        if prev is not None:
            self._base_of.pop(prev, None)
        self._renumbered[base] = fresh
        self._base_of[fresh] = base
        return fresh

    def forget(self, ino: int) -> bool:
        """The kernel forgot `ino`: whether it was a fresh number (its source inode gets its
        own back, and what was cached under the fresh number would never be found again)."""
        if not self._base_of:
            return False
        base = self._base_of.pop(ino, None)
        if base is None:
            return False
        if self._renumbered.get(base) == ino:
            del self._renumbered[base]
        return True
