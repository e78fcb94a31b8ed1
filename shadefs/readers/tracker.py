"""Who read what: dense file ids, ONE epoch tracker per job, per-job reads and demand counts.

Every part that needs to know a job's epoch or what it has still to read asks this one
object: the tiers' `epoch` policies rank by its demand counts, the speculator stages a
job's unread files, the fetch log clears at its epoch boundaries, the stats show its
epochs. Nothing else infers an epoch.

**Dense ids.** A cache key (an inode number, or a negative block key) gets a dense id the
first time it is read or listed (`id_of`, readers/ids.py: open addressing over flat arrays,
no Python object per file). Everything per file is a numpy column over ids:

- `keys`, `sizes`, `where` (listing index << 32 | row; -1 when the file's listing is
  unknown), the universe of the speculator's plans;
- per job row: `last[row, id]`, the job's epoch of its last read of the file, and
  `universe[row, id]`, whether the file is one the job may read (a file it read, or any
  regular file of a directory it read from, once that directory's listing joined);
- `want[id]`, `done[id]`: how many active jobs still want the file this epoch
  (last == epoch - 1, or never read) and how many consumed it (last >= epoch).

Relative to job j's epoch e_j a file is *consumed* by j (read in e_j), *wanted* (read in
e_j - 1 or never: j reads it this epoch) or *stale* (j went a whole epoch without it).

**One epoch rule, for one job or many.** An announced epoch (a sampler's `begin_epoch`)
wins: the job's epoch is set, and re-reads are replays. Otherwise a job's re-read of a file
it read this epoch begins its next epoch if the job has read `NEW_EPOCH` of its universe
this epoch; below that the pattern is *broken* (sampling with replacement, a subset read
again): the epoch goes on and the job is marked broken until its next epoch begins (the
speculator stages nothing for it meanwhile). A reopen of the file the job opened last
(Parquet reads its footer, closes and reopens) is one read.

**Costs.** A read is O(1): an id lookup, a handful of numpy scalar updates. A job's new
epoch, a job joining or leaving moves that job's share of `want`/`done` in numpy (O(files),
`_count`; `recount` is the reference) and bumps `generation`: the policies re-rank.
A listing joins a job's universe in numpy, off the read path (`settle`, from the readers'
task and the speculator).
"""

from __future__ import annotations

import logging
import stat
from array import array
from collections.abc import Callable
from typing import Protocol

import numpy as np

from shadefs.readers.ids import IdTable

log = logging.getLogger(__name__)

# The share of its universe a job must have read this epoch for a re-read to begin its
# next epoch (rather than break the pattern). Below 1 for drop_last, and for files added
# while the epoch ran.
NEW_EPOCH = 0.9
_GROW = 2
_SETTLE_FILES = 1 << 14  # files whose listings join universes per `settle` (~15 ms)


SETTLE_MAX = 1 << 16  # the most first reads waiting for their directory's listing
# A log shorter than this is taken in one by one (numpy's per-call cost would exceed it).
BATCH_MIN = 8


class Listing(Protocol):
    """What the tracker reads of a directory listing (fs/snapshots.py's Snapshot)."""

    @property
    def path(self) -> bytes: ...
    @property
    def ino(self) -> np.ndarray: ...
    @property
    def rows(self) -> np.ndarray: ...
    def child_path(self, i: int) -> bytes: ...


# The listing of the directory holding a key's file, or None when there is none (a file
# looked up in a directory never listed, or a key the namespace no longer holds).
ListingOf = Callable[[int], Listing | None]


def path_at(listings: list[Listing], where: int) -> bytes:
    """The path a `where` value names: listing index << 32 | row in that listing."""
    return listings[where >> 32].child_path(where & 0xFFFFFFFF)


def _no_listings(key: int) -> Listing | None:
    return None


class Tracker:
    """The per-file columns, the per-job rows and the one epoch rule (see the module)."""

    def __init__(self, listing_of: ListingOf | None = None) -> None:
        self.listing_of = listing_of or _no_listings
        self.id_of = IdTable()  # key -> id; its `keys` column is id -> key
        self.n = 0
        cap = 64
        self.sizes = np.zeros(cap, dtype=np.int64)
        self.where = np.full(cap, -1, dtype=np.int64)
        self.want = np.zeros(cap, dtype=np.int32)
        self.done = np.zeros(cap, dtype=np.int32)
        self.listings: list[Listing] = []  # only ever appended to
        self._listing_ids: list[np.ndarray] = []  # the ids of each listing's regular files
        self._listed: dict[bytes, int] = {}  # a listing's path -> its index (directories)
        # Per job row: numpy over files, plain lists of scalars per job (a handful).
        self.last = np.zeros((1, cap), dtype=np.int64)
        self.universe = np.zeros((1, cap), dtype=bool)
        self._rows()
        self.epoch: list[int] = []
        self.explicit: list[bool] = []
        self.count: list[int] = []  # files of its universe read this epoch
        self.size: list[int] = []  # files in its universe
        self.broken: list[bool] = []
        self.epochs: list[int] = []  # boundaries inferred or announced
        self.breaks: list[int] = []
        self._prev: list[int] = []  # the key of each job's latest open
        self._dirs: list[set[int]] = []  # the listings in each job's universe
        # Rows for 8 jobs from the start: zeroed pages cost nothing until written, and a
        # later row growth copies the rows in use (2 jobs at 1.28 M files: ~20 ms).
        self._grow_rows(7)
        self.active: dict[int, None] = {}  # rows of the jobs that read, in arrival order
        self.ranks = 1  # len(active) + 1: the base of a rank (want * ranks + done)
        # The epoch (and whether announced) a job starts in: what `announce` to every
        # job said last.
        self.start_epoch = 0
        self.start_explicit = False
        self.boundaries = 0  # every job's new epochs, counted (the fetch log's boundary)
        self.generation = 0  # bumped at every recount: the policies re-rank
        self._unsettled: array[int] = array("q")  # (row, key) pairs read but not listed
        # The key, id and rank of the latest read, for the policies' `accessed` that follows
        # it (read_key -1: look them up).
        self.read_key = self.read_id = -1
        self.read_rank = 0

    def _rows(self) -> None:
        """Memoryviews of the columns and of each row, for the read path: indexing one
        gives a Python int or bool at a third of the cost of a numpy scalar (the numpy
        arrays stay the storage; these share their memory and follow every regrowth)."""
        self._last = [r.data for r in self.last]
        self._universe = [r.data for r in self.universe]
        self._want = self.want.data
        self._done = self.done.data

    # --- ids ------------------------------------------------------------------------------

    @property
    def keys(self) -> np.ndarray:
        """id -> key (the id table's column; a grown one is a new array, the old stays)."""
        return self.id_of.keys

    def _grow_ids(self, need: int) -> None:
        cap = len(self.sizes)
        if need <= cap:
            return  # room already (a copy of every column per listing cost 7 ms at 1 M)
        while cap < need:
            cap *= _GROW
        # Only the ids in use are copied, and zeroed columns come from calloc (pages are
        # touched when written): a doubling at 1 M ids held the event loop ~60 ms otherwise.
        n = self.n
        for name in ("sizes", "where", "want", "done"):
            old = getattr(self, name)
            new = np.zeros(cap, dtype=old.dtype)
            new[:n] = old[:n]
            setattr(self, name, new)
        self.where[n:] = -1
        for name in ("last", "universe"):
            old = getattr(self, name)
            new = np.zeros((old.shape[0], cap), dtype=old.dtype)
            for row in self.active:  # a row is set afresh when its job joins
                new[row, :n] = old[row, :n]
            setattr(self, name, new)
        self._rows()

    def reserve(self, files: int) -> None:
        """Make room for ids of `files` files in all (a registered dataset's size)."""
        self._grow_ids(files + self.n)

    def id(self, key: int) -> int:
        """The dense id of `key`, made on first sight: wanted by every active job."""
        i = self.id_of.get(key)
        if i is None:
            i = self.id_of.add(key)
            if i == len(self.sizes):
                self._grow_ids(i + 1)
            self.n = i + 1
            for r in self.active:  # (an inactive row is set afresh when its job joins)
                self._last[r][i] = self.epoch[r] - 1
            self.want[i] = len(self.active)
        return i

    def _ids(self, keys: np.ndarray) -> np.ndarray:
        """The ids of `keys`, made for the unknown ones in one go."""
        start = self.n
        ids = self.id_of.add_many(keys)  # (a hard link's key repeats: one id)
        m = len(self.id_of) - start
        if m:
            self._grow_ids(start + m)
            self.n += m
            for r in self.active:  # (only rows in use: the others' pages stay untouched)
                self.last[r, start : start + m] = self.epoch[r] - 1
            self.want[start : start + m] = len(self.active)
        return ids

    # --- jobs -----------------------------------------------------------------------------

    def _grow_rows(self, row: int) -> None:
        rows = max(row + 1, len(self.epoch) * _GROW)
        old = len(self.epoch)
        for name in ("last", "universe"):
            arr = getattr(self, name)
            new = np.zeros((rows, arr.shape[1]), dtype=arr.dtype)
            for r in getattr(self, "active", ()):  # the ids and rows in use (_grow_ids)
                new[r, : self.n] = arr[r, : self.n]
            setattr(self, name, new)
        self._rows()
        more = rows - old
        self.epoch += [0] * more
        self.explicit += [False] * more
        self.broken += [False] * more
        for name in ("count", "size", "epochs", "breaks"):
            getattr(self, name).extend([0] * more)
        self._prev += [-1 << 63] * more
        self._dirs += [set() for _ in range(more)]

    def join(self, row: int) -> None:
        """Job `row` starts reading: it wants every file (its row may be a reused one)."""
        if row >= len(self.epoch):
            self._grow_rows(row)
        self.epoch[row] = self.start_epoch
        self.explicit[row] = self.start_explicit
        self.last[row, : self.n] = self.start_epoch - 1
        self.universe[row, : self.n] = False
        self.count[row] = self.size[row] = self.epochs[row] = self.breaks[row] = 0
        self.broken[row] = False
        self._prev[row] = -1 << 63
        self._dirs[row] = set()
        self.active[row] = None
        self._count(row, 1)

    def leave(self, row: int) -> None:
        """Job `row` is over: it wants nothing any more (its row may be reused)."""
        if self.active.pop(row, 0) is None:
            self._count(row, -1)

    def _count(self, row: int, sign: int) -> None:
        """Add (sign 1) or take away (-1) job `row`'s share of `want` and `done`: a job
        joining, leaving or changing epoch costs O(files), not O(jobs x files), which
        recounting every row would (in the event loop)."""
        n, e = self.n, self.epoch[row]
        last = self.last[row, :n]
        if sign > 0:
            self.want[:n] += last == e - 1
            self.done[:n] += last >= e
        else:
            self.want[:n] -= last == e - 1
            self.done[:n] -= last >= e
        self.ranks = len(self.active) + 1
        self.generation += 1

    def recount(self) -> None:
        """Count `want` and `done` afresh over every job (what `_count` keeps up)."""
        n = self.n
        rows = np.fromiter(self.active, dtype=np.int64, count=len(self.active))
        last = self.last[rows, :n]
        e = np.array(self.epoch, dtype=np.int64)[rows][:, None]
        self.want[:n] = (last == e - 1).sum(axis=0)
        self.done[:n] = (last >= e).sum(axis=0)
        self.ranks = len(rows) + 1
        self.generation += 1

    def epochs_of(self) -> dict[int, int]:
        """The epoch of every active job (stats.json `jobs`)."""
        return {row: self.epoch[row] for row in self.active}

    # --- reads ----------------------------------------------------------------------------

    def read(self, key: int, row: int, i: int = -1) -> bool:
        """Job `row` opened `key` (whose id is `i` when the caller knows it, -1: looked
        up); True when that began the job's next epoch (inferred). The hit path: an id
        lookup and a few scalar updates of numpy columns."""
        if row not in self.active:
            self.join(row)
        self.read_key = -1
        prev = self._prev
        if prev[row] == key:
            return False  # a reopen of the file it opened last: one read
        prev[row] = key
        if i < 0:
            got = self.id_of.get(key)
            i = self.id(key) if got is None else got
        universe = self._universe[row]
        if not universe[i]:
            universe[i] = True
            self.size[row] += 1
            if key >= 0 and len(self._unsettled) < SETTLE_MAX:
                self._unsettled.extend((row, key))  # its directory may join the universe
        e = self.epoch[row]
        last = self._last[row]
        was = last[i]
        if was >= e:
            return self._reread(row, i, e)
        want, done = self._want, self._done
        w = want[i]
        if was == e - 1:
            w -= 1
            want[i] = w
        d = done[i] + 1
        done[i] = d
        last[i] = e
        self.count[row] += 1
        self.read_key, self.read_id, self.read_rank = key, i, w * self.ranks + d
        return False

    def _reread(self, row: int, i: int, e: int) -> bool:
        if self.explicit[row]:
            return False  # a replay: the sampler announces its epochs
        if self.count[row] < NEW_EPOCH * self.size[row]:
            if not self.broken[row]:
                log.debug(
                    "job %d: epoch pattern broken at %d of %d", row, self.count[row], self.size[row]
                )
            self.broken[row] = True
            self.breaks[row] += 1
            return False
        self._count(row, -1)
        self._begin(row, e + 1)
        self.last[row, i] = e + 1
        self.count[row] = 1
        self._count(row, 1)
        log.debug("job %d: inferred the start of its epoch %d", row, e + 1)
        return True

    def _begin(self, row: int, epoch: int) -> None:
        self.epoch[row] = epoch
        self.count[row] = 0
        self.broken[row] = False
        self.epochs[row] += 1
        self.boundaries += 1

    def announce(self, epoch: int, row: int | None = None) -> None:
        """A sampler announced epoch `epoch` for job `row` (None: every job, and the ones
        that start later): inference stops for it, and a later epoch begins."""
        rows = list(self.active) if row is None else [row]
        if row is None:
            self.start_explicit = True
            if epoch > self.start_epoch:
                self.start_epoch = epoch
                if not rows:
                    self.boundaries += 1
        elif row not in self.active:
            self.join(row)
        for r in rows:
            self.explicit[r] = True
            if epoch > self.epoch[r]:
                self._count(r, -1)
                self._begin(r, epoch)
                self._count(r, 1)

    # --- what is left to read -------------------------------------------------------------

    def wanted(self, key: int) -> int:
        """How many active jobs have `key` in their universe and not read this epoch: the
        reads of it still to come, as far as the tracker knows (O(jobs))."""
        i = self.id_of.get(key)
        if i is None:
            return 0
        u, last, epoch = self._universe, self._last, self.epoch
        return sum(1 for r in self.active if u[r][i] and last[r][i] < epoch[r])

    def rank(self, i: int) -> int:
        """The eviction rank of id `i` now: by the jobs that want it, then by those that
        consumed it (they read it next epoch); lower ranks go first."""
        return int(self._want[i] * self.ranks + self._done[i])

    def rank_ids(self, ids: np.ndarray) -> np.ndarray:
        rank: np.ndarray = self.want[ids].astype(np.int64) * self.ranks + self.done[ids]
        return rank

    def unread(self, row: int) -> np.ndarray:
        """Ids of job `row`'s universe it has not read this epoch, with a known path."""
        n = self.n
        mask = self.universe[row, :n] & (self.last[row, :n] < self.epoch[row])
        mask &= self.where[:n] >= 0
        return np.flatnonzero(mask)

    def read_since(self, row: int, epoch: int, ids: np.ndarray) -> np.ndarray:
        """Which of `ids` job `row` read in epoch `epoch` or later: what a speculative plan
        made in that epoch asks, up to the latest open (no log to take in first)."""
        read: np.ndarray = self.last[row, ids] >= epoch
        return read

    def read_one_since(self, row: int, epoch: int, i: int) -> bool:
        return bool(self._last[row][i] >= epoch)

    def path(self, i: int) -> bytes:
        return path_at(self.listings, int(self.where[i]))

    # --- universes ------------------------------------------------------------------------

    def settle(self) -> bool:
        """Let the directories of the files read since the last call join their readers'
        universes (listing_of may start a listing: a later call finds it). True when some
        universe grew. About `_SETTLE_FILES` files at most join per call, the rest at the
        next: a job's first reads touch every directory of a dataset within seconds, and
        giving each of 1.28 M files its id at once held the event loop 1.4 s."""
        self.id_of.step()  # the id table's grown slots fill a bounded share per call
        pairs = self._unsettled
        if not pairs:
            return False
        self._unsettled = array("q")
        grown = False
        seen: set[tuple[int, bytes]] = set()
        joined = 0
        for j in range(0, len(pairs), 2):
            if joined >= _SETTLE_FILES:
                self._unsettled.extend(pairs[j:])  # the next call goes on from here
                break
            row, key = pairs[j], pairs[j + 1]
            if row not in self.active:
                continue
            listing = self.listing_of(key)
            if listing is None or (row, listing.path) in seen:
                continue
            seen.add((row, listing.path))
            if self._join_listing(row, listing):
                grown = True
                joined += len(listing.ino)
        return grown

    def _join_listing(self, row: int, listing: Listing) -> bool:
        index = self._listed.get(listing.path)
        if index is None or self.listings[index] is not listing:
            index = self._listed[listing.path] = len(self.listings)
            self.listings.append(listing)
            modes = listing.rows["st_mode"].astype(np.int64)
            rows = np.flatnonzero((modes & 0o170000) == stat.S_IFREG)
            ids = self._ids(listing.ino[rows].astype(np.int64))
            self._listing_ids.append(ids)
            self.sizes[ids] = listing.rows["st_size"][rows]
            self.where[ids] = (np.int64(index) << np.int64(32)) | rows.astype(np.int64)
        if index in self._dirs[row]:
            return False
        self._dirs[row].add(index)
        # O(the listing), never O(every file): a dataset has many directories.
        ids = self._listing_ids[index]
        universe = self.universe[row]
        self.size[row] += int(len(ids) - np.count_nonzero(universe[ids]))
        universe[ids] = True
        return True

    # --- many reads at once -----------------------------------------------------------
    #
    # Many hits of one job taken in at once, in numpy.
    #
    # `Tracker.read` takes one open in with a handful of scalar updates of per-file columns; in
    # the daemon each of them meets its cache line cold, since the readers and the kernel ran
    # between two requests (~2 us a read). The cache logs its warm hits and takes them in by the
    # batch (`Cache.take_hits`); a batch that nothing special happens in is taken in here
    # with one numpy gather and scatter per column, which is what `read` one by one would
    # have done.

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
