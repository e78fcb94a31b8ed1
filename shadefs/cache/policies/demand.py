"""Per-job reads of the resident entries: per-job epochs and remaining demand, in numpy.

Several jobs read one cache (a sweep). For every key read and every job the cache has
told about, `JobReads` keeps the epoch in which that job last read it, in one int64 matrix
`last[job row, slot]`: keys map to dense slots, job rows are the cache's job ids.
Relative to job j's epoch e_j an entry is

- *consumed* by j (last == e_j): j read it this epoch, its next read is in the next one;
- *wanted* by j (last == e_j - 1): j will read it this epoch; an entry that becomes
  resident starts wanted by every job but the ones that just read it;
- *stale* for j (last < e_j - 1): j went a whole epoch without reading it.

The remaining demand of an entry is the number of active jobs that want it. Two columns
count, per slot, the active jobs that want it (`want`) and that consumed it (`done`); a
read moves one slot's counts (O(1)), and only a job's new epoch, a job joining or leaving
recounts them (vectorised, O(jobs x slots), once per epoch). Resident entries sit in
buckets by rank, so an admission walks its victims only (O(victims)), never every key.

Epochs are per job: job j's epoch is inferred to advance when j reads a file it already
read in its current epoch (the rule the single-job `epoch` policy applies globally to
resident files), or announced. So one job's read of a file that another job read never looks
like a new epoch. The members of a sweep group read known orders: what those still read
is kept by the pending reads (sampling/pending.py), not inferred here.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# Arrays grow by doubling.
_GROW = 2


class JobReads:
    """The `last[row, slot]` matrix, the slots of the keys, the per-job epochs and the
    per-slot demand counts.

    A key keeps its slot after eviction, so that what each job read of it is still known
    when another job's miss brings it back: otherwise a file that three of four jobs have
    read would come back as wanted by all of them. The slots are dense numpy columns; the
    per-key Python structures are the `slot_of` dict and the rank buckets of live slots.
    """

    def __init__(self) -> None:
        self.slot_of: dict[int, int] = {}
        self._n = 0  # slots handed out so far
        self.sizes = np.zeros(64, dtype=np.int64)
        self.live = np.zeros(64, dtype=bool)
        self.keys = np.zeros(64, dtype=np.int64)
        self.want = np.zeros(64, dtype=np.int32)  # active jobs that want the slot
        self.done = np.zeros(64, dtype=np.int32)  # active jobs that consumed it
        self._rank = np.full(64, -1, dtype=np.int64)  # a live slot's bucket, -1 if none
        self.last = np.zeros((1, 64), dtype=np.int64)
        self.epoch = np.zeros(1, dtype=np.int64)
        self.explicit = np.zeros(1, dtype=bool)
        self.active: dict[int, None] = {}  # rows of the jobs that read, in arrival order
        self._buckets: dict[int, dict[int, None]] = {}  # rank -> live slots, oldest first

    # --- jobs ---------------------------------------------------------------------------

    def _grow_rows(self, row: int) -> None:
        rows = max(row + 1, len(self.epoch) * _GROW)
        old = len(self.epoch)
        new = np.zeros((rows, self.last.shape[1]), dtype=np.int64)
        new[:old] = self.last
        self.last = new
        for name in ("epoch", "explicit"):
            arr = getattr(self, name)
            setattr(self, name, np.concatenate([arr, np.zeros(rows - old, arr.dtype)]))

    def join(self, row: int, recount: bool = True) -> None:
        """Job `row` starts: epoch 0, and it wants every resident entry (the counts follow
        unless the caller recounts them itself)."""
        if row >= len(self.epoch):
            self._grow_rows(row)
        self.epoch[row] = 0
        self.explicit[row] = False
        self.last[row, : self._n] = -1
        self.active[row] = None
        if recount:
            self.recount()

    def leave(self, row: int) -> None:
        """Job `row` is over: it wants nothing any more (its row may be reused)."""
        if self.active.pop(row, 0) is None:
            self.recount()

    def recount(self) -> None:
        """Count `want` and `done` afresh from `last` and the epochs (after a job's new
        epoch, a job joining or leaving, or a row set in bulk), and re-bucket."""
        n = self._n
        rows = np.fromiter(self.active, dtype=np.int64, count=len(self.active))
        last = self.last[rows, :n]
        e = self.epoch[rows][:, None]
        self.want[:n] = (last == e - 1).sum(axis=0)
        self.done[:n] = (last >= e).sum(axis=0)
        self._buckets = {}
        self._rank[:n] = -1
        live = np.flatnonzero(self.live[:n])
        rank = self.want[live].astype(np.int64) * (len(rows) + 1) + self.done[live]
        self._rank[live] = rank
        # One dict per distinct rank (a handful), filled at C speed.
        for r in np.unique(rank).tolist():
            self._buckets[r] = dict.fromkeys(live[rank == r].tolist())

    # --- entries ------------------------------------------------------------------------

    def _grow_slots(self) -> None:
        cap = len(self.sizes) * _GROW
        for name in ("sizes", "keys", "live", "want", "done", "_rank"):
            old = getattr(self, name)
            new = np.full(cap, -1 if name == "_rank" else 0, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)
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
            self.want[slot] = len(self.active)
            self.done[slot] = 0
        return slot

    def _rank_of(self, slot: int) -> int:
        return int(self.want[slot]) * (len(self.active) + 1) + int(self.done[slot])

    def _place(self, slot: int) -> None:
        """Put live `slot` in the bucket of its rank now."""
        r = self._rank_of(slot)
        old = int(self._rank[slot])
        if old == r:
            return
        if old >= 0:
            self._unbucket(slot, old)
        bucket = self._buckets.get(r)
        if bucket is None:
            bucket = self._buckets[r] = {}
        bucket[slot] = None
        self._rank[slot] = r

    def _unbucket(self, slot: int, rank: int) -> None:
        bucket = self._buckets[rank]
        del bucket[slot]
        if not bucket:
            del self._buckets[rank]
        self._rank[slot] = -1

    def add(self, key: int, size: int) -> None:
        """`key` became resident (what each job read of it before still counts)."""
        slot = self._slot(key)
        self.sizes[slot] = size
        self.live[slot] = True
        self._place(slot)

    def remove(self, key: int) -> None:
        slot = self.slot_of.get(key)
        if slot is not None and self.live[slot]:
            self.live[slot] = False
            self._unbucket(slot, int(self._rank[slot]))

    def read(self, key: int, row: int, infer: bool = True) -> bool:
        """Job `row` read `key` (a hit or a miss); True when that starts a new epoch of the
        job (it read `key` already in its current epoch, and `infer`)."""
        slot = self._slot(key)
        e = int(self.epoch[row])
        last = int(self.last[row, slot])
        if last >= e:
            if infer and not self.explicit[row]:
                self.epoch[row] = e + 1
                self.last[row, slot] = e + 1
                self.recount()
                return True
            return False  # a replay within the epoch
        if row in self.active:
            if last == e - 1:
                self.want[slot] -= 1
            self.done[slot] += 1
        self.last[row, slot] = e
        if self.live[slot]:
            self._place(slot)
        return False

    def announce(self, row: int, epoch: int) -> None:
        self.explicit[row] = True
        if epoch > self.epoch[row]:
            self.epoch[row] = epoch
            self.recount()

    # --- demand -------------------------------------------------------------------------

    def rank_of(self, key: int) -> int:
        """The rank of `key` now (a miss about to be admitted): lower ranks go first.

        The rank orders by remaining demand (jobs that want the entry), then by how many
        jobs consumed it (they read it again next epoch); stale for everyone is lowest.
        """
        return self._rank_of(self._slot(key))

    def victims(
        self,
        need: int,
        below: int | None,
        kept: Callable[[int], bool] | None = None,
    ) -> list[int] | None:
        """Keys to evict, lowest rank first, that free `need` bytes; only ranks < `below`
        when given (None if they do not free enough); everything there is when shrinking.
        With `kept(key)`, the keys it holds are never victims (pending reads)."""
        if need <= 0:
            return []
        victims: list[int] = []
        for r in sorted(self._buckets):
            if below is not None and r >= below:
                break
            for slot in self._buckets[r]:
                key = int(self.keys[slot])
                if kept is not None and kept(key):
                    continue
                victims.append(key)
                need -= int(self.sizes[slot])
                if need <= 0:
                    return victims
        return None if below is not None or kept is not None else victims

    def demand(self, key: int) -> int:
        """How many active jobs still want `key` this epoch (0 if never seen)."""
        slot = self.slot_of.get(key)
        return 0 if slot is None else int(self.want[slot])
