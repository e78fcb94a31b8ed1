"""Many hits of one job taken in at once, in numpy (mixed into the tracker).

`Tracker.read` takes one open in with a handful of scalar updates of per-file columns; in
the daemon each of them meets its cache line cold, since the readers and the kernel ran
between two requests (~2 us a read). The cache logs its warm hits and takes them in by the
batch (cache/hits.py); a batch that nothing special happens in is taken in here with one
numpy gather and scatter per column, which is what `read` one by one would have done.
"""

from __future__ import annotations

from array import array

import numpy as np

SETTLE_MAX = 1 << 16  # the most first reads waiting for their directory's listing
# A log shorter than this is taken in one by one (numpy's per-call cost would exceed it).
BATCH_MIN = 8


class BatchReads:
    """`read_many` over the tracker's columns; the tracker supplies the attributes."""

    active: dict[int, None]
    epoch: list[int]
    count: list[int]
    size: list[int]
    last: np.ndarray
    universe: np.ndarray
    want: np.ndarray
    done: np.ndarray
    ranks: int
    read_key: int
    _prev: list[int]
    _unsettled: array[int]

    def read_many(self, keys: list[int], row: int, ids: list[int]) -> np.ndarray | None:
        """`read(keys[k], row, ids[k])` for k in order, in numpy, if the batch is plain:
        the job is active, every id known and distinct, the first key not the job's latest
        open (a reopen), and no file read by the job this epoch already (a re-read may
        begin its next epoch or break it: `read`'s rule, one by one). Returns each id's
        rank after the batch (no id's rank moves but by its own read); None: nothing was
        done, the caller reads one by one."""
        if row not in self.active or self._prev[row] == keys[0] or min(ids) < 0:
            return None
        if len(set(ids)) != len(ids):
            return None
        idx = np.array(ids, dtype=np.int64)
        e = self.epoch[row]
        last = self.last[row]
        was = last[idx]
        if was.max() >= e:
            return None
        universe = self.universe[row]
        new = ~universe[idx]
        if new.any():  # first reads: the files join the job's universe (`read`)
            universe[idx] = True
            self.size[row] += int(new.sum())
            for key in np.asarray(keys, dtype=np.int64)[new].tolist():
                if key >= 0 and len(self._unsettled) < SETTLE_MAX:
                    self._unsettled.extend((row, key))  # its directory may join later
        want = self.want[idx]
        want -= was == e - 1
        self.want[idx] = want
        done = self.done[idx] + 1
        self.done[idx] = done
        last[idx] = e
        self.count[row] += len(ids)
        self._prev[row] = keys[-1]
        self.read_key = -1  # (the policies are told by the batch's ranks)
        ranks: np.ndarray = want.astype(np.int64) * self.ranks + done
        return ranks
