"""The namespace: the inode <-> path table, stat snapshots, directory listings and the
version each node stands for.

Inode numbers come from the source's (st_dev, st_ino) (inode_numbers.py). The table only
holds what the kernel references (`forget` drops the rest): a million-file tree costs
nothing until it is walked. A directory is listed once (names plus lstat, in one worker
thread); the snapshot answers readdir and lookups of its children until it is older than
`revalidate`, then the next use (a lookup too) lists it again. A name in a directory that is
not listed, or missing from a listing the kernel was never answered from (speculation lists
directories for itself), is asked of the source alone and kept as a one-row snapshot.

Per-file state is compact (snapshots.py): a node is a snapshot row; its path is the
snapshot's directory path plus the row's name. A node moves to the row the kernel last heard
of it by (readdirplus, lookup): a refreshed listing, a rename, a hard link's other name, a
reused inode number (unless the kernel still references the node for another file or
another version of a regular file: a fresh number, `claim` and `fresh_stat`). A directory
whose stat changed on the way loses its listing. A path is only where a file was: an open
whose path leads elsewhere gets ESTALE (`stale`), and the kernel's one retry looks the names
up again (docs/developer-notes.md, "Identity"). A directory whose listing went with its
inode is listed again in the background once its names are looked up one by one (`relist`,
relisting.py).

When the source is not answering, revalidation falls back to what it has: cached files keep
being served and `ls` works on the last snapshot. The source never follows a symlink
(source/part.py): a path through a directory swapped for a symlink fails with ELOOP, which counts
as "gone" like ENOENT, and `resolve` answers it missing.

A node stands for one version of one file, as the kernel's inode of that number does: its
FUSE generation is the low bits of the version's ctime (records.generation), and its size
is what the kernel bounds reads by. So a new version is never put on the node (a GETATTR
reply, which carries no generation, would hand the old inode's open handles the new size:
their reads past the old end come back short and the kernel's zero-filled page tail could be
served as data), and the next entry reply that shows it gives it a fresh number (`claim`).
An open checks its node against the source (`fresh_stat`, one lstat in the directory the
node is in); one that finds the new version answers ESTALE (`retire`), and the kernel's one
retry looks the name up again and opens the new node, while handles of the old one read the
old version to its end.

Every open of a regular file asks for the node's stat, its path and the time of its last
signature check (`opening`): a table lookup, a row unpacked and a path joined. Two records
spare a reopen that work. Both are dropped together (`_changed`)
whenever the node's row, stat, path or check time changes or the kernel forgets it, so what
either holds is still true of the node:

- `_opened`: the stat and path of the files opened last, at most `OPENED_KEPT` (cleared as
  a whole when full: a dataset larger than that rebuilds them at most opens).
- the cache's record, per node, of the RAM entry that an open found to be the node's
  version by its current path (cache/face.py, `verify`): a reopen that finds one before
  the check is due is a hit without the namespace. The cache keeps it (and drops it with
  its entry); the namespace tells it of each change (`on_change`, the cache's
  `unverify`).

`changes` counts the drops: an open that awaited (a fetch, a check at the source) records
what it verified only if no node changed meanwhile.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import stat
import time
from collections.abc import Callable, Sequence

import numpy as np
import pyfuse3
import trio

from shadefs.control.entries import NAME
from shadefs.file_version import Signature
from shadefs.fs import records
from shadefs.fs.inode_numbers import ROOT_INODE, InodeNumbers
from shadefs.fs.records import Node, Resolved
from shadefs.fs.relisting import RelistQueue
from shadefs.fs.snapshots import InodeTable, Snapshot, Stat, scan_rows
from shadefs.kernel.notify import forget_entry
from shadefs.source.part import Source
from shadefs.stats import NamespaceStats

log = logging.getLogger(__name__)

_ROW = 0xFFFFFFFF
OPENED_KEPT = 4096
# The source's answers that say a path no longer leads to what was looked up (ELOOP: a
# component on it is now a symlink, which the source refuses to follow).
GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)
# A node's path that no longer leads to it (the open answers ESTALE; ELOOP stays ELOOP).
MOVED = (errno.ENOENT, errno.ENOTDIR)


def _nothing(ino: int) -> None:
    pass


class _Moved(Exception):
    """A directory's path leads to another directory now (raised in a worker thread)."""


class Namespace:
    """Maps FUSE inodes to source paths and serves attributes from snapshots."""

    def __init__(
        self,
        source: Source,
        *,
        timeout: float = 3600.0,
        revalidate: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: seconds, for the snapshots' ages (tests hand a clock they move)."""
        self.clock = clock
        self.source = source
        self.timeout = timeout
        self.revalidate = revalidate
        self.revalidations = 0
        self.changed_files = 0
        root_st = source.root_stat()
        if not stat.S_ISDIR(root_st.st_mode):
            raise NotADirectoryError(source.root)
        #: FUSE inode numbers from the source's (st_dev, st_ino)
        self.numbers = InodeNumbers(root_st.st_dev, root_st.st_ino)
        #: (number, stale) of nodes whose cached bytes no open will be served again, for
        #: the data path to drop: stale, a node that lost its file or version to a fresh
        #: number (`claim`); not, a fresh number the kernel forgot (its file gets its own
        #: back)
        self.retired: list[tuple[int, bool]] = []
        _, rows, _ = scan_rows([(b"", root_st)])
        # Slot 0: the root's own entry (its path is b"").
        root = Snapshot(0, b"", [b""], rows, np.array([ROOT_INODE], np.uint64), self.clock())
        root.lookups[0] = 1
        root.refs = 1
        self._snaps: list[Snapshot | None] = [root]
        self._free: list[int] = []
        #: the inodes the kernel references (len() and `in` work)
        self.table = InodeTable()
        self.table.set(ROOT_INODE, 0)
        #: directory inode -> the slot of its current snapshot
        self.listings: dict[int, int] = {}
        # A listing in flight per directory: its end, and its error (EIO: shared, below).
        self._listing_flights: dict[int, tuple[trio.Event, list[int]]] = {}
        # What opens read of a node, for its next open: dropped when its row, stat or path
        # changes (`_changed`: _move, forget, fresh_stat, stale, claim).
        self._opened: dict[int, tuple[Stat, bytes, Snapshot, int]] = {}
        # Told of each change: the cache's `unverify` (fs/operations.py sets it).
        self.on_change: Callable[[int], None] = _nothing
        self.changes = 0
        #: directories to list again in the background (`relist`)
        self.relisting = RelistQueue()

    def describe(self) -> NamespaceStats:
        return NamespaceStats(
            revalidations=self.revalidations,
            changed_files=self.changed_files,
            inodes_known=len(self.table),
            directories_listed=len(self.listings),
            directories_relisted=self.relisting.relisted,
        )

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
            if self.clock() - snap.stamp >= self.revalidate:
                snap = await self.listing(parent)  # aged: a new name may be there now
            i = snap.find(name)
            if i >= 0:
                ino = self.remember(int(snap.ino[i]), snap, i)
                return ino, snap.stat(i)
            if snap.shown:
                raise pyfuse3.FUSEError(errno.ENOENT)
            # Listed by the daemon for itself (speculation) before the name was made: answer
            # as if it were not listed, or a new file is missing by path until `revalidate`.
        else:
            self.relisting.looked_up(parent)  # (the names after this one: from that listing)
        # Not listed: ask the source about this one name, and keep its row on its own. The
        # name is looked up in the directory the parent is (its path may lead elsewhere now).
        psnap, pi = self.locate(parent)
        ppath, pino = psnap.child_path(pi), int(psnap.rows["st_ino"][pi])
        rel = ppath + b"/" + name if ppath else name
        dst, st = await self.source.run(self.source.paths.lstat_in, rel)
        if dst.st_ino != pino:
            raise self.stale(parent)
        ino = self.numbers.ino_of(st)
        _, rows, _ = scan_rows([(name, st)])
        snap = Snapshot(parent, ppath, [name], rows, np.array([ino], np.uint64), self.clock())
        self._place(snap)
        ino = self.remember(ino, snap, 0)
        self._maybe_free(snap)  # unless the row became the node
        return ino, snap.stat(0)

    def remember(self, ino: int, snap: Snapshot, i: int) -> int:
        """Count one kernel reference to row `i` of `snap`, numbered `ino` (from lookup or
        an accepted readdirplus entry); the number, a fresh one if `claim` says so."""
        ino = self.claim(ino, snap, i)
        val = self.table.get(ino)
        if val < 0:
            self.table.set(ino, snap.slot << 32 | i)
            snap.lookups[i] = 1
            snap.checked[i] = snap.stamp
            snap.refs += 1
            return ino
        oslot, oi = val >> 32, val & _ROW
        old = self._snaps[oslot]
        assert old is not None
        old.lookups[oi] += 1
        if old is snap:
            return ino  # a hard link's other name in the same listing: one path is enough
        # The newest row the kernel heard of is the node: a refreshed listing (so that the
        # old one can go), a rename, a hard link's other name, a reused inode number.
        ost, nst = old.stat(oi), snap.stat(i)
        if stat.S_IFMT(ost.st_mode) != stat.S_IFMT(nst.st_mode):
            # Reused by an entry of another type (a file or directory swapped for a
            # symlink): the node describes something gone.
            self._move(ino, old, oi, snap, i, self.clock())
            self._drop_listing(ino)
        elif Signature.of(ost) == Signature.of(nst):
            moved_dir = stat.S_ISDIR(nst.st_mode) and old.child_path(oi) != snap.child_path(i)
            self._move(ino, old, oi, snap, i, float(old.checked[oi]))
            if moved_dir:
                self._drop_listing(ino)  # listed under its old path: list it again
        else:
            # Another version of a directory or symlink (a regular file's has a number of its
            # own: `claim`): the kernel was just told its new attributes.
            self._move(ino, old, oi, snap, i, self.clock())
            self._drop_listing(ino)
        return ino

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

    def claim(self, ino: int, snap: Snapshot, i: int) -> int:
        """The number to hand the kernel for row `i` of `snap` (whose number is `ino`): a
        fresh one when the kernel references `ino` for a different file or another version
        of a regular file: another signature (a rename or a hard link keep the number and
        move the node). Directories keep theirs (generation 0: the kernel never retires
        them; cwd survives a rename).

        A FUSE open or read names the node only, not its generation: when a reused inode
        number moved the node to the new file, an open the kernel had queued on the old
        file's inode (before it handled the lookup that retires it) was served the new
        file's bytes. So the old node stays on its old row (its path leads elsewhere now:
        ESTALE or ENOENT), and the new file gets a fresh number (inode_numbers.py)."""
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
        # Its number is another file's now, or another version's (`fresh_stat`): the old
        # node's file is gone or changed, so its next open checks the path (ESTALE, and the
        # kernel's retry finds what is there). The old node stays the old version.
        old.checked[oi] = -np.inf
        self._changed(ino)
        self.retired.append((ino, True))
        fresh = self.numbers.renumber(ino)
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

    def _move(self, ino: int, old: Snapshot, oi: int, new: Snapshot, i: int, t: float) -> None:
        self._changed(ino)
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
            if self.numbers.forget(ino):
                self.retired.append((ino, False))
            self._changed(ino)
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
            self.relisting.lost(ino)
            snap = self._snaps[slot]
            assert snap is not None
            self._maybe_free(snap)

    def _place(self, snap: Snapshot) -> None:
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

    # --- what opens read -----------------------------------------------------------

    def _changed(self, ino: int) -> None:
        """Node `ino`'s row, stat, path or check time changed, or the kernel forgot it."""
        self._opened.pop(ino, None)
        self.on_change(ino)
        self.changes += 1

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
            if len(self._opened) >= OPENED_KEPT:
                # Start afresh rather than drop the oldest: popping a dict's first entries
                # one by one makes finding the next first entry ever slower.
                self._opened.clear()
            rec = self._opened[ino] = (snap.stat(i), snap.child_path(i), snap, i)
        return rec[0], rec[1], rec[2].checked.item(rec[3])

    # --- a node's version -----------------------------------------------------------

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
        if self.numbers.ino_of(st) != ino or stat.S_IFMT(st.st_mode) != stat.S_IFMT(old.st_mode):
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

    # --- directories ------------------------------------------------------------------

    async def listing(self, ino: int, *, quiet: bool = False) -> Snapshot:
        """The directory's snapshot, listing the source once even under concurrent opens.

        A snapshot older than `revalidate` is refreshed; if the source does not answer, the
        old snapshot is served (and a known outage skips the attempt altogether). `quiet`:
        for the daemon's own use; the snapshot is `shown` once the kernel is answered from it
        (then it answers the lookup of a name it lacks, until it ages), and a directory found
        moved gives ESTALE without touching the kernel's entries.
        """
        snap = await self._listing(ino, quiet)
        snap.shown |= not quiet
        return snap

    async def _listing(self, ino: int, quiet: bool) -> Snapshot:
        slot = self.listings.get(ino)
        if slot is not None:
            old = self._snaps[slot]
            assert old is not None
            if self.clock() - old.stamp < self.revalidate or not self.source.healthy:
                return old
            try:
                return await self._list(ino, quiet)
            except pyfuse3.FUSEError as exc:
                if exc.errno in GONE:
                    raise
                return old
        return await self._list(ino, quiet)

    async def _list(self, ino: int, quiet: bool) -> Snapshot:
        while True:
            flight = self._listing_flights.get(ino)
            if flight is None:
                break
            await flight[0].wait()
            if errno.EIO in flight[1]:
                # The source did not answer the listing that this one waited for; it fails
                # too, rather than list again and wait one more timeout after it (and each
                # waiter after the one before).
                raise pyfuse3.FUSEError(errno.EIO)
            slot = self.listings.get(ino)
            if slot is not None:
                snap = self._snaps[slot]
                assert snap is not None
                if self.clock() - snap.stamp < self.revalidate:
                    return snap
        dsnap, di = self.locate(ino)
        if not stat.S_ISDIR(int(dsnap.rows["st_mode"][di])):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        path = dsnap.child_path(di)
        flight = self._listing_flights[ino] = (trio.Event(), [])
        try:
            st_ino = int(dsnap.rows["st_ino"][di])
            names, rows, devs = await self.source.run(self._scan_dir, path, st_ino)
        except pyfuse3.FUSEError as exc:
            flight[1].append(exc.errno)
            raise
        except _Moved:
            # (The daemon's own listing leaves the kernel's entries to its own requests.)
            raise (pyfuse3.FUSEError(errno.ESTALE) if quiet else self.stale(ino)) from None
        finally:
            del self._listing_flights[ino]
            flight[0].set()
        snap = Snapshot(ino, path, names, rows, self.numbers.inos(rows, devs), self.clock())
        # The kernel may have forgotten the directory while we listed it.
        if ino in self.table:
            self._adopt(snap)
        return snap

    def _scan_dir(self, path: bytes, st_ino: int) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        """_scan of a node's directory, which must still be that inode (it may have been
        renamed, and another directory made under its name): checked on the listed fd."""
        st, entries = self.source.paths.scandir_with_stat(path)
        if st.st_ino != st_ino:
            raise _Moved(path)
        return scan_rows(entries if path else [e for e in entries if e[0] != NAME])

    def _scan(self, path: bytes) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        """List `path` into snapshot columns (in a worker thread). The root's listing never
        shows a `.shadefs` of the source: that name is the control directory's."""
        entries = self.source.paths.scandir(path)
        if not path:
            entries = [e for e in entries if e[0] != NAME]
        return scan_rows(entries)

    def listing_of_file(self, ino: int) -> Snapshot | None:
        """The listing of the directory holding file `ino`, if it was listed whole; else
        None, and the directory is listed in the background so that a later call finds it
        (fs/relisting.py)."""
        try:
            snap, _ = self.locate(ino)
        except pyfuse3.FUSEError:
            return None
        if self.listings.get(snap.dirino) == snap.slot:
            return snap
        self.relisting.ask(snap.dirino)
        return None

    async def relist(self) -> None:
        """List the directories asked for (fs/relisting.py), one at a time; runs until
        cancelled (unmount)."""
        while True:
            ino = await self.relisting.next()
            listed = False
            try:
                # (Forgotten meanwhile: nothing to list. Listed meanwhile: done.)
                if ino in self.table and ino not in self.listings:
                    await self.listing(ino, quiet=True)
                    listed = True
            except pyfuse3.FUSEError as exc:
                log.debug("listing directory %d again failed: errno %d", ino, exc.errno)
            finally:
                self.relisting.done(ino, listed)

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
            if parent.partition(b"/")[0] == NAME:
                continue  # the control directory's, never the source's
            snap = fresh.get(parent)
            if snap is not None:
                names, rows, inos = snap.name_list(), snap.rows, snap.ino
            else:
                try:
                    names, rows, devs = await self.source.run(self._scan, parent)
                except pyfuse3.FUSEError as exc:
                    if exc.errno in GONE:
                        continue
                    raise
                inos = self.numbers.inos(rows, devs)
            out.fill(idxs, [splits[i][2] for i in idxs], names, rows, inos)
        return out

    def _fresh_listings(self) -> dict[bytes, Snapshot]:
        """The current snapshots younger than `revalidate`, by directory path."""
        now = self.clock()
        out = {}
        for slot in self.listings.values():
            snap = self._snaps[slot]
            if snap is not None and now - snap.stamp < self.revalidate:
                out[snap.path] = snap
        return out

    def attrs(self, ino: int, st: Stat | os.stat_result) -> pyfuse3.EntryAttributes:
        return records.attrs(ino, st, self.timeout)
