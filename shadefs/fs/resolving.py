"""`resolve`: inode, size and mode of many paths the kernel has not looked up, for the
sampler's file list and the residency queries (mixed into the namespace)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pyfuse3

from shadefs.control.entries import NAME
from shadefs.fs import records
from shadefs.fs.records import Resolved
from shadefs.fs.revalidate import GONE
from shadefs.fs.snapshots import Snapshot
from shadefs.source.part import Source


class Resolving:
    """The namespace's `resolve`; it supplies the attributes and the two methods below."""

    source: Source
    revalidate: float
    clock: Callable[[], float]
    listings: dict[int, int]
    _snaps: list[Snapshot | None]

    def _scan(self, path: bytes) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        raise NotImplementedError

    def _inos(self, rows: np.ndarray, devs: np.ndarray) -> np.ndarray:
        raise NotImplementedError

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
                inos = self._inos(rows, devs)
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
