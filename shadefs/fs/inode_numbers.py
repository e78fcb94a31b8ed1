"""FUSE inode numbers of source entries, derived from the source's own (st_dev, st_ino).

An entry on the source root's device gets `st_ino + INO_OFFSET`; anything else (a filesystem
mounted inside the source) gets a number from a separate counter, remembered for the life of
the mount. So an inode keeps its number after the kernel forgets it and looks it up again,
and a number names one (device, inode) pair. Which version of that inode a number stands for
is the FUSE generation's business (records.generation).

Except while the kernel still references the number for another file. A FUSE open or read
names the node only, not its generation: when a reused inode number moved the node to the new
file, an open the kernel had queued on the old file's inode (before it handled the lookup
that retires it) was served the new file's bytes. So a node id the kernel references for one
file is never handed to a different one: a non-directory met under another path with another
signature (`claim`) gets a fresh number, kept in two small dicts until the kernel forgets it,
and the old node stays on its old row (its path leads elsewhere now: ESTALE or ENOENT).
"""

from __future__ import annotations

import errno
import os
import stat

import numpy as np
import pyfuse3

from shadefs.file_version import Signature
from shadefs.fs import records
from shadefs.fs.snapshots import InodeTable, Snapshot

ROOT_INODE = pyfuse3.ROOT_INODE
# Inodes 2..INO_OFFSET-1 belong to the control directory (see control/entries.py).
INO_OFFSET = 16
_FOREIGN_BASE = 1 << 62
# Fresh numbers (see `claim`): above any foreign one, below 2**63 (the caches keep keys as
# signed 64-bit integers).
_FRESH_BASE = 3 << 61
_ROW = 0xFFFFFFFF
_MAX_INO = (1 << 64) - 1


class InodeNumbers:
    """The numbering, mixed into the namespace (which sets `dev` and `root_ino`)."""

    dev: int
    root_ino: int
    _foreign: dict[tuple[int, int], int]
    table: InodeTable
    _snaps: list[Snapshot | None]
    #: source-derived number -> the fresh number of the file that took it over while the
    #: kernel referenced it for another file, and back (both empty but for such races)
    _renumbered: dict[int, int]
    _base_of: dict[int, int]
    _fresh_count: int
    changed_files: int

    def _changed(self, ino: int) -> None:
        raise NotImplementedError  # the namespace's (fs/namespace.py): drop what opens kept

    def _init_numbers(self) -> None:
        self._foreign = {}
        self._renumbered = {}
        self._base_of = {}
        self._fresh_count = 0
        #: (number, stale) of nodes whose cached bytes no open will be served again, for
        #: the data path to drop: stale, a node that lost its file or version to a fresh
        #: number; not, a fresh number the kernel forgot (its file gets its own back)
        self.retired: list[tuple[int, bool]] = []

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

    def _inos(self, rows: np.ndarray, devs: np.ndarray) -> np.ndarray:
        """ino_of for a whole listing: vectorised, foreign entries one by one."""
        out, odd = records.local_inos(rows, devs, self.dev, self.root_ino, INO_OFFSET)
        for j in np.flatnonzero(odd | (out >= np.uint64(_FOREIGN_BASE))).tolist():
            out[j] = self._foreign_ino(int(devs[j]), int(rows["st_ino"][j]))
        for base, fresh in self._renumbered.items():
            out[out == np.uint64(base)] = fresh
        return out

    def claim(self, ino: int, snap: Snapshot, i: int) -> int:
        """The number to hand the kernel for row `i` of `snap` (whose number is `ino`): a
        fresh one when the kernel references `ino` for a different file or another version
        of a regular file: another signature (a rename or a hard link keep the number and
        move the node). Directories keep theirs (generation 0: the kernel never retires
        them; cwd survives a rename)."""
        val = self.table.get(ino)
        if val < 0 or val >> 32 == snap.slot:
            return ino  # not referenced, or this listing's row (or its hard link's)
        old = self._snaps[val >> 32]
        assert old is not None
        oi = val & _ROW
        if stat.S_ISDIR(int(snap.rows["st_mode"][i])):
            return ino
        ost, nst = old.stat(oi), snap.stat(i)
        if stat.S_IFMT(ost.st_mode) == stat.S_IFMT(nst.st_mode) and Signature.of(
            ost
        ) == Signature.of(nst):
            return ino
        if (old.dirino, old.name(oi)) == (snap.dirino, snap.name(i)):
            if not stat.S_ISREG(nst.st_mode):
                return ino  # a symlink's new version under its name: no pages to tell apart
            # A new version under its name (a reused number elsewhere is not counted), once
            # per node: an open's check may have seen it (-inf), and a node forgotten while
            # the kernel retried is renumbered again.
            self.changed_files += int(old.checked[oi] != -np.inf)
        # Its number is another file's now, or another version's (fs/revalidate.py): the old
        # node's file is gone or changed, so its next open checks the path (ESTALE, and the
        # kernel's retry finds what is there). The old node stays the old version.
        old.checked[oi] = -np.inf
        self._changed(ino)
        self.retired.append((ino, True))
        base = self._base_of.pop(ino, ino)
        fresh = _FRESH_BASE + self._fresh_count
        self._fresh_count += 1
        prev = self._renumbered.get(base)
        if prev is not None:
            self._base_of.pop(prev, None)
        self._renumbered[base] = fresh
        self._base_of[fresh] = base
        snap.ino[i] = fresh
        return fresh

    def claim_rows(self, snap: Snapshot, lo: int, hi: int) -> list[int]:
        """`claim` of rows lo..hi-1 before readdirplus hands them out; their numbers. Only
        rows that are not their inode's node yet and whose number the kernel references
        are looked at (one plain loop over the table)."""
        inos: list[int] = snap.ino[lo:hi].tolist()
        for k in self.table.held(inos):
            if not snap.lookups[lo + k]:
                inos[k] = self.claim(inos[k], snap, lo + k)
        return inos

    def forget_number(self, ino: int) -> None:
        """The kernel forgot `ino`: a fresh number's source inode gets its own back, and
        what was cached under the fresh number would never be found again (`retired`)."""
        if self._base_of:
            base = self._base_of.pop(ino, None)
            if base is not None:
                self.retired.append((ino, False))
                if self._renumbered.get(base) == ino:
                    del self._renumbered[base]
