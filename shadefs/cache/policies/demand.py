"""Per-job reads of the resident entries: per-job epochs and remaining demand, in numpy.

Several jobs read one cache (a sweep). For every key read and every job the cache has
told about, `JobReads` keeps the epoch in which that job last read it, in one int64 matrix
`last[job row, slot]`: keys map to dense slots, job rows are the cache's job ids.
Relative to job j's epoch e_j an entry is

- *consumed* by j (last == e_j): j read it this epoch, its next read is in the next one;
- *wanted* by j (last == e_j - 1): j will read it this epoch; an entry that becomes
  resident starts wanted by every job but the ones that just read it;
- *stale* for j (last < e_j - 1): j went a whole epoch without reading it.

The remaining demand of an entry is the number of active jobs that want it. "Job j read it
this epoch" is one comparison, and a new epoch costs nothing (only e_j moves).

Epochs are per job: job j's epoch is inferred to advance when j reads a file it already
read in its current epoch (the rule the single-job `epoch` policy applies globally to
resident files), or announced. So one job's read of a file that another job read never looks
like a new epoch.
"""

from __future__ import annotations

import numpy as np

# Arrays grow by doubling.
_GROW = 2


class JobReads:
    """The `last[row, slot]` matrix, the slots of the keys and the per-job epochs.

    A key keeps its slot after eviction, so that what each job read of it is still known
    when another job's miss brings it back: otherwise a file that three of four jobs have
    read would come back as wanted by all of them. The slots are dense numpy columns; the
    one per-key Python structure is the `slot_of` dict.
    """

    def __init__(self) -> None:
        self.slot_of: dict[int, int] = {}
        self._free: list[int] = []
        self._n = 0  # slots handed out so far (live or free)
        self.sizes = np.zeros(64, dtype=np.int64)
        self.live = np.zeros(64, dtype=bool)
        self.keys = np.zeros(64, dtype=np.int64)
        self.last = np.zeros((1, 64), dtype=np.int64)
        self.epoch = np.zeros(1, dtype=np.int64)
        self.explicit = np.zeros(1, dtype=bool)
        self.active: dict[int, None] = {}  # rows of the jobs that read, in arrival order

    # --- jobs ---------------------------------------------------------------------------

    def _grow_rows(self, row: int) -> None:
        rows = max(row + 1, len(self.epoch) * _GROW)
        last = np.zeros((rows, self.last.shape[1]), dtype=np.int64)
        last[: len(self.epoch)] = self.last
        self.last = last
        self.epoch = np.concatenate([self.epoch, np.zeros(rows - len(self.epoch), np.int64)])
        self.explicit = np.concatenate([self.explicit, np.zeros(rows - len(self.explicit), bool)])

    def join(self, row: int) -> None:
        """Job `row` starts: epoch 0, and it wants every resident entry."""
        if row >= len(self.epoch):
            self._grow_rows(row)
        self.epoch[row] = 0
        self.explicit[row] = False
        self.last[row, : self._n] = -1
        self.active[row] = None

    def leave(self, row: int) -> None:
        """Job `row` is over: it wants nothing any more (its row may be reused)."""
        self.active.pop(row, None)

    # --- entries ------------------------------------------------------------------------

    def _grow_slots(self) -> None:
        cap = len(self.sizes) * _GROW
        for name in ("sizes", "keys"):
            old = getattr(self, name)
            new = np.zeros(cap, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)
        live = np.zeros(cap, dtype=bool)
        live[: len(self.live)] = self.live
        self.live = live
        last = np.zeros((self.last.shape[0], cap), dtype=np.int64)
        last[:, : self.last.shape[1]] = self.last
        self.last = last

    def _slot(self, key: int) -> int:
        """The slot of `key`, made on first sight: wanted by every job."""
        slot = self.slot_of.get(key)
        if slot is None:
            slot = self._n
            if slot == len(self.sizes):
                self._grow_slots()
            self._n += 1
            self.slot_of[key] = slot
            self.keys[slot] = key
            self.last[:, slot] = self.epoch - 1
        return slot

    def add(self, key: int, size: int) -> None:
        """`key` became resident (what each job read of it before still counts)."""
        slot = self._slot(key)
        self.sizes[slot] = size
        self.live[slot] = True

    def remove(self, key: int) -> None:
        slot = self.slot_of.get(key)
        if slot is not None:
            self.live[slot] = False

    def read(self, key: int, row: int, infer: bool = True) -> bool:
        """Job `row` read `key` (a hit or a miss); True when that starts a new epoch of the
        job (it read `key` already in its current epoch, and `infer`)."""
        slot = self._slot(key)
        e = int(self.epoch[row])
        new = False
        if infer and int(self.last[row, slot]) == e and not self.explicit[row]:
            e += 1
            self.epoch[row] = e
            new = True
        self.last[row, slot] = e
        return new

    def announce(self, row: int, epoch: int) -> None:
        self.explicit[row] = True
        if epoch > self.epoch[row]:
            self.epoch[row] = epoch

    # --- demand -------------------------------------------------------------------------

    def ranks(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(rank of every slot, live slots, jobs): lower ranks go first.

        The rank orders by remaining demand (jobs that want the entry), then by how many
        jobs consumed it (they read it again next epoch); stale for everyone is lowest.
        """
        rows = np.fromiter(self.active, dtype=np.int64, count=len(self.active))
        n = self._n
        last = self.last[rows, :n]
        e = self.epoch[rows][:, None]
        wanted = (last == e - 1).sum(axis=0)
        consumed = (last >= e).sum(axis=0)
        jobs = len(rows)
        return wanted * (jobs + 1) + consumed, self.live[:n], jobs

    def rank_of(self, key: int) -> int:
        """The rank of `key` now (a miss about to be admitted)."""
        rows = np.fromiter(self.active, dtype=np.int64, count=len(self.active))
        last = self.last[rows, self._slot(key)]
        e = self.epoch[rows]
        return int((last == e - 1).sum()) * (len(rows) + 1) + int((last >= e).sum())

    def victims(self, need: int, below: int | None) -> list[int] | None:
        """Keys to evict, lowest rank first, that free `need` bytes; only ranks < `below`
        when given (None if they do not free enough); everything there is when shrinking."""
        if need <= 0:
            return []
        rank, live, _ = self.ranks()
        ok = live if below is None else live & (rank < below)
        cand = np.flatnonzero(ok)
        cand = cand[np.argsort(rank[cand], kind="stable")]
        total = np.cumsum(self.sizes[cand])
        k = int(np.searchsorted(total, need))
        if k >= len(cand):
            if below is not None:
                return None
            return [int(x) for x in self.keys[cand]]
        return [int(x) for x in self.keys[cand[: k + 1]]]

    def demand(self, key: int) -> int:
        """How many active jobs still want resident `key` this epoch (0 if not resident)."""
        slot = self.slot_of.get(key)
        if slot is None:
            return 0
        rows = list(self.active)
        return int((self.last[rows, slot] == self.epoch[rows] - 1).sum())
