"""What an open reads of a node, kept for its next open (mixed into the namespace).

Every open of a regular file asks the namespace for the node's stat, its path and the time
of its last signature check (`opening`): a table lookup, a row unpacked and a path joined,
some 3 µs at 20,000 files. Two records spare a reopen that work. Both are dropped together
(`_changed`) whenever the node's row, stat, path or check time changes or the kernel
forgets it, so what either holds is still true of the node:

- `_opened`: the stat and path of the files opened last, at most `OPENED_KEPT` (cleared as
  a whole when full: a dataset larger than that rebuilds them at most opens).
- `verified`: per node, the RAM entry that an open found to be the node's version by its
  current path, and the row's check time then (operations.py, `_verify`). A reopen that
  finds one before the check is due is a hit without the namespace: one dict lookup. The
  dict is the cache's `reopens` (the RAM tier drops a record with its entry), so it holds
  a small tuple per resident file at most.

`changes` counts the drops: an open that awaited (a fetch, a check at the source) records
what it verified only if no node changed meanwhile.
"""

from __future__ import annotations

import errno
from typing import Any

import pyfuse3

from shadefs.fs.snapshots import InodeTable, Snapshot, Stat

OPENED_KEPT = 4096
_ROW = 0xFFFFFFFF


class OpenRecords:
    """The records, mixed into the namespace (which has `table` and `_snaps`)."""

    table: InodeTable
    _snaps: list[Snapshot | None]

    def _init_records(self) -> None:
        self._opened: dict[int, tuple[Stat, bytes, Snapshot, int]] = {}
        # (the data path shares the cache's here: operations.py; entries are its business)
        self.verified: dict[int, Any] = {}
        self.changes = 0

    def _changed(self, ino: int) -> None:
        """Node `ino`'s row, stat, path or check time changed, or the kernel forgot it."""
        self._opened.pop(ino, None)
        self.verified.pop(ino, None)
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
