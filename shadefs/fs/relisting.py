"""Directories to list again in the background, because the kernel looks their names up one
by one: which ones, in what order, and how many were listed.

The namespace answers a lookup from its listing of the parent. Without one, each name costs
its own lstat in a worker thread, a thread hop per file (docs/developer-notes.md, "A
directory the kernel forgot is listed again", has its cost). That is every lookup after the
kernel forgot a listed directory (`drop_caches`, or memory pressure on a training node: the
listing goes with the directory's inode) until someone lists it again, which nobody did
once the readers knew every file. So the first such
lookup in a directory that had a listing asks for one (`looked_up`), made by the namespace's
`relist` task in the background, one directory at a time; the lookups meanwhile go on by
lstat, the ones after it are answered from the listing (a quiet one: a name it lacks is still
asked of the source, see `Namespace.lookup`). A directory never listed is left as it was
(each name asked of the source): listing it would keep its names for `revalidate`, a change
of what it answers. A quiet listing that finds the directory moved leaves the kernel's
entries alone (`Namespace._list`): the kernel's own lookups find that out, and retry once.

The readers part asks for the listing of a file's directory too (`Namespace.listing_of_file`,
here `ask`): a job that opens files by path never lists them, and its universe is the
directories it reads (readers/tracker.py). Such a directory is listed quietly, once, by the
same task.

A part the namespace owns: it holds the requests and never lists, nor reads the namespace's
table; the namespace's task takes them one at a time (`next`, `done`).
"""

from __future__ import annotations

import trio


class RelistQueue:
    """The directories to list again, in the order asked; `relisted` counts those listed
    because their names were looked up one by one."""

    def __init__(self) -> None:
        # Directories to list, in the order asked: whether their listing was lost (else the
        # readers part asked).
        self._asked: dict[int, bool] = {}
        # Directories whose listing went (with their inode, or moved): only these are listed
        # again. One never listed keeps its lookups by name, each asked of the source.
        self._lost: set[int] = set()
        self._wake = trio.Event()
        #: directories listed because their names were looked up one by one
        self.relisted = 0

    def lost(self, ino: int) -> None:
        """Directory `ino`'s listing was dropped."""
        self._lost.add(ino)

    def looked_up(self, ino: int) -> None:
        """A name of directory `ino` was looked up without a listing: list it soon if it
        had one."""
        if ino in self._lost and ino not in self._asked:
            self._asked[ino] = True
            self._wake.set()

    def ask(self, ino: int) -> None:
        """List directory `ino` soon (the readers part wants its files' names)."""
        if ino not in self._asked:
            self._asked[ino] = False
            self._wake.set()

    async def next(self) -> int:
        """The directory asked for first, once there is one. It stays asked for until
        `done`: asked again while it is listed, the listing covers that lookup too."""
        while not self._asked:
            await self._wake.wait()
            self._wake = trio.Event()
        return next(iter(self._asked))

    def done(self, ino: int, listed: bool) -> None:
        """Directory `ino` was taken care of: `listed` (else it was forgotten, listed
        meanwhile, or its listing failed)."""
        self.relisted += listed and self._asked[ino]
        del self._asked[ino]
