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

from collections.abc import Callable

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

    def __init__(self, planned: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        """`planned(keys)`: which keys a known order (a group's plan) reads from here on."""
        self.planned = planned
        self.slot_of: dict[int, int] = {}
        self._free: list[int] = []
        self._n = 0  # slots handed out so far (live or free)
        self.sizes = np.zeros(64, dtype=np.int64)
        self.live = np.zeros(64, dtype=bool)
        self.keys = np.zeros(64, dtype=np.int64)
        self.last = np.zeros((1, 64), dtype=np.int64)
        self.count = np.zeros((1, 64), dtype=np.int32)  # reads in the epoch `last` names
        self.epoch = np.zeros(1, dtype=np.int64)
        self.explicit = np.zeros(1, dtype=bool)
        self.group = np.zeros(1, dtype=np.int64)  # a sweep group's id, 0 for none
        self._group_ids: dict[str, int] = {}
        self.active: dict[int, None] = {}  # rows of the jobs that read, in arrival order

    # --- jobs ---------------------------------------------------------------------------

    def _grow_rows(self, row: int) -> None:
        rows = max(row + 1, len(self.epoch) * _GROW)
        old = len(self.epoch)
        for name in ("last", "count"):
            arr = getattr(self, name)
            new = np.zeros((rows, arr.shape[1]), dtype=arr.dtype)
            new[:old] = arr
            setattr(self, name, new)
        for name in ("epoch", "explicit", "group"):
            arr = getattr(self, name)
            setattr(self, name, np.concatenate([arr, np.zeros(rows - old, arr.dtype)]))

    def join(self, row: int) -> None:
        """Job `row` starts: epoch 0, and it wants every resident entry."""
        if row >= len(self.epoch):
            self._grow_rows(row)
        self.epoch[row] = 0
        self.explicit[row] = False
        self.last[row, : self._n] = -1
        self.count[row, : self._n] = 0
        self.active[row] = None

    def leave(self, row: int) -> None:
        """Job `row` is over: it wants nothing any more (its row may be reused)."""
        self.active.pop(row, None)
        if row < len(self.group):
            self.group[row] = 0

    def set_group(self, row: int, group: str) -> None:
        """Job `row` belongs to sweep group `group` ("" for none): see `_wanted`."""
        if row >= len(self.epoch):
            self._grow_rows(row)
        self.group[row] = (
            self._group_ids.setdefault(group, len(self._group_ids) + 1) if group else 0
        )

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
        for name in ("last", "count"):
            arr = getattr(self, name)
            new = np.zeros((arr.shape[0], cap), dtype=arr.dtype)
            new[:, : arr.shape[1]] = arr
            setattr(self, name, new)

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
            self.count[:, slot] = 0
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
        if int(self.last[row, slot]) == e:
            if infer and not self.explicit[row]:
                e += 1
                self.epoch[row] = e
                new = True
                self.count[row, slot] = 1
            else:
                self.count[row, slot] += 1  # a replay within the epoch
        else:
            self.count[row, slot] = 1
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
        n = self._n
        rank, jobs = self._ranks(np.arange(n))
        return rank, self.live[:n], jobs

    def rank_of(self, key: int) -> int:
        """The rank of `key` now (a miss about to be admitted)."""
        rank, _ = self._ranks(np.array([self._slot(key)]))
        return int(rank[0])

    def _ranks(self, cols: np.ndarray) -> tuple[np.ndarray, int]:
        rows = np.fromiter(self.active, dtype=np.int64, count=len(self.active))
        last = self.last[np.ix_(rows, cols)]
        e = self.epoch[rows][:, None]
        wanted = self._wanted(rows, cols, last)
        consumed = (last >= e).sum(axis=0)
        jobs = len(rows)
        return wanted * (jobs + 1) + consumed, jobs

    def _wanted(self, rows: np.ndarray, cols: np.ndarray, last: np.ndarray) -> np.ndarray:
        """How many of the jobs `rows` still want each slot of `cols` this epoch.

        A job of no group reads every file once per epoch: it wants what it has not read
        in its current epoch (and read in its previous one, or never saw). The members of
        a sweep group read one order, which need not hold every file and may hold some
        several times (PADS replays): a member wants a file that another member read more
        often in the member's current epoch than the member itself has, and every member
        wants what the group's order reads ahead of its fastest member (`planned`).
        """
        e = self.epoch[rows][:, None]
        wanted = last == e - 1
        groups = self.group[rows]
        if groups.any():
            count = self.count[np.ix_(rows, cols)]
            # What the group's order reads ahead of its fastest member, every member wants.
            ahead = self.planned(self.keys[cols]) if self.planned is not None else None
            for g in np.unique(groups[groups > 0]):
                members = np.flatnonzero(groups == g)
                for i in members:
                    ei = self.epoch[rows[i]]
                    # Each member's reads of each file in member i's epoch.
                    reads = np.where(last[members] == ei, count[members], 0)
                    wanted[i] = reads.max(axis=0) > reads[list(members).index(i)]
                    if ahead is not None:
                        wanted[i] |= ahead
        result: np.ndarray = wanted.sum(axis=0)
        return result

    def victims(
        self,
        need: int,
        below: int | None,
        kept: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> list[int] | None:
        """Keys to evict, lowest rank first, that free `need` bytes; only ranks < `below`
        when given (None if they do not free enough); everything there is when shrinking.
        With `kept(keys)`, the keys it holds are never victims (pending reads)."""
        if need <= 0:
            return []
        rank, live, _ = self.ranks()
        ok = live if below is None else live & (rank < below)
        if kept is not None:
            ok = ok & ~kept(self.keys[: self._n])  # never in place: `live` is a view
        cand = np.flatnonzero(ok)
        cand = cand[np.argsort(rank[cand], kind="stable")]
        total = np.cumsum(self.sizes[cand])
        k = int(np.searchsorted(total, need))
        if k >= len(cand):
            if below is not None or kept is not None:
                return None
            return [int(x) for x in self.keys[cand]]
        return [int(x) for x in self.keys[cand[: k + 1]]]

    def demand(self, key: int) -> int:
        """How many active jobs still want `key` this epoch (0 if never seen)."""
        slot = self.slot_of.get(key)
        if slot is None:
            return 0
        rows = np.fromiter(self.active, dtype=np.int64, count=len(self.active))
        cols = np.array([slot])
        return int(self._wanted(rows, cols, self.last[np.ix_(rows, cols)])[0])
