"""Extended attributes without a thread hop per file where a directory has none.

`ls -l` asks for two or three attributes of every file it lists (security.selinux, the
POSIX ACLs), and on most datasets no file has any. Each request went to the source in a
worker thread, so listing a 200-file directory cost some 500 thread hops. Here the first
request for an entry lists the attribute names of its whole block of a directory snapshot
(up to `BLOCK` neighbours, one hop); the answer is kept as one int8 per row, and later
requests for entries with no attributes are answered at once while the snapshot is fresh
(younger than the namespace's `revalidate`, the same promise as its sizes and times).
Entries that do have attributes, and stale or unknown ones, go to the source as before.
"""

from __future__ import annotations

import errno

import numpy as np
import pyfuse3

from shadefs.fs.namespace import Namespace
from shadefs.source.part import Source

BLOCK = 256
_UNKNOWN, _NONE = -1, 0


class Xattrs:
    """getxattr/listxattr for the mirror, with the per-snapshot "has none" flags."""

    def __init__(self, ns: Namespace, source: Source) -> None:
        self.ns = ns
        self.source = source

    async def get(self, ino: int, name: bytes) -> bytes:
        if await self._none(ino):
            raise pyfuse3.FUSEError(errno.ENODATA)
        return await self.source.getxattr(self.ns.path(ino), name)

    async def names(self, ino: int) -> list[bytes]:
        if await self._none(ino):
            return []
        return await self.source.listxattr(self.ns.path(ino))

    async def _none(self, ino: int) -> bool:
        """Whether `ino` is known to have no attributes (learning its block if need be)."""
        snap, i = self.ns.locate(ino)
        if snap.dirino == 0 or self.ns.clock() - snap.stamp >= self.ns.revalidate:
            return False  # the root's own entry, or a listing due for a refresh
        flags = snap.xattrs
        if flags is None:
            flags = snap.xattrs = np.full(len(snap), _UNKNOWN, dtype=np.int8)
        if flags[i] == _UNKNOWN:
            lo = i - i % BLOCK
            hi = min(lo + BLOCK, len(snap))
            names = [snap.name(j) for j in range(lo, hi)]
            flags[lo:hi] = await self.source.run(self.source.paths.xattr_presence, snap.path, names)
        return bool(flags[i] == _NONE)
