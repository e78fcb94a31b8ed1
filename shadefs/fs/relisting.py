"""Directories listed again in the background when the kernel looks their names up one by
one (mixed into the namespace).

The namespace answers a lookup from its listing of the parent. Without one, each name costs
its own lstat in a worker thread, a thread hop per file (~0.3 ms of the daemon's CPU on a
2-core VM). That is every lookup after the kernel forgot a listed directory (`drop_caches`,
or memory pressure on a training node: the listing goes with the directory's inode) until
someone lists it again, which nobody did once the readers knew every file. So the first such
lookup in a directory that had a listing asks for one, made by `relist` in the background,
one directory at a time; the lookups meanwhile go on by lstat, the ones after it are
answered from the listing (a quiet one: a name it lacks is still asked of the source, see
`Namespace.lookup`). A directory never listed is left as it was (each name asked of the
source): listing it would keep its names for `revalidate`, a change of what it answers.
A quiet listing that finds the directory moved leaves the kernel's entries alone
(`Namespace._list`): the kernel's own lookups find that out, and retry once.

The readers part asks for the listing of a file's directory too (`listing_of_file`): a job
that opens files by path never lists them, and its universe is the directories it reads
(readers/tracker.py). Such a directory is listed quietly, once, by the same task.
"""

from __future__ import annotations

import logging

import pyfuse3
import trio

from shadefs.fs.snapshots import InodeTable, Snapshot

log = logging.getLogger(__name__)


class Relisting:
    """The namespace's background listings; it supplies the attributes and `listing`."""

    listings: dict[int, int]
    table: InodeTable

    async def listing(self, ino: int, *, quiet: bool = False) -> Snapshot:
        raise NotImplementedError

    def locate(self, ino: int) -> tuple[Snapshot, int]:
        raise NotImplementedError

    def _init_relisting(self) -> None:
        # Directories to list, in the order asked: whether their listing was lost (else the
        # readers part asked).
        self._relist: dict[int, bool] = {}
        # Directories whose listing went (with their inode, or moved): only these are listed
        # again. One never listed keeps its lookups by name, each asked of the source.
        self._lost: set[int] = set()
        self._relist_wake = trio.Event()
        #: directories listed because their names were looked up one by one
        self.relisted = 0

    def _lost_listing(self, ino: int) -> None:
        """Directory `ino`'s listing was dropped."""
        self._lost.add(ino)

    def _want_listing(self, ino: int) -> None:
        """A name of directory `ino` was looked up without a listing: list it soon if it
        had one."""
        if ino in self._lost and ino not in self._relist:
            self._relist[ino] = True
            self._relist_wake.set()

    def listing_of_file(self, ino: int) -> Snapshot | None:
        """The listing of the directory holding file `ino`, if it was listed whole; else
        None, and the directory is listed in the background so that a later call finds it."""
        try:
            snap, _ = self.locate(ino)
        except pyfuse3.FUSEError:
            return None
        if self.listings.get(snap.dirino) == snap.slot:
            return snap
        if snap.dirino not in self._relist:
            self._relist[snap.dirino] = False
            self._relist_wake.set()
        return None

    async def relist(self) -> None:
        """List the directories asked for, one at a time; runs until cancelled (unmount)."""
        while True:
            await self._relist_wake.wait()
            self._relist_wake = trio.Event()
            while self._relist:
                ino = next(iter(self._relist))
                try:
                    # (Forgotten meanwhile: nothing to list. Listed meanwhile: done.)
                    if ino in self.table and ino not in self.listings:
                        await self.listing(ino, quiet=True)
                        self.relisted += self._relist[ino]
                except pyfuse3.FUSEError as exc:
                    log.debug("listing directory %d again failed: errno %d", ino, exc.errno)
                finally:
                    # Asked again while it was listed: the listing covers that lookup too.
                    del self._relist[ino]
