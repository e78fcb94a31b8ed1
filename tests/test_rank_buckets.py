"""The `epoch` policy's rank buckets (numpy columns and logs) against plain dicts."""

from __future__ import annotations

import numpy as np
import pytest

from shadefs.cache.policies import EpochPolicy
from shadefs.cache.policies import buckets as buckets_mod
from shadefs.cache.policies.buckets import RankBuckets


class DictBuckets:
    """The reference: a dict per rank (the policy's buckets before issue 20's re-rank)."""

    def __init__(self) -> None:
        self.order: dict[int, None] = {}  # resident ids, oldest first
        self.rank: dict[int, int] = {}
        self.buckets: dict[int, dict[int, None]] = {}

    def place(self, i: int, r: int) -> None:
        old = self.rank.get(i)
        if old == r:
            return
        if old is None:
            self.order[i] = None
        else:
            del self.buckets[old][i]
        self.buckets.setdefault(r, {})[i] = None
        self.rank[i] = r

    def drop(self, i: int) -> None:
        if i in self.rank:
            del self.buckets[self.rank.pop(i)][i]
            del self.order[i]

    def rerank(self, rank_of: dict[int, int]) -> None:
        self.rank = {i: rank_of[i] for i in self.order}
        self.buckets = {}
        for i in self.order:
            self.buckets.setdefault(self.rank[i], {})[i] = None

    def walk(self, below: int | None = None) -> list[int]:
        return [
            i for r in sorted(self.buckets) if below is None or r < below for i in self.buckets[r]
        ]


@pytest.mark.parametrize("seed", range(6))
def test_moves_drops_reranks_and_compactions_keep_the_dict_order(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(buckets_mod, "_SLACK", 8)  # compact often
    rng = np.random.default_rng(seed)
    ids, ranks = 60, 4
    got, want = RankBuckets(), DictBuckets()
    compactions = 0
    real_compact = got.compact

    def compact() -> None:
        nonlocal compactions
        compactions += 1
        real_compact()

    monkeypatch.setattr(got, "compact", compact)
    for step in range(6000):
        op = rng.random()
        i = int(rng.integers(ids))
        if op < 0.6:
            r = int(rng.integers(ranks))
            got.place(i, r)
            want.place(i, r)
        elif op < 0.85:
            got.drop(i)
            want.drop(i)
        elif op < 0.855:
            table = rng.integers(ranks, size=ids)
            got.rerank(lambda x, t=table: t[x])
            want.rerank({j: int(table[j]) for j in range(ids)})
        else:
            below = int(rng.integers(ranks + 1))
            take = int(rng.integers(1, 20))
            # A walk left early (the policy stops at its last victim) must not disturb
            # the next one.
            expected = want.walk(below)
            walked = []
            for j in got.walk(below):
                walked.append(j)
                if len(walked) == take:
                    break
            assert walked == expected[:take], step
        assert got.live == len(want.order)
        assert list(got.walk()) == want.walk(), step
        assert [got.rank_of(j) for j in range(ids)] == [want.rank.get(j, -1) for j in range(ids)]
    assert got.ids().tolist() == list(want.order)
    assert compactions > 10  # the compactions ran, and moved nothing


def test_columns_grow_for_ids_beyond_them() -> None:
    b = RankBuckets()
    b.place(5, 1)
    b.place(200_000, 0)  # past the first column: it grows (over mapped pages)
    b.reserve(300_000)
    b.place(250_000, 1)
    assert list(b.walk()) == [200_000, 5, 250_000]
    b.rerank(lambda x: np.where(x == 5, 0, 2))
    assert list(b.walk()) == [5, 200_000, 250_000]  # oldest first within a rank
    assert b.rank_of(5) == 0 and b.rank_of(250_000) == 2 and b.rank_of(7) == -1


def _interleaved(n: int, jobs: int, epochs: int, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    out = []
    for e in range(epochs):
        perms = [rng.permutation(n) for _ in range(jobs)]
        for k in range(n):
            for j in range(jobs):
                key = int(perms[j][k])
                if e and k == 0 and key == out[-1][1]:
                    continue  # a reopen of the last file would be one read
                out.append((j, key))
    return out


@pytest.mark.parametrize("jobs", [1, 3])
def test_after_a_recount_victims_follow_the_trackers_ranks_oldest_first(jobs: int) -> None:
    """Whatever the buckets did before, a re-rank leaves exactly what a synchronous
    computation gives: the tracker's rank of every resident entry, ties oldest first."""
    policy = EpochPolicy()
    t = policy.tracker
    resident: dict[int, None] = {}  # oldest first
    capacity = 40
    trace = _interleaved(150, jobs, 3, seed=jobs)
    for job, key in trace[: len(trace) * 5 // 6]:  # into the last epoch: ranks differ
        t.read(key, job)
        hit = key in resident
        policy.accessed(key, hit, job)
        if hit:
            continue
        victims = policy.admit(key, 1, capacity - len(resident))
        if victims is None:
            continue
        for v in victims:
            del resident[v]
            policy.removed(v)
        resident[key] = None
        policy.inserted(key, 1)
    t.announce(max(t.epochs_of().values()) + 1)  # every job's next epoch: a recount
    expected = sorted(resident, key=lambda k: t.rank(t.id_of[k]))  # stable: oldest first
    assert policy.shrink(capacity * 10) == expected
    assert len({t.rank(t.id_of[k]) for k in resident}) > 1  # the order was not trivial


@pytest.mark.parametrize("seed", range(4))
def test_moves_taken_in_a_batch_end_where_moves_one_at_a_time_put_them(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`move_many` (the policy's logged reads) against `move` per read: each read sets
    its id's rank, ids repeat within a batch, some are not resident, a drop comes between
    (unlogged, as `removed`) and a place drains the log first (as `inserted`)."""
    monkeypatch.setattr(buckets_mod, "_SLACK", 8)  # compact often, also inside a batch
    rng = np.random.default_rng(seed)
    ids, ranks = 50, 5
    one, batch = RankBuckets(), RankBuckets()
    table = np.zeros(ids, dtype=np.int64)
    log: list[tuple[int, int]] = []

    def drain() -> None:
        pairs = np.array(log, dtype=np.int64).reshape(-1, 2)
        batch.move_many(pairs[:, 0].copy(), pairs[:, 1].copy())
        log.clear()

    moved = 0
    for step in range(5000):
        op = rng.random()
        i = int(rng.integers(ids))
        if op < 0.7:  # a read: its rank moves (or not), logged
            table[i] = int(rng.integers(ranks))
            moved += one.rank_of(i) not in (-1, int(table[i]))
            one.move(i, int(table[i]))
            log.append((i, int(table[i])))
        elif op < 0.85:
            one.drop(i)
            batch.drop(i)
        elif op < 0.95:
            drain()
            one.place(i, int(table[i]))
            batch.place(i, int(table[i]))
        if op >= 0.95 or len(log) > int(rng.integers(1, 40)):
            drain()
            assert list(batch.walk()) == list(one.walk()), step
            assert [batch.rank_of(j) for j in range(ids)] == [one.rank_of(j) for j in range(ids)]
    drain()
    assert list(batch.walk()) == list(one.walk())
    assert batch.live == one.live and moved > 500


def test_the_policy_moves_its_logged_reads_before_it_chooses_victims(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same reads give the same victims whether each read moves its entry at once
    (a log of one) or the log waits for `admit` / `shrink`."""
    from shadefs.cache.policies import epoch as epoch_mod

    def victims(moves: int) -> list[int]:
        monkeypatch.setattr(epoch_mod, "_MOVES", 2 * moves)
        policy = EpochPolicy()
        t = policy.tracker
        for key in range(30):
            t.read(key, 0)
            policy.accessed(key, False, 0)
            policy.inserted(key, 1)
        for key, hit in ((3, True), (100, False), (17, True), (5, True), (29, True), (17, True)):
            # 3 begins the next epoch (a recount); 100 is not resident; then ranks move,
            # and the second 17 is a re-read within the epoch (its rank stays)
            t.read(key, 0)
            policy.accessed(key, hit, 0)
        # (the miss of 100 logs nothing: there is no entry to move)
        assert len(policy._moved) == (0 if moves == 1 else 2 * 5)
        return policy.shrink(12)

    assert victims(1) == victims(1 << 20)


def test_an_entry_evicted_and_admitted_again_takes_none_of_its_old_logged_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read logged while an entry was resident must not move it after it was evicted
    and admitted again at another rank (`inserted` does not take the log in first)."""
    from shadefs.cache.policies import epoch as epoch_mod

    def run(moves: int) -> tuple[list[int], int, int]:
        monkeypatch.setattr(epoch_mod, "_MOVES", 2 * moves)
        policy = EpochPolicy()
        t = policy.tracker
        for key in range(10):  # two jobs, each in its first epoch: ranks count both
            t.read(key, 0)
            t.read(key, 1)
        t.read(0, 0)
        t.read(0, 1)  # both in their next epoch: every file wanted twice
        for key in range(1, 10):
            policy.inserted(key, 1)
        for key in (4, 6):
            t.read(key, 0)
            policy.accessed(key, True, 0)  # logged at "wanted once, done once"
        policy.removed(4)
        t.read(4, 1)  # the other job reads it too while it is out: "done twice"
        policy.accessed(4, False, 1)
        policy.inserted(4, 1)
        policy._fresh()
        i = t.id(4)
        return policy.shrink(9), policy._buckets.rank_of(i), t.rank(i)

    once, batched = run(1), run(1 << 20)
    assert batched[1] == batched[2]  # its bucket is its rank now
    assert once == batched
