"""What an open reads of a node, kept for its next open (mixed into the namespace).

Every open of a regular file asks the namespace for the node's stat, its path and the time
of its last signature check (`opening`): a table lookup, a row unpacked and a path joined,
some 3 µs at 20,000 files. Two records spare a reopen that work. Both are dropped together
(`_changed`) whenever the node's row, stat, path or check time changes or the kernel
forgets it, so what either holds is still true of the node:

- `_opened`: the stat and path of the files opened last, at most `OPENED_KEPT` (cleared as
  a whole when full: a dataset larger than that rebuilds them at most opens).
- the cache's record, per node, of the RAM entry that an open found to be the node's
  version by its current path (cache/face.py, `verify`): a reopen that finds one before
  the check is due is a hit without the namespace. The cache keeps it (and drops it with
  its entry); the namespace tells it of each change (`on_change`, the cache's `unverify`).

`changes` counts the drops: an open that awaited (a fetch, a check at the source) records
what it verified only if no node changed meanwhile.
"""

from __future__ import annotations

import errno
from collections.abc import Callable

import pyfuse3

from shadefs.fs.snapshots import InodeTable, Snapshot, Stat

OPENED_KEPT = 4096


def _nothing(ino: int) -> None:
    pass


_ROW = 0xFFFFFFFF


class OpenRecords:
    """The records, mixed into the namespace (which has `table` and `_snaps`)."""

    table: InodeTable
    _snaps: list[Snapshot | None]

    def _init_records(self) -> None:
        self._opened: dict[int, tuple[Stat, bytes, Snapshot, int]] = {}
        # Told of each change: the cache's `unverify` (fs/operations.py sets it).
        self.on_change: Callable[[int], None] = _nothing
        self.changes = 0

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
