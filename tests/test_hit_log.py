"""The cache's hit log (`Cache.hit`, `take_hits`): logged hits end where hits taken one by one
end.

A warm hit pins its bytes at once and logs the rest (the readers', the policies' and the
counters' part); `take_hits` takes the log in, a batch of one job's hits through the
tracker's numpy path (`Tracker.read_many`). These tests run the same opens through a cache
that logs and one that takes every hit at once, and compare everything the hits touch.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import trio

from shadefs.cache.coordinator import HIT_LOG, Cache
from shadefs.fs.guard import PASS, guard_handlers
from shadefs.readers.jobs import JobTable, ProcInfo
from shadefs.readers.part import Readers
from shadefs.readers.tracker import BATCH_MIN, Tracker
from shadefs.stats import Metrics

SIZE = 1000
FILES = 40


class _Source:
    @staticmethod
    def stat(key: int) -> SimpleNamespace:
        return SimpleNamespace(st_size=SIZE, st_mtime_ns=1, st_ctime_ns=1, st_ino=key)

    async def read_file(self, path: bytes, size: int | None = None):
        return bytes(SIZE), self.stat(int(path[1:]))

    def read_now(self, path, size=None):  # a source that always makes its caller wait
        return None

    async def read_files(self, items):
        return [await self.read_file(path, size) for path, size in items], 1e-5


def _cache(slots: int = FILES) -> Cache:
    """An `epoch` cache with room for `slots` files, jobs by pid (no /proc)."""
    return Cache(
        _Source(),  # type: ignore[arg-type]
        Metrics(),
        capacity=slots * SIZE,
        max_entry=SIZE,
        readers=Readers(JobTable(proc=ProcInfo("/nonexistent"))),
    )


def _open(cache: Cache, key: int, pid: int) -> None:
    """An open through the cache's own path (a miss, or a hit it checks), released."""

    async def run() -> None:
        cache.unpin(await cache.open_entry(key, b"/%d" % key, _Source.stat(key), pid))

    trio.run(run)


def _warm(cache: Cache, pids: list[int]) -> None:
    for pid in pids:
        for key in range(FILES):
            _open(cache, key, pid)


def _hit(cache: Cache, key: int, pid: int, *, logged: bool, known_id: bool = True) -> None:
    """The data path's verified reopen of resident `key` (fs/operations.py `_hit_open`),
    through the log or taken at once; then its handle's release."""
    data = cache.entries[key].data
    i = cache.readers.tracker.id_of.get(key) if known_id else -1
    if logged:
        cache.hit(key, data, pid, -1 if i is None else i)
    else:
        cache._hit(key, data, len(data), cache._read(key, pid, -1 if i is None else i))
    cache.unpin(data)


def _state(cache: Cache) -> dict[str, object]:
    t = cache.readers.tracker
    n = t.n
    rows = sorted(t.active)
    return {
        "hits": (cache.metrics.hits, cache.ram_hits),
        "jobs": sorted(
            (j.row, j.hits, j.misses, j.bytes, list(j.reads))
            for j in cache.readers.jobs.jobs.values()
        ),
        "last": t.last[rows, :n].tolist(),
        "universe": t.universe[rows, :n].tolist(),
        "want": t.want[:n].tolist(),
        "done": t.done[:n].tolist(),
        "per job": [
            (t.epoch[r], t.count[r], t.size[r], t.broken[r], t.epochs[r], t._prev[r]) for r in rows
        ],
        "unsettled": list(t._unsettled),
        "eviction order": cache.policy.shrink(FILES * SIZE),
        "handles": cache.handles.handles,
    }


def _reads(seed: int, pids: list[int], epochs: int, replay: bool) -> list[tuple[int, int]]:
    """(key, pid) opens: each pid reads every key once per epoch in its own order; with
    `replay`, some keys are read twice within an epoch (re-reads: a broken pattern)."""
    rng = random.Random(seed)
    out: list[tuple[int, int]] = []
    for _ in range(epochs):
        per = []
        for pid in pids:
            keys = list(range(FILES))
            rng.shuffle(keys)
            if replay:
                keys[5:5] = keys[:3]
            per.append([(k, pid) for k in keys])
        if len(pids) == 1:
            out += per[0]
        else:  # interleaved, as concurrent jobs read
            for group in zip(*per, strict=True):
                out += group
    return out


@pytest.mark.parametrize(
    ("pids", "replay", "known_id"),
    [([7], False, True), ([7], True, True), ([7, 8], False, True), ([7], False, False)],
    ids=["one job", "re-reads", "two jobs", "ids unknown"],
)
@pytest.mark.parametrize("seed", [1, 2])
def test_logged_hits_end_where_hits_taken_at_once_end(
    pids: list[int], replay: bool, known_id: bool, seed: int
) -> None:
    logged, direct = _cache(), _cache()
    for cache in (logged, direct):
        _warm(cache, pids)
    for k, (key, pid) in enumerate(_reads(seed, pids, 3, replay)):
        _hit(logged, key, pid, logged=True, known_id=known_id)
        _hit(direct, key, pid, logged=False, known_id=known_id)
        if k % 97 == 0:  # a stats read, a tick: the log taken in part-way
            logged.take_hits()
    logged.take_hits()
    assert _state(logged) == _state(direct)


def test_a_plain_batch_goes_through_the_tracker_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """One job's hits within an epoch: no scalar read per hit (the numpy path ran)."""
    n = HIT_LOG + BATCH_MIN + 1  # (a log this short still goes by numpy)
    cache = _cache(n)
    for key in range(n):
        _open(cache, key, 7)
    _hit(cache, 0, 7, logged=False)  # a re-read: the job's next epoch begins
    t = cache.readers.tracker
    assert t.epoch[cache.readers.jobs.pids[7].row] == 1
    one_by_one: list[tuple[int, ...]] = []
    monkeypatch.setattr(t, "read", lambda *a: one_by_one.append(a))
    batches: list[tuple[list[int], int, list[int]]] = []
    many = t.read_many
    monkeypatch.setattr(t, "read_many", lambda *a: batches.append(a) or many(*a))
    for key in range(1, n):
        _hit(cache, key, 7, logged=True)
    assert cache._hits  # the rest, still logged
    cache.take_hits()
    assert not one_by_one
    assert [len(b[0]) for b in batches] == [HIT_LOG, n - 1 - HIT_LOG]


def _plain(t: Tracker, row: int, keys: list[int]) -> np.ndarray | None:
    return t.read_many(keys, row, [t.id_of.get(k) for k in keys])


def test_the_tracker_takes_no_batch_that_needs_its_rule() -> None:
    """A re-read, a repeated id, the job's latest open first, an unknown id or a job not
    reading: `read_many` does nothing and says so (the caller reads one by one)."""
    t = Tracker()
    for key in range(20):
        t.read(key, 0)
    before = (t.last.copy(), t.want.copy(), t.done.copy(), list(t.count))
    assert _plain(t, 0, [3, 4]) is None  # read this epoch: a re-read
    t.read(0, 0)  # (19 of 20 read: this begins epoch 1)
    assert t.epoch[0] == 1
    before = (t.last.copy(), t.want.copy(), t.done.copy(), list(t.count))
    assert _plain(t, 0, [5, 6, 5]) is None  # a repeated id
    assert _plain(t, 0, [0, 6]) is None  # the job's latest open: a reopen, not a read
    assert t.read_many([5, 99], 0, [t.id_of[5], -1]) is None  # no id yet
    assert _plain(t, 1, [5, 6]) is None  # a job that has not joined
    after = (t.last, t.want, t.done, t.count)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    ranks = _plain(t, 0, [5, 6])
    assert ranks is not None and ranks.tolist() == [t.rank(t.id_of[k]) for k in (5, 6)]


def test_a_readers_first_hit_is_taken_at_once() -> None:
    """Its job is found from /proc while the process lives: never from a log."""
    cache = _cache()
    _warm(cache, [7])
    _hit(cache, 3, 7, logged=True)
    assert len(cache._hits) == 1
    _hit(cache, 4, 8, logged=True)  # pid 8 never opened anything
    assert not cache._hits  # the log went first, in order
    assert cache.readers.jobs.pids[8].hits == 1


@pytest.mark.parametrize("step", ["open", "admit", "remove", "capacity", "tick"])
def test_every_other_path_takes_the_log_in_first(step: str) -> None:
    """A miss, an admission, a removal, a new budget and the readers' tick each take the
    logged hits in before they look at what the reads did."""
    cache = _cache(FILES + 1)
    _warm(cache, [7])
    for key in range(BATCH_MIN):
        _hit(cache, key, 7, logged=True)
    job = cache.readers.jobs.pids[7]
    assert cache._hits and job.hits == 0
    if step == "open":
        _open(cache, FILES, 7)
    elif step == "admit":
        cache.admit(FILES, bytes(SIZE), cache.entries[0].sig)
    elif step == "remove":
        cache.remove(0)
    elif step == "capacity":
        cache.set_capacity(FILES * SIZE)
    else:
        cache.tick_readers()
    assert not cache._hits and job.hits == BATCH_MIN


def test_an_entry_removed_after_its_hit_was_moved_before_it_left() -> None:
    """Re-admitted, it ranks as read (its hit was taken in while it was resident), as in a
    cache that took the hit at once."""
    logged, direct = _cache(), _cache()
    for cache in (logged, direct):
        _warm(cache, [7])
    for cache, log in ((logged, True), (direct, False)):
        for key in range(BATCH_MIN):
            _hit(cache, key, 7, logged=log)
        sig = cache.entries[2].sig
        cache.remove(2)
        cache.admit(2, bytes(SIZE), sig)
    assert _state(logged) == _state(direct)


def test_the_guard_settles_before_every_handler_but_not_for_a_hit() -> None:
    """fs/guard.py: `_settle` runs before a handler answers, never before a hit path's."""
    from shadefs.fs.readonly import ReadOnly

    calls: list[str] = []

    @guard_handlers
    class Ops(ReadOnly):
        metrics = SimpleNamespace(requests={})

        def _settle(self) -> None:
            calls.append("settle")

        def _hit_open(self, hit: bool) -> object:
            return "hit" if hit else PASS

        async def open(self, hit: bool) -> object:
            calls.append("open")
            return "handled"

        async def getattr(self, inode: int) -> object:
            calls.append("getattr")
            return inode

    ops = Ops()
    assert trio.run(ops.open, True) == "hit" and calls == []
    assert trio.run(ops.open, False) == "handled" and calls == ["settle", "open"]
    assert trio.run(ops.getattr, 1) == 1 and calls[2:] == ["settle", "getattr"]
