"""The inode <-> path table, stat snapshots and directory listings.

Inode numbers are derived from the source's own (st_dev, st_ino): an entry on the source
root's device gets `st_ino + INO_OFFSET`, anything else (a filesystem mounted inside the
source) gets a number from a separate counter that is remembered for the life of the mount.
So an inode keeps its number after the kernel forgets it and looks it up again, and the
table only holds what the kernel currently references: `forget` removes entries whose
lookup count drops to zero, and a million-file tree costs nothing until it is walked.

The tree is read-only: a directory is listed once (names plus lstat, in one worker thread)
and the snapshot answers readdir, lookup and negative lookup of its children without going
back to the source. Snapshots live as long as the kernel references their directory.

Revalidation: after `revalidate` seconds a snapshot is refreshed when it is next used, and a
file's signature is checked again when it is next opened (`fresh_stat`). When the source is
not answering, both fall back to what they have: a cached file keeps being served and `ls`
keeps working on the last snapshot, instead of hanging with the source.

The source never follows a symlink (see source.py). A path whose directory was swapped for a
symlink after it was looked up fails with ELOOP, which counts here as "gone", like ENOENT:
the refreshed parent listing shows the symlink as a symlink, and nothing is resolved through
it (`resolve` answers None, so control paths through it are refused).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from dataclasses import dataclass, field

import pyfuse3
import trio

from shadefs.cache.ssd_format import Signature
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


class Node:
    """A looked-up entry: its path relative to the source root and its stat snapshot."""

    __slots__ = ("path", "st", "lookups", "checked")

    def __init__(self, path: bytes, st: os.stat_result, lookups: int) -> None:
        self.path = path
        self.st = st
        self.lookups = lookups
        self.checked = time.monotonic()


@dataclass(slots=True)
class Listing:
    """A directory snapshot: sorted names and their lstat results."""

    names: list[bytes]
    stats: list[os.stat_result]
    index: dict[bytes, int] = field(default_factory=dict)
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.index = {name: i for i, name in enumerate(self.names)}


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
        self.nodes: dict[int, Node] = {ROOT_INODE: Node(b"", root_st, 1)}
        self.listings: dict[int, Listing] = {}
        self._foreign: dict[tuple[int, int], int] = {}
        self._listing_flights: dict[int, trio.Event] = {}

    def describe(self) -> NamespaceStats:
        return NamespaceStats(
            revalidations=self.revalidations,
            changed_files=self.changed_files,
            inodes_known=len(self.nodes),
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
        key = (st.st_dev, st.st_ino)
        known = self._foreign.get(key)
        if known is not None:
            return known
        ino = _FOREIGN_BASE + len(self._foreign)
        if ino > _MAX_INO:
            raise pyfuse3.FUSEError(errno.EOVERFLOW)
        self._foreign[key] = ino
        return ino

    # --- lookups ----------------------------------------------------------------------

    def node(self, ino: int) -> Node:
        try:
            return self.nodes[ino]
        except KeyError:
            # The kernel only asks about inodes it looked up; anything else is stale.
            raise pyfuse3.FUSEError(errno.ESTALE) from None

    async def lookup(self, parent: int, name: bytes) -> tuple[int, os.stat_result]:
        """Resolve `name` in `parent`, count one kernel reference and return (ino, st)."""
        pnode = self.node(parent)
        path = pnode.path + b"/" + name if pnode.path else name
        listing = self.listings.get(parent)
        if listing is not None:
            i = listing.index.get(name)
            if i is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            st = listing.stats[i]
        else:
            st = await self.source.lstat(path)
        ino = self.ino_of(st)
        self.remember(ino, path, st)
        return ino, st

    def remember(self, ino: int, path: bytes, st: os.stat_result) -> None:
        """Count one kernel reference to `ino` (from lookup or an accepted readdirplus entry)."""
        node = self.nodes.get(ino)
        if node is None:
            self.nodes[ino] = Node(path, st, 1)
        else:
            # Keep the node's own stat: it may be fresher than the listing (fresh_stat).
            node.lookups += 1
            if stat.S_IFMT(node.st.st_mode) != stat.S_IFMT(st.st_mode):
                # Unless the inode number was reused by an entry of another type (a file or
                # directory swapped for a symlink): the node describes something gone.
                node.path, node.st, node.checked = path, st, time.monotonic()
                self.listings.pop(ino, None)

    def forget(self, items: list[tuple[int, int]]) -> None:
        for ino, n in items:
            node = self.nodes.get(ino)
            if node is None or ino == ROOT_INODE:
                continue
            node.lookups -= n
            if node.lookups <= 0:
                del self.nodes[ino]
                self.listings.pop(ino, None)

    # --- directories ------------------------------------------------------------------

    async def listing(self, ino: int) -> Listing:
        """The directory's snapshot, listing the source once even under concurrent opens.

        A snapshot older than `revalidate` is refreshed; if the source does not answer, the
        old snapshot is served (and a known outage skips the attempt altogether).
        """
        old = self.listings.get(ino)
        if old is not None:
            if time.monotonic() - old.stamp < self.revalidate or not self.source.healthy:
                return old
            try:
                return await self._list(ino)
            except pyfuse3.FUSEError as exc:
                if exc.errno in _GONE:
                    raise
                return old
        return await self._list(ino)

    async def _list(self, ino: int) -> Listing:
        while True:
            flight = self._listing_flights.get(ino)
            if flight is None:
                break
            await flight.wait()
            listing = self.listings.get(ino)
            if listing is not None and time.monotonic() - listing.stamp < self.revalidate:
                return listing
        node = self.node(ino)
        if not stat.S_ISDIR(node.st.st_mode):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        flight = self._listing_flights[ino] = trio.Event()
        try:
            entries = await self.source.listdir(node.path)
        finally:
            del self._listing_flights[ino]
            flight.set()
        listing = Listing([e[0] for e in entries], [e[1] for e in entries])
        # The kernel may have forgotten the directory while we listed it.
        if ino in self.nodes:
            self.listings[ino] = listing
        return listing

    async def fresh_stat(self, ino: int) -> tuple[os.stat_result, bool]:
        """The file's stat, checked against the source if `revalidate` has passed.

        Returns (stat, changed). A file that vanished raises ENOENT; a source that does not
        answer leaves the old stat in place (its cached bytes stay servable).
        """
        node = self.node(ino)
        now = time.monotonic()
        if now - node.checked < self.revalidate or not self.source.healthy:
            return node.st, False
        try:
            st = await self.source.lstat(node.path)
        except pyfuse3.FUSEError as exc:
            if exc.errno in _GONE:
                raise
            return node.st, False
        self.revalidations += 1
        node.checked = now
        old = node.st
        changed = Signature.of(st) != Signature.of(old)
        if changed:
            self.changed_files += 1
            log.info("%r changed on the source: refetching", node.path)
            node.st = st
        return node.st, changed

    def attrs(self, ino: int, st: os.stat_result) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.generation = 0
        a.entry_timeout = self.timeout
        a.attr_timeout = self.timeout
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

    # --- resolving paths that the kernel has not looked up ------------------------------

    async def resolve(self, paths: list[bytes]) -> list[os.stat_result | None]:
        """lstat of many relative paths, listing each parent directory once.

        Used for the sampler's file list and the residency queries: a million paths in a
        thousand class directories cost a thousand source listings, not a million lstats.
        A path that does not exist, or whose parent is not a directory or is reached through
        a symlink, gives None.
        """
        by_dir: dict[bytes, list[int]] = {}
        for i, p in enumerate(paths):
            parent, _, _ = p.rpartition(b"/")
            by_dir.setdefault(parent, []).append(i)
        out: list[os.stat_result | None] = [None] * len(paths)
        for parent, idxs in by_dir.items():
            try:
                entries = dict(await self.source.listdir(parent))
            except pyfuse3.FUSEError as exc:
                if exc.errno in _GONE:
                    continue
                raise
            for i in idxs:
                out[i] = entries.get(paths[i].rpartition(b"/")[2])
        return out
