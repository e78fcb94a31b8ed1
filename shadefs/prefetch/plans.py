"""Plans: known future read orders, and where their reader is in them.

A plan is a sequence of cache keys with the paths to fetch them from and their sizes: the
share of an epoch's PADS order that a rank read back, a list of paths a job wrote to
`.shadefs/plan`, or a speculative guess (prefetch/speculate.py). The reader's position (its
cursor) is inferred by matching every open against the plan (`observe`), so no cooperation
from the reading processes is needed, and DataLoader workers that read out of order are
tolerated. The prefetcher (prefetch/prefetcher.py) fetches ahead of the cursor; the policies ask
`next_use`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["Plan", "ctl_name", "order_name", "speculative_name", "writer_name"]


# Every plan's name is made here: they are what stats.json and `drop` show and take.
def order_name(seed: int, group: str, world_size: int, rank: int) -> str:
    """A rank's share of a known order (a sweep group's members share one)."""
    return f"order:{f'group={group}' if group else f'seed={seed}'}:world={world_size}:rank={rank}"


def ctl_name(n: int) -> str:
    """The `n`th plan a `prefetch` command made."""
    return f"ctl:{n}"


def writer_name(pid: int) -> str:
    """The plan process `pid` writes to `.shadefs/plan` (each write replaces its last)."""
    return f"plan:pid={pid}"


def speculative_name(owner: str) -> str:
    """A speculative plan over the unread files of job `owner`."""
    return f"speculate:{owner}"


# The read rate is re-estimated every this many reads.
_RATE_EVERY = 16
# How far ahead of the cursor a read may land and still be the plan's (a read further ahead is
# taken for another job's read of the same file, and leaves the cursor alone).
_MATCH_AHEAD = 4096
_DEFAULT_RATE = 100.0  # reads/s assumed for a plan before it has been observed
_EWMA = 0.2


class Plan:
    """A known future read order: keys, the paths to fetch them from, their sizes."""

    def __init__(
        self,
        name: str,
        keys: np.ndarray,
        paths: Sequence[bytes],
        sizes: np.ndarray,
        now: float = 0.0,
    ) -> None:
        """`now`: the time of its making, on the clock of the reads it will observe (the
        prefetcher stamps a plan it installs with its own: `stamp`)."""
        if not len(keys) == len(paths) == len(sizes):
            raise ValueError("a plan needs one path and one size per key")
        self.name = name
        self.keys = keys.astype(np.uint64, copy=False)
        self.paths = paths
        self.sizes = sizes.astype(np.int64, copy=False)
        self.readers = 1  # the jobs that read this plan (a sweep group's members)
        self.span = 0  # entries the staging window covers (set by the prefetcher)
        self.cursor = 0  # the reader's next position
        self.frontier = 0  # the prefetcher's next position to consider
        order = np.argsort(self.keys, kind="stable")
        self._sorted = self.keys[order]
        self._positions = order.astype(np.int64)  # ascending within each key (stable sort)
        self._consumed = np.zeros(len(self.keys), dtype=bool)
        self.stamp(now)
        self.rate = _DEFAULT_RATE
        self.reads = 0

    def stamp(self, now: float) -> None:
        """Start the plan at `now`: its age, and its reader's pace, count from there."""
        self.created = now
        self.last_progress = now
        self._rate_since = now

    def __len__(self) -> int:
        return len(self.keys)

    speculative = False  # a guess (speculate.py): the policies ignore it (planned, next_use)

    @property
    def done(self) -> bool:
        return self.cursor >= len(self.keys)

    def _occurrences(self, key: int) -> np.ndarray:
        # As uint64, the keys' dtype: a Python int would convert the whole array per call.
        k = np.uint64(key) if key >= 0 else key
        lo = int(np.searchsorted(self._sorted, k, "left"))
        hi = int(np.searchsorted(self._sorted, k, "right"))
        return self._positions[lo:hi]

    def observe(self, key: int, now: float) -> bool:
        """Note a read of `key`: it consumes the key's earliest unconsumed occurrence.

        DataLoader workers read whole batches in parallel, so reads arrive out of order
        around the reader's position, and a replayed sample occurs several times. Marking
        occurrences consumed handles both exactly: the cursor is the first position not yet
        read, however the reads interleave. A read that matches no unconsumed occurrence
        within _MATCH_AHEAD of the cursor is not this plan's reader (another job, say).
        """
        occ = self._occurrences(key)
        if not len(occ):
            return False
        i = int(np.searchsorted(occ, self.cursor))
        while i < len(occ) and self._consumed[occ[i]]:
            i += 1
        if i == len(occ) or occ[i] - self.cursor > _MATCH_AHEAD:
            return False
        self._consumed[occ[i]] = True
        cursor = self.cursor
        n = len(self.keys)
        while cursor < n and self._consumed[cursor]:
            cursor += 1
        self.cursor = cursor
        self.reads += 1
        if self.paced:
            dt = now - self._rate_since
            if dt > 0:
                inst = _RATE_EVERY / dt
                self.rate = (
                    inst if self.reads == _RATE_EVERY else ((1 - _EWMA) * self.rate + _EWMA * inst)
                )
            self._rate_since = now
        self.last_progress = now
        return True

    @property
    def paced(self) -> bool:
        """Whether the last read observed made the plan measure its reader's rate anew."""
        return self.reads > 0 and self.reads % _RATE_EVERY == 0

    def consumed(self, pos: int) -> bool:
        """Whether the read at position `pos` has been seen (the prefetcher skips it)."""
        return bool(self._consumed[pos])

    def lead(self, keys: np.ndarray) -> int:
        """Put the entries of `keys` (uint64: files staged or in flight already) first, where
        the plan's order allows, and return how many lead: the prefetcher starts past them.
        A known order is its reader's, so nothing moves (0); a speculative one may
        (speculate.py)."""
        return 0

    def next_use(self, key: int) -> float:
        """Reads until `key` is needed again by this plan's reader (inf if never)."""
        occ = self._occurrences(key)
        i = int(np.searchsorted(occ, self.cursor))
        while i < len(occ) and self._consumed[occ[i]]:
            i += 1
        return float(occ[i] - self.cursor) if i < len(occ) else math.inf

    def unread(self, keys: np.ndarray) -> np.ndarray:
        """Which of `keys` (uint64) this plan still reads (`next_use` is finite: an
        occurrence not consumed yet, as every position before the cursor is), in one
        vectorised pass (a prefetch batch's keys)."""
        s = self._sorted
        if not len(s):
            return np.zeros(len(keys), dtype=bool)
        lo = np.searchsorted(s, keys, "left")
        n = np.searchsorted(s, keys, "right") - lo
        out = np.zeros(len(keys), dtype=bool)
        one = n == 1
        out[one] = ~self._consumed[self._positions[lo[one]]]
        for i in np.flatnonzero(n > 1).tolist():  # a replayed sample: its occurrences in turn
            out[i] = self.next_use(int(keys[i])) != math.inf
        return out
