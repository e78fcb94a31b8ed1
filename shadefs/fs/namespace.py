"""The inode <-> path table, stat snapshots and directory listings.

Inode numbers are derived from the source's own (st_dev, st_ino): an entry on the source
root's device gets `st_ino + INO_OFFSET`, anything else (a filesystem mounted inside the
source) gets a number from a separate counter that is remembered for the life of the mount.
So an inode keeps its number after the kernel forgets it and looks it up again, and the
table only holds what the kernel currently references: `forget` removes entries whose
lookup count drops to zero, and a million-file tree costs nothing until it is walked.

The tree is read-only: a directory is listed once (names plus lstat, in one worker thread)
and the snapshot answers readdir, lookup and negative lookup of its children without going
back to the source. A name looked up in a directory that is not listed is asked of the
source alone and kept as a one-row snapshot. Snapshots live as long as the kernel
references their directory or an entry in them.

Per-file state is compact (snapshots.py): a known inode is a row of a snapshot, found through
the inode table; its path is the snapshot's directory path plus the row's name. A refreshed
snapshot lives while inodes point into it; each moves to the new one when the kernel hears of
it again (readdirplus, lookup) unchanged, so a changed file is still found by `fresh_stat`.

Revalidation: after `revalidate` seconds a snapshot is refreshed when it is next used, and a
file's signature is checked again when it is next opened (`fresh_stat`). When the source is
not answering, both fall back to what they have: a cached file keeps being served and `ls`
keeps working on the last snapshot, instead of hanging with the source.

The source never follows a symlink (see source.py). A path whose directory was swapped for a
symlink after it was looked up fails with ELOOP, which counts here as "gone", like ENOENT:
the refreshed parent listing shows the symlink as a symlink, and nothing is resolved through
it (`resolve` answers missing, so control paths through it are refused).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Sequence

import numpy as np
import pyfuse3
import trio

from shadefs.cache.ssd_format import Signature
from shadefs.fs import records
from shadefs.fs.records import Node, Resolved
from shadefs.fs.snapshots import InodeTable, Snapshot, Stat, scan_rows
from shadefs.source import Source
from shadefs.stats import NamespaceStats

log = logging.getLogger(__name__)

ROOT_INODE = pyfuse3.ROOT_INODE
# Inodes 2..INO_OFFSET-1 belong to the control directory (see control.py).
INO_OFFSET = 16
_FOREIGN_BASE = 1 << 62
_MAX_INO = (1 << 64) - 1
# Errors saying that a path no longer leads to what was looked up (ELOOP: a component on it
# is now a symlink, which the source refuses to follow).
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)
_ROW = 0xFFFFFFFF
_OPENED_KEPT = 4096


class Namespace:
    """Maps FUSE inodes to source paths and serves attributes from snapshots."""

    def __init__(
        self, source: Source, *, timeout: float = 3600.0, revalidate: float = 3600.0
    ) -> None:
        self.source = source
        self.timeout = timeout
        self.revalidate = revalidate
        self.revalidations = 0
        self.changed_files = 0
        root_st = source.root_stat()
        if not stat.S_ISDIR(root_st.st_mode):
            raise NotADirectoryError(source.root)
        self.dev = root_st.st_dev
        self.root_ino = root_st.st_ino
        _, rows, _ = scan_rows([(b"", root_st)])
        # Slot 0: the root's own entry (its path is b"").
        root = Snapshot(0, b"", [b""], rows, np.array([ROOT_INODE], np.uint64), time.monotonic())
        root.lookups[0] = 1
        root.refs = 1
        self._snaps: list[Snapshot | None] = [root]
        self._free: list[int] = []
        #: the inodes the kernel references (len() and `in` work)
        self.table = InodeTable()
        self.table.set(ROOT_INODE, 0)
        #: directory inode -> the slot of its current snapshot
        self.listings: dict[int, int] = {}
        self._foreign: dict[tuple[int, int], int] = {}
        self._listing_flights: dict[int, trio.Event] = {}
        # Records of the files opened last (at most _OPENED_KEPT): a hot file's reopen skips
        # rebuilding them. Dropped when the row or stat changes (_move, forget, fresh_stat).
        self._opened: dict[int, tuple[Stat, bytes, Snapshot, int]] = {}

    def describe(self) -> NamespaceStats:
        return NamespaceStats(
            revalidations=self.revalidations,
            changed_files=self.changed_files,
            inodes_known=len(self.table),
            directories_listed=len(self.listings),
        )

    # --- inode numbers ----------------------------------------------------------------

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

    # --- the table ----------------------------------------------------------------------

    def locate(self, ino: int) -> tuple[Snapshot, int]:
        """The snapshot and row of a referenced inode; ESTALE for anything else."""
        val = self.table.get(ino)
        if val < 0:
            # The kernel only asks about inodes it looked up; anything else is stale.
            raise pyfuse3.FUSEError(errno.ESTALE)
        snap = self._snaps[val >> 32]
        assert snap is not None
        return snap, val & _ROW

    def node(self, ino: int) -> Node:
        snap, i = self.locate(ino)
        return Node(snap.child_path(i), snap.stat(i), int(snap.lookups[i]), snap.checked[i])

    def opening(self, ino: int) -> tuple[Stat, bytes, float]:
        """(stat, path, time of the last signature check) of a file being opened."""
        rec = self._opened.get(ino)
        if rec is None:
            val = self.table.get(ino)
            if val < 0:
                raise pyfuse3.FUSEError(errno.ESTALE)
            snap = self._snaps[val >> 32]
            assert snap is not None
            i = val & _ROW
            if len(self._opened) >= _OPENED_KEPT:
                # Start afresh rather than drop the oldest: popping a dict's first entries
                # one by one makes finding the next first entry ever slower.
                self._opened.clear()
            rec = self._opened[ino] = (snap.stat(i), snap.child_path(i), snap, i)
        return rec[0], rec[1], rec[2].checked.item(rec[3])

    def path(self, ino: int) -> bytes:
        snap, i = self.locate(ino)
        return snap.child_path(i)

    def stat(self, ino: int) -> Stat:
        snap, i = self.locate(ino)
        return snap.stat(i)

    async def lookup(self, parent: int, name: bytes) -> tuple[int, Stat]:
        """Resolve `name` in `parent`, count one kernel reference and return (ino, st)."""
        slot = self.listings.get(parent)
        if slot is not None:
            snap = self._snaps[slot]
            assert snap is not None
            i = snap.find(name)
            if i < 0:
                raise pyfuse3.FUSEError(errno.ENOENT)
            ino = int(snap.ino[i])
            self.remember(ino, snap, i)
            return ino, snap.stat(i)
        # Not listed: ask the source about this one name, and keep its row on its own.
        ppath = self.path(parent)
        st = await self.source.lstat(ppath + b"/" + name if ppath else name)
        ino = self.ino_of(st)
        _, rows, _ = scan_rows([(name, st)])
        snap = Snapshot(parent, ppath, [name], rows, np.array([ino], np.uint64), time.monotonic())
        self._place(snap)
        self.remember(ino, snap, 0)
        self._maybe_free(snap)  # unless the row became the node
        return ino, snap.stat(0)

    def remember(self, ino: int, snap: Snapshot, i: int) -> None:
        """Count one kernel reference to `ino`, row `i` of `snap` (from lookup or an
        accepted readdirplus entry)."""
        val = self.table.get(ino)
        if val < 0:
            self.table.set(ino, snap.slot << 32 | i)
            snap.lookups[i] = 1
            snap.checked[i] = snap.stamp
            snap.refs += 1
            return
        oslot, oi = val >> 32, val & _ROW
        old = self._snaps[oslot]
        assert old is not None
        old.lookups[oi] += 1
        if old is snap:
            return
        if stat.S_IFMT(int(old.rows["st_mode"][oi])) != stat.S_IFMT(int(snap.rows["st_mode"][i])):
            # The inode number was reused by an entry of another type (a file or directory
            # swapped for a symlink): the node describes something gone.
            self._move(ino, old, oi, snap, i, time.monotonic())
            self._drop_listing(ino)
        elif old.dirino == snap.dirino and Signature.of(old.stat(oi)) == Signature.of(snap.stat(i)):
            # Unchanged in a refreshed listing: follow it, so that the old one can go. A
            # changed one keeps its own stat until fresh_stat notices the change.
            self._move(ino, old, oi, snap, i, float(old.checked[oi]))

    def remember_rows(self, snap: Snapshot, lo: int, hi: int) -> None:
        """`remember` rows lo..hi-1 of `snap` (what readdirplus handed out). A row with a
        nonzero lookup count is its inode's node, so those count up in one step."""
        if lo >= hi:
            return
        seg = snap.lookups[lo:hi]
        owned = seg > 0
        seg[owned] += 1
        if owned.all():
            return
        rows: Sequence[int]
        if owned.any():
            rows = (lo + np.flatnonzero(~owned)).tolist()
            inos = snap.ino[rows]
        else:  # the usual case: a listing read for the first time
            rows, inos = range(lo, hi), snap.ino[lo:hi]
        known = self.table.add_rows(inos, rows, snap.slot << 32)
        added = np.asarray(rows, dtype=np.intp)
        if known:
            added = np.delete(added, known)
        snap.lookups[added] = 1
        snap.checked[added] = snap.stamp
        snap.refs += len(added)
        # Known elsewhere (a refreshed listing, a hard link, a reused number): one by one,
        # once the new rows hold their first reference.
        for k in known:
            self.remember(int(inos[k]), snap, rows[k])

    def _move(self, ino: int, old: Snapshot, oi: int, new: Snapshot, i: int, t: float) -> None:
        self._opened.pop(ino, None)
        new.lookups[i] = old.lookups[oi]
        new.checked[i] = t
        old.lookups[oi] = 0
        self.table.set(ino, new.slot << 32 | i)
        new.refs += 1
        self._release(old)

    def forget(self, items: list[tuple[int, int]]) -> None:
        table = self.table
        for ino, n in items:
            val = table.get(ino)
            if val < 0 or ino == ROOT_INODE:
                continue
            snap = self._snaps[val >> 32]
            assert snap is not None
            i = val & _ROW
            left = int(snap.lookups[i]) - n
            if left > 0:
                snap.lookups[i] = left
                continue
            snap.lookups[i] = 0
            table.pop(ino)
            self._opened.pop(ino, None)
            self._drop_listing(ino)
            self._release(snap)

    def _release(self, snap: Snapshot) -> None:
        snap.refs -= 1
        self._maybe_free(snap)

    def _maybe_free(self, snap: Snapshot) -> None:
        if snap.refs <= 0 and self.listings.get(snap.dirino) != snap.slot:
            self._snaps[snap.slot] = None
            self._free.append(snap.slot)

    def _drop_listing(self, ino: int) -> None:
        slot = self.listings.pop(ino, None)
        if slot is not None:
            snap = self._snaps[slot]
            assert snap is not None
            self._maybe_free(snap)

    def _place(self, snap: Snapshot) -> None:
        """Give `snap` a slot in the snapshot list."""
        if self._free:
            snap.slot = self._free.pop()
            self._snaps[snap.slot] = snap
        else:
            snap.slot = len(self._snaps)
            self._snaps.append(snap)

    def _adopt(self, snap: Snapshot) -> None:
        """Give `snap` a slot and make it its directory's current listing."""
        self._place(snap)
        old = self.listings.get(snap.dirino)
        self.listings[snap.dirino] = snap.slot
        if old is not None:
            prev = self._snaps[old]
            assert prev is not None
            self._maybe_free(prev)

    # --- directories ------------------------------------------------------------------

    async def listing(self, ino: int) -> Snapshot:
        """The directory's snapshot, listing the source once even under concurrent opens.

        A snapshot older than `revalidate` is refreshed; if the source does not answer, the
        old snapshot is served (and a known outage skips the attempt altogether).
        """
        slot = self.listings.get(ino)
        if slot is not None:
            old = self._snaps[slot]
            assert old is not None
            if time.monotonic() - old.stamp < self.revalidate or not self.source.healthy:
                return old
            try:
                return await self._list(ino)
            except pyfuse3.FUSEError as exc:
                if exc.errno in _GONE:
                    raise
                return old
        return await self._list(ino)

    async def _list(self, ino: int) -> Snapshot:
        while True:
            flight = self._listing_flights.get(ino)
            if flight is None:
                break
            await flight.wait()
            slot = self.listings.get(ino)
            if slot is not None:
                snap = self._snaps[slot]
                assert snap is not None
                if time.monotonic() - snap.stamp < self.revalidate:
                    return snap
        dsnap, di = self.locate(ino)
        if not stat.S_ISDIR(int(dsnap.rows["st_mode"][di])):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        path = dsnap.child_path(di)
        flight = self._listing_flights[ino] = trio.Event()
        try:
            names, rows, devs = await self.source.run(self._scan, path)
        finally:
            del self._listing_flights[ino]
            flight.set()
        snap = Snapshot(ino, path, names, rows, self._inos(rows, devs), time.monotonic())
        # The kernel may have forgotten the directory while we listed it.
        if ino in self.table:
            self._adopt(snap)
        return snap

    def _scan(self, path: bytes) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        """List `path` into snapshot columns (in a worker thread)."""
        return scan_rows(self.source.paths.scandir(path))

    async def fresh_stat(self, ino: int) -> tuple[Stat, bool]:
        """The file's stat, checked against the source if `revalidate` has passed.

        Returns (stat, changed). A file that vanished raises ENOENT; a source that does not
        answer leaves the old stat in place (its cached bytes stay servable).
        """
        snap, i = self.locate(ino)
        old = snap.stat(i)
        now = time.monotonic()
        if now - snap.checked[i] < self.revalidate or not self.source.healthy:
            return old, False
        path = snap.child_path(i)
        try:
            st = await self.source.lstat(path)
        except pyfuse3.FUSEError as exc:
            if exc.errno in _GONE:
                raise
            return old, False
        self.revalidations += 1
        changed = Signature.of(st) != Signature.of(old)
        val = self.table.get(ino)  # where the inode is now (it may have moved or gone)
        if val >= 0:
            snap, i = self._snaps[val >> 32], val & _ROW  # type: ignore[assignment]
            snap.checked[i] = now
            if changed:
                snap.set_stat(i, st)
                self._opened.pop(ino, None)
        if not changed:
            return old, False
        self.changed_files += 1
        log.info("%r changed on the source: refetching", path)
        return Stat.of(st), True

    def attrs(self, ino: int, st: Stat | os.stat_result) -> pyfuse3.EntryAttributes:
        return records.attrs(ino, st, self.timeout)

    # --- resolving paths that the kernel has not looked up ------------------------------

    async def resolve(self, paths: Sequence[bytes]) -> Resolved:
        """Inode, size and mode of many relative paths, listing each parent directory once.

        Used for the sampler's file list and the residency queries: a million paths in a
        thousand class directories cost a thousand source listings, not a million lstats
        (none for a directory whose snapshot is fresh: it is what lookups answer from), and
        the answer is three arrays. A path that does not exist, or whose parent is not a
        directory or is reached through a symlink, gets mode 0. Nothing is kept.
        """
        splits, by_dir = records.by_parent(paths)
        out = Resolved.empty(len(paths))
        fresh = self._fresh_listings()
        for parent, idxs in by_dir.items():
            snap = fresh.get(parent)
            if snap is not None:
                names, rows, inos = snap.name_list(), snap.rows, snap.ino
            else:
                try:
                    names, rows, devs = await self.source.run(self._scan, parent)
                except pyfuse3.FUSEError as exc:
                    if exc.errno in _GONE:
                        continue
                    raise
                inos = self._inos(rows, devs)
            out.fill(idxs, [splits[i][2] for i in idxs], names, rows, inos)
        return out

    def _fresh_listings(self) -> dict[bytes, Snapshot]:
        """The current snapshots younger than `revalidate`, by directory path."""
        now = time.monotonic()
        out = {}
        for slot in self.listings.values():
            snap = self._snaps[slot]
            if snap is not None and now - snap.stamp < self.revalidate:
                out[snap.path] = snap
        return out
