"""A node's version as the source has it, checked at an open (mixed into the namespace).

`fresh_stat` checks a node against the source (one lstat, in the directory the node is in),
`stale` answers ESTALE for a node whose path leads elsewhere now, and `retire` for a node
whose file has a new version.

A node stands for one version of one file, as the kernel's inode of that number does: its
FUSE generation is the low bits of the version's ctime (records.generation), and its size
is what the kernel bounds reads by. So a new version is never put on the node (a GETATTR
reply, which carries no generation, would hand the old inode's open handles the new size:
their reads past the old end come back short and the kernel's zero-filled page tail could be
served as data), and the next entry reply that shows it gives it a fresh number
(`InodeNumbers.claim`). An open that finds the new version answers ESTALE; the kernel's one
retry looks the name up again and opens the new node, while handles of the old one read the
old version to its end.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import stat
from collections.abc import Callable

import pyfuse3

from shadefs.file_version import Signature
from shadefs.fs.snapshots import InodeTable, Snapshot
from shadefs.kernel.notify import forget_entry
from shadefs.source.part import Source

log = logging.getLogger(__name__)

# Errors saying that a path no longer leads to what was looked up (ELOOP: a component on it
# is now a symlink, which the source refuses to follow).
GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)
# A node's path that no longer leads to it (the open answers ESTALE; ELOOP stays ELOOP).
MOVED = (errno.ENOENT, errno.ENOTDIR)
_ROW = 0xFFFFFFFF


class Revalidation:
    """`fresh_stat`, `stale` and `retire`; the namespace supplies the attributes below."""

    source: Source
    revalidate: float
    revalidations: int
    clock: Callable[[], float]
    changed_files: int
    table: InodeTable
    listings: dict[int, int]
    _snaps: list[Snapshot | None]

    locate: Callable[[int], tuple[Snapshot, int]]
    ino_of: Callable[[os.stat_result], int]
    _changed: Callable[[int], None]

    async def fresh_stat(self, ino: int, *, force: bool = False) -> bool:
        """Whether the file changed, checked against the source if `revalidate` has passed
        or on `force`. A regular file's change leaves the row as it is (the node is the old
        version: the caller `retire`s it), any other's updates the row; a path that leads to
        another inode or to nothing, or through another directory than the node's, raises
        ESTALE; a source that does not answer leaves the old stat (its cached bytes stay
        servable), unless `force`."""
        snap, i = self.locate(ino)
        old = snap.stat(i)
        now = self.clock()
        if not force and (now - snap.checked[i] < self.revalidate or not self.source.healthy):
            return False
        path = snap.child_path(i)
        # The parent's inode, to check the path's directory against: a directory renamed
        # since the row was made leaves the path leading into whatever took its name, where
        # a new file may even have the node's (freed and reused) inode number.
        parent = self._parent_ino(snap) if path else None
        try:
            if parent is None:
                st = await self.source.lstat(path)
            else:
                dst, st = await self.source.run(self.source.paths.lstat_in, path)
                if dst.st_ino != parent:
                    raise self.stale(ino)
        except pyfuse3.FUSEError as exc:
            if exc.errno in MOVED:
                raise self.stale(ino) from None
            if exc.errno in GONE or force:
                raise
            return False
        if self.ino_of(st) != ino or stat.S_IFMT(st.st_mode) != stat.S_IFMT(old.st_mode):
            raise self.stale(ino)  # the path names another file now
        self.revalidations += 1
        changed = Signature.of(st) != Signature.of(old)
        val = self.table.get(ino)  # where the inode is now (it may have moved or gone)
        if val >= 0:
            snap, i = self._snaps[val >> 32], val & _ROW  # type: ignore[assignment]
            if not changed:
                snap.checked[i] = now
            elif stat.S_ISREG(st.st_mode):
                self.changed_files += int(snap.checked[i] != -math.inf)  # (once per node)
                snap.checked[i] = -math.inf  # every open of it checks, and is retired
                self._changed(ino)
            else:
                snap.checked[i] = now
                snap.set_stat(i, st)
                self._changed(ino)
        if changed:
            log.info("%r changed on the source", path)
        return changed

    def _parent_ino(self, snap: Snapshot) -> int | None:
        """The source inode number of the directory `snap`'s rows are in (None: unknown)."""
        try:
            psnap, pi = self.locate(snap.dirino)
        except pyfuse3.FUSEError:
            return None
        return int(psnap.rows["st_ino"][pi])

    def retire(self, ino: int) -> pyfuse3.FUSEError:
        """ESTALE for an open of a node whose file has a new version (`fresh_stat`): the
        kernel's retry looks the name up again, in a listing read afresh, and gets the new
        version under a fresh number."""
        return self.stale(ino, "has a new version")

    def stale(self, ino: int, why: str = "no longer leads to it") -> pyfuse3.FUSEError:
        """ESTALE for a node whose path no longer leads to it. The kernel's one retry looks
        the names up again: the parent's listing is aged so that the source answers."""
        val = self.table.get(ino)
        if val >= 0:
            snap = self._snaps[val >> 32]
            assert snap is not None
            slot = self.listings.get(snap.dirino)
            listing = self._snaps[slot] if slot is not None else None
            if listing is not None:
                listing.stamp = -math.inf
            self._changed(ino)
            i = val & _ROW
            if snap.dirino:  # not the root: the kernel forgets the name, and asks again
                forget_entry(snap.dirino, snap.name(i))
            log.info("%r %s (inode %d): ESTALE", snap.child_path(i), why, ino)
        return pyfuse3.FUSEError(errno.ESTALE)
