"""FUSE inode numbers of source entries, derived from the source's own (st_dev, st_ino).

An entry on the source root's device gets `st_ino + INO_OFFSET`; anything else (a filesystem
mounted inside the source) gets a number from a separate counter, remembered for the life of
the mount. So an inode keeps its number after the kernel forgets it and looks it up again,
and a number names one (device, inode) pair. Which version of that inode a number stands for
is the FUSE generation's business (records.generation).
"""

from __future__ import annotations

import errno
import os

import numpy as np
import pyfuse3

from shadefs.fs import records

ROOT_INODE = pyfuse3.ROOT_INODE
# Inodes 2..INO_OFFSET-1 belong to the control directory (see control.py).
INO_OFFSET = 16
_FOREIGN_BASE = 1 << 62
_MAX_INO = (1 << 64) - 1


class InodeNumbers:
    """The numbering, mixed into the namespace (which sets `dev` and `root_ino`)."""

    dev: int
    root_ino: int
    _foreign: dict[tuple[int, int], int]

    def key_of_ino(self, st_ino: int) -> int:
        """The inode number of a source inode on the root's device (for restored entries)."""
        ino = st_ino + INO_OFFSET
        return ROOT_INODE if st_ino == self.root_ino else ino

    def ino_of(self, st: os.stat_result) -> int:
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

    def _inos(self, rows: np.ndarray, devs: np.ndarray) -> np.ndarray:
        """ino_of for a whole listing: vectorised, foreign entries one by one."""
        out, odd = records.local_inos(rows, devs, self.dev, self.root_ino, INO_OFFSET)
        for j in np.flatnonzero(odd | (out >= np.uint64(_FOREIGN_BASE))).tolist():
            out[j] = self._foreign_ino(int(devs[j]), int(rows["st_ino"][j]))
        return out
