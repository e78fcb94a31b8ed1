"""Resident ids in buckets by rank, without a Python object per entry: the `epoch` policy's.

The `epoch` policy evicts the lowest rank first, the oldest first within a rank. Its
entries move between ranks one at a time on reads (O(1) each) and all at once when the
readers' tracker recounts (a job's new epoch, a job joining or leaving). A dict per rank
would rebuild a dict entry for every resident entry at each re-rank, in the event loop,
which must stay responsive at 1.28 M samples (stats.json `loop_lag_max_ms`).

Here every structure per entry is a numpy column over dense ids or an `array('q')` log:

- `rank[id]`: the rank of the id's bucket + 1 (0: not resident); `pos[id]`: the id's
  index in its bucket's log (the two side by side: a read's move touches one cache line
  for both); `born[id]`: its index in the residency log. The columns grow
  to the tracker's capacity at once, over anonymous memory mapped zero pages that are only
  touched when written (filling the columns with -1, or a calloc that reuses freed heap
  memory and clears it, would touch every page in the event loop);
- per rank, a log of ids in the order they joined the bucket; one log of ids in the
  order they became resident. A log is appended to, and an entry that dies (its id moved
  to another bucket, or was removed) is overwritten with -1 in place.

A walk skips dead entries and moves its bucket's head past those at the front. When dead
entries outnumber live ones, the logs are compacted in numpy (amortised O(1) per move;
nothing changes its place in the eviction order).

A re-rank takes the live ids of the residency log (oldest first: a mask), gives them
their new ranks (one vectorised call) and splits them by rank with a stable sort (a radix
sort over small ints): every bucket afresh, oldest first, and no per-entry Python work.
"""

from __future__ import annotations

import logging
import mmap
from array import array
from collections.abc import Callable, Iterator

import numpy as np

log = logging.getLogger(__name__)

# Compact once the logs hold this many entries more than twice the live ones (a live id
# has one entry in its bucket's log and one in the residency log).
_SLACK = 1 << 13
_MAPPED = 1 << 16  # ids from which a column lives in its own memory mapping

Ranker = Callable[[np.ndarray], np.ndarray]  # ids -> their ranks (ints >= 0)


def _zeros(n: int) -> np.ndarray:
    """A zeroed int64 column of `n`: large ones over fresh anonymous pages (zero until
    written, never cleared by hand), which the array keeps mapped while it lives."""
    if n < _MAPPED:
        return np.zeros(n, dtype=np.int64)
    return np.frombuffer(mmap.mmap(-1, n * 8), dtype=np.int64)


def _log_of(ids: np.ndarray) -> array[int]:
    out = array("q")
    out.frombytes(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
    return out


def _live(entries: array[int]) -> np.ndarray:
    """The live ids of a log, in its order (a copy: the log may grow again after)."""
    view = np.frombuffer(entries, dtype=np.int64)
    out: np.ndarray = view[view >= 0]
    del view  # a log that exports its buffer cannot grow
    return out


class RankBuckets:
    """Ids in buckets by rank, oldest first within one; the lowest rank walked first."""

    def __init__(self) -> None:
        self._pair(_zeros(2 * 64))
        self._bornv = _zeros(64)
        self._views()
        self._born: array[int] = array("q")  # ids in the order they became resident
        self._logs: dict[int, array[int]] = {}  # rank -> ids in the order they joined it
        self._heads: dict[int, int] = {}  # rank -> the index of its first entry maybe live
        self.live = 0  # resident ids
        self._entries = 0  # entries in all logs, dead or live

    def _pair(self, both: np.ndarray) -> None:
        """`rank` (+ 1; 0: not resident) and `pos` of an id side by side in one column of
        pairs: a read's move reads both, from one cache line rather than two."""
        self._both = both.reshape(-1, 2)
        self._rankv = self._both[:, 0]
        self._posv = self._both[:, 1]

    def _views(self) -> None:
        # Memoryviews: indexing one gives a Python int at a third of a numpy scalar's cost
        # (the read path); they follow every regrowth.
        self._rank = self._rankv.data
        self._pos = self._posv.data
        self._bornp = self._bornv.data

    def reserve(self, ids: int) -> None:
        """Room for the ids below `ids` (the tracker's capacity), so that moves need not
        regrow the columns (only the part in use is copied)."""
        old = len(self._rankv)
        if ids <= old:
            return
        cap = max(ids, 2 * old)
        both = _zeros(2 * cap)
        both[: 2 * old] = self._both.reshape(-1)
        self._pair(both)
        born = _zeros(cap)
        born[:old] = self._bornv
        self._bornv = born
        self._views()

    def rank_of(self, i: int) -> int:
        """The rank of id `i`'s bucket, -1 if it is not resident."""
        return self._rank[i] - 1 if i < len(self._rankv) else -1

    def place(self, i: int, r: int) -> None:
        """Put id `i` at the tail of the bucket of rank `r` (resident from now on)."""
        if i >= len(self._rankv):
            self.reserve(i + 1)
        rank = self._rank
        old = rank[i]
        if old == r + 1:
            return
        if old:
            self._logs[old - 1][self._pos[i]] = -1  # the entry it leaves dies
        else:
            born = self._born
            self._bornp[i] = len(born)
            born.append(i)
            self.live += 1
            self._entries += 1
        self._to_tail(i, r)

    def move(self, i: int, r: int) -> None:
        """Put id `i` at the tail of the bucket of rank `r` if it is resident and in
        another bucket (a read: the hit path's `place`, with nothing to grow)."""
        rank = self._rank
        old = rank[i] if i < len(rank) else 0
        if old == 0 or old == r + 1:
            return
        self._logs[old - 1][self._pos[i]] = -1  # the entry it leaves dies
        self._to_tail(i, r)

    def _to_tail(self, i: int, r: int) -> None:
        """Append id `i` to the log of rank `r` and make that its place (`place`, `move`)."""
        bucket = self._logs.get(r)
        if bucket is None:
            bucket = self._logs[r] = array("q")
            self._heads[r] = 0
        self._pos[i] = len(bucket)
        bucket.append(i)
        self._rank[i] = r + 1
        self._entries += 1
        if self._entries > 4 * self.live + _SLACK:
            self.compact()

    def move_many(self, ids: np.ndarray, ranks: np.ndarray) -> None:
        """`move(ids[k], ranks[k])` for k in order (int64 arrays), in numpy: the policy's
        logged reads. Nothing may be placed or dropped among them (the policy takes its
        log in before a place): an id's residency holds for the whole batch."""
        if not len(ids):
            return
        keep = ids < len(self._rankv)
        ids, ranks = ids[keep], ranks[keep]
        keep = self._rankv[ids] != 0  # resident (a move of another id is a no-op)
        ids, ranks = ids[keep], ranks[keep]
        n = len(ids)
        if not n:
            return
        # Per id in log order, the rank it had before each read: a read moves it only
        # when the rank differs, and it ends at its last such read.
        order = np.lexsort((np.arange(n), ids))
        sid, srank = ids[order], ranks[order]
        prev = np.empty(n, dtype=np.int64)
        prev[1:] = srank[:-1]
        first = np.ones(n, dtype=bool)
        first[1:] = sid[1:] != sid[:-1]
        prev[first] = self._rankv[sid[first]] - 1
        changed = np.flatnonzero(srank != prev)
        if not len(changed):
            return
        cid = sid[changed]
        last = np.ones(len(changed), dtype=bool)
        last[:-1] = cid[:-1] != cid[1:]
        at = np.sort(order[changed[last]])  # each moved id's last move, in log order
        ids, new = ids[at], ranks[at] + 1
        old = self._rankv[ids]
        pos = self._posv[ids]
        for r in np.unique(old).tolist():  # the entries they leave die
            view = np.frombuffer(self._logs[r - 1], dtype=np.int64)
            view[pos[old == r]] = -1
            del view  # (a log that exports its buffer cannot grow)
        for r in np.unique(new).tolist():  # appended in order, per bucket
            joined = ids[new == r]
            bucket = self._logs.get(r - 1)
            if bucket is None:
                bucket = self._logs[r - 1] = array("q")
                self._heads[r - 1] = 0
            start = len(bucket)
            bucket.frombytes(joined.tobytes())
            self._posv[joined] = np.arange(start, start + len(joined))
        self._rankv[ids] = new
        self._entries += len(ids)
        if self._entries > 4 * self.live + _SLACK:
            self.compact()

    def drop(self, i: int) -> None:
        """Id `i` is no longer resident (its log entries die)."""
        old = self._rank[i] if i < len(self._rankv) else 0
        if old:
            self._logs[old - 1][self._pos[i]] = -1
            self._born[self._bornp[i]] = -1
            self._rank[i] = 0
            self.live -= 1

    def walk(self, below: int | None = None) -> Iterator[int]:
        """Live ids, the lowest rank first, the oldest first within a rank; only ranks
        below `below` when given. Nothing may be placed or dropped while it runs."""
        heads = self._heads
        for r in sorted(self._logs):
            if below is not None and r >= below:
                return
            bucket = self._logs[r]
            front = True  # only dead entries so far: the head moves past them
            for p in range(heads[r], len(bucket)):
                i = bucket[p]
                if i >= 0:
                    front = False
                    yield i
                elif front:
                    heads[r] = p + 1

    def ids(self) -> np.ndarray:
        """The resident ids, the oldest resident first."""
        return _live(self._born)

    def _compact_born(self, ids: np.ndarray) -> None:
        """Rebuild the residency log from its live `ids` if it is mostly dead."""
        if len(self._born) > 2 * len(ids) + _SLACK:
            self._born = _log_of(ids)
            self._bornv[ids] = np.arange(len(ids))

    def compact(self) -> None:
        """Drop the dead entries of every log; each keeps its order (nothing moves)."""
        self._compact_born(self.ids())
        logs: dict[int, array[int]] = {}
        for r, bucket in self._logs.items():
            ids = _live(bucket)
            if len(ids):
                logs[r] = _log_of(ids)
                self._posv[ids] = np.arange(len(ids))
        self._logs, self._heads = logs, dict.fromkeys(logs, 0)
        self._entries = len(self._born) + self.live

    def rerank(self, ranker: Ranker) -> None:
        """Give every resident id the rank `ranker(ids)` says and rebuild the buckets,
        the oldest resident first in each, in numpy."""
        ids = self.ids()
        self._compact_born(ids)
        self._logs, self._heads = {}, {}
        self._entries = len(self._born) + len(ids)
        if not len(ids):
            return
        rank = np.asarray(ranker(ids), dtype=np.int64)
        self._rankv[ids] = rank + 1
        # Split by rank, the oldest first within one: a stable sort (radix on int16).
        small = int(rank.max()) < (1 << 15)
        order = np.argsort(rank.astype(np.int16) if small else rank, kind="stable")
        ids = ids[order]
        counts = np.bincount(rank)
        ranks = np.flatnonzero(counts)  # a handful: (jobs + 1) ** 2 at most
        ends = np.cumsum(counts[ranks]).tolist()
        start = 0
        for r, end in zip(ranks.tolist(), ends, strict=True):
            bucket = ids[start:end]
            self._posv[bucket] = np.arange(end - start)
            self._logs[r] = _log_of(bucket)
            start = end
        self._heads = dict.fromkeys(self._logs, 0)
