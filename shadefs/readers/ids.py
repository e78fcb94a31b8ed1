"""Cache key -> dense file id, with no Python object per file.

The readers' tracker (readers/tracker.py) keeps every per-file column over dense ids 0, 1,
2, ... in order of first sight. This table gives a key its id: open addressing with linear
probing over a flat int32 array of ids plus one (0: a free slot, so that grown slots
come zeroed from calloc, untouched until written), the keys themselves compared in
the id -> key column `keys`, which the tracker uses as its own. A key costs its 8 B in
`keys` and 6-12 B of slots (at most 2/3 full): about 20 B, where a dict entry with its two
int objects cost ~100 B (docs/design.md §6; 1.28 M files: 25 MB against ~130 MB).

Any int64 is a valid key (inode numbers, and the negative keys of blocks). Ids are never
freed: a key keeps its id for the life of the mount, as the tracker's columns do.

A lookup is a multiply, a shift and a probe or two through memoryviews (Python ints): about
0.3 µs, on the hit path once per open (the tracker's read hands the id on to the policies).
"""

from __future__ import annotations

import numpy as np

__all__ = ["IdTable"]

_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / phi: Fibonacci hashing, as fs/snapshots.py's table
# Below this many keys `add_many` adds them one by one: numpy's probing rounds cost more than
# the loop for a small listing (200 keys: 0.49 ms against 0.23; even at ~700).
_LOOP_BELOW = 512


class IdTable:
    """Key -> dense id; `keys[id]` is the id's key (its first `len(self)` entries)."""

    def __init__(self, bits: int = 10) -> None:
        self.keys = np.zeros(64, dtype=np.int64)
        self._keysv = self.keys.data
        self._n = 0
        self._alloc(bits)
        # While the slots grow: the old ones, and the ids below `_moved` placed in the new.
        self._old: _Slots | None = None
        self._moved = 0
        self._target = 0  # the ids the old slots hold
        self._debt = 0  # single adds since the last step

    def _alloc(self, bits: int) -> None:
        self._s = _Slots(bits)
        self._slotsv = self._s.view

    def __len__(self) -> int:
        return self._n

    def get(self, key: int, default: int | None = None) -> int | None:
        """The id of `key`, or `default` (a dict's `get`, so callers read the same)."""
        s = self._s
        slots, keys, mask = self._slotsv, self._keysv, s.mask
        # (key * phi) mod 2^64, top bits: Python's arithmetic shift keeps a negative key's
        # bits as the two's complement numpy sees in `_Slots.place`.
        i = ((key * _GOLDEN) >> s.shift) & mask
        while True:
            j = slots[i] - 1
            if j < 0:
                break
            if keys[j] == key:
                return j
            i = (i + 1) & mask
        old = self._old
        if old is None:
            return default
        j = old.find(key, keys)
        return default if j < 0 else j

    def __getitem__(self, key: int) -> int:
        i = self.get(key)
        if i is None:
            raise KeyError(key)
        return i

    def __contains__(self, key: object) -> bool:
        return isinstance(key, int) and self.get(key) is not None

    def add(self, key: int) -> int:
        """The id of `key`, the next one if it is new."""
        got = self.get(key)
        if got is not None:
            return got
        j = self._n
        if j == len(self.keys):
            self._grow_keys(j + 1)
        self._keysv[j] = key
        s = self._s
        slots, mask = self._slotsv, s.mask
        i = ((key * _GOLDEN) >> s.shift) & mask
        while slots[i]:
            i = (i + 1) & mask
        slots[i] = j + 1
        self._n = j + 1
        s.used += 1
        if self._old is not None:
            self._debt += 1
            if self._debt >= 512:  # single adds move the ids over too, in numpy batches
                self.step(2 * self._debt)
        # The ids still in the old slots will land in these: they count against the room.
        if (s.used + self._target - self._moved) * 3 > (mask + 1) * 2:
            self._grow_slots()
        return j

    def add_many(self, keys: np.ndarray) -> np.ndarray:
        """The ids of `keys` (int64), the new ones numbered in order of first occurrence.
        Each call also moves a bounded share of the ids into grown slots (see `step`)."""
        if len(keys) < _LOOP_BELOW:
            add = self.add
            return np.fromiter((add(k) for k in np.asarray(keys).tolist()), np.int64, len(keys))
        need = self._n + len(keys)
        if need > len(self.keys):
            self._grow_keys(need)
        self.step(2 * len(keys) + 256)  # done before the grown slots fill (module doc)
        keys = np.asarray(keys, dtype=np.int64)
        ids = self._s.lookup(keys, self.keys)
        if self._old is not None:
            gone = ids < 0
            ids[gone] = self._old.lookup(keys[gone], self.keys)
        miss = np.flatnonzero(ids < 0)
        if not len(miss):
            return ids
        # New keys, numbered in order of first occurrence (a key may repeat: hard links).
        uniq, first = np.unique(keys[miss], return_index=True)
        order = np.argsort(first, kind="stable")
        start, m = self._n, len(uniq)
        if (self._s.used + m + self._target - self._moved) * 3 > len(self._s.slots) * 2:
            self._grow_slots(m)  # (their room counts the ids still to move)
        self.keys[start : start + m] = uniq[order]
        self._n = start + m
        self._s.place(self.keys, start, start + m)
        rank = np.empty(m, dtype=np.int64)
        rank[order] = np.arange(start, start + m)
        ids[miss] = rank[np.searchsorted(uniq, keys[miss])]
        return ids

    def step(self, ids: int = 1 << 15) -> None:
        """Move up to `ids` ids from the old slots into the grown ones (32 k: a few ms):
        growing the slots at 1.28 M ids places every one again, 0.3 s in one go. Two per
        id added finish the move before the grown slots are 2/3 full."""
        if self._old is None:
            return
        self._debt = 0
        end = min(self._moved + ids, self._target)
        self._s.place(self.keys, self._moved, end)
        self._moved = end
        if end == self._target:
            self._old = None

    def _grow_slots(self, more: int = 0) -> None:
        """Twice the slots (or more, to fit `more` new ids as well): the ids move over by
        `step`s; the old slots answer meanwhile."""
        while self._old is not None:
            self.step()  # (a second growth before the first is done: finish it first)
        self._old, self._target, self._moved = self._s, self._n, 0
        bits = self._old.bits + 1
        while (self._n + more) * 3 > (1 << bits) * 2:
            bits += 1
        self._alloc(bits)
        if self._target <= 1 << 15:
            self.step()  # small: at once

    def _grow_keys(self, need: int) -> None:
        cap = len(self.keys)
        while cap < need:
            cap *= 2
        new = np.zeros(cap, dtype=np.int64)
        new[: self._n] = self.keys[: self._n]
        # The old array stays valid for whoever holds it (a plan's snapshot): ids never move.
        self.keys, self._keysv = new, new.data


class _Slots:
    """2^bits slots of ids plus one (0: free), linear probing from a key's Fibonacci hash."""

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.shift = 64 - bits
        self.mask = (1 << bits) - 1
        self.slots = np.zeros(1 << bits, dtype=np.int32)
        self.view = self.slots.data
        self.used = 0

    def find(self, key: int, keys: memoryview) -> int:
        slots, mask = self.view, self.mask
        i = ((key * _GOLDEN) >> self.shift) & mask
        while True:
            j = slots[i] - 1
            if j < 0 or keys[j] == key:
                return j
            i = (i + 1) & mask

    def lookup(self, want: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """The ids of `want` (int64), -1 for those not here; `keys`: the id -> key column.
        Probing in numpy rounds: every key still open moves on by one slot per round."""
        out = np.full(len(want), -1, dtype=np.int64)
        idx = np.arange(len(want))
        mask = np.uint64(self.mask)
        pos = (want.astype(np.uint64) * np.uint64(_GOLDEN)) >> np.uint64(self.shift)
        while len(idx):
            j = self.slots[pos].astype(np.int64) - 1
            hit = j >= 0
            hit[hit] = keys[j[hit]] == want[idx[hit]]
            out[idx[hit]] = j[hit]
            going = (j >= 0) & ~hit
            idx, pos = idx[going], (pos[going] + np.uint64(1)) & mask
        return out

    def place(self, keys: np.ndarray, start: int, end: int) -> None:
        """Place ids `start` to `end` (their keys in `keys`), in numpy."""
        ids = np.arange(start, end, dtype=np.int64)
        mask = np.uint64(self.mask)
        pos = (keys[start:end].astype(np.uint64) * np.uint64(_GOLDEN)) >> np.uint64(self.shift)
        slots = self.slots
        self.used += end - start
        # Linear probing, vectorised: in each round every id still waiting claims its slot
        # if free; of several claimants the first (the lowest id) wins, the others move on.
        while len(ids):
            cand = np.flatnonzero(slots[pos] == 0)
            _, first = np.unique(pos[cand], return_index=True)
            won = cand[first]
            slots[pos[won]] = ids[won] + 1
            rest = np.ones(len(ids), dtype=bool)
            rest[won] = False
            ids = ids[rest]
            pos = (pos[rest] + np.uint64(1)) & mask
