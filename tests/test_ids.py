"""The readers' id table against a dict: dense ids in order of first sight, for any int64
key, through every growth of its slots (whose ids move over in steps)."""

from __future__ import annotations

import numpy as np

from shadefs.readers.ids import IdTable


def test_ids_match_a_dict_through_growth() -> None:
    rng = np.random.default_rng(3)
    table, oracle = IdTable(bits=4), {}
    edge = [0, -1, 1, 2**63 - 1, -(2**63), 7]
    for rnd in range(60):
        if rnd % 3:
            keys = rng.integers(-(2**40), 2**40, int(rng.integers(1, 900)))
            keys[: len(edge)] = edge[: len(keys)]
            got = table.add_many(keys).tolist()
        else:
            keys = rng.integers(-(2**40), 2**40, 50)
            got = [table.add(k) for k in keys.tolist()]
        for k, i in zip(keys.tolist(), got, strict=True):
            assert oracle.setdefault(k, len(oracle)) == i
        assert len(table) == len(oracle)
        # Every key is found, also while some ids still sit in the old slots only.
        sample = list(oracle.items())[:: max(1, len(oracle) // 400)]
        assert all(table.get(k) == i for k, i in sample)
        assert table.get(2**41 + rnd) is None and (2**41 + rnd) not in table
    assert table._old is None or table._moved < table._target  # growth was stepwise
    table.step(1 << 30)
    assert table._old is None and table._s.used == len(oracle)
    assert table.keys[: len(oracle)].tolist() == list(oracle)
    assert all(table[k] == i for k, i in oracle.items())


def test_a_growth_moves_the_ids_in_bounded_steps() -> None:
    table = IdTable(bits=17)
    n = (1 << 17) * 2 // 3  # 2/3 full: the next id grows the slots
    table.add_many(np.arange(1, n + 1, dtype=np.int64) * 1_000_003)
    assert table._old is None and len(table._s.slots) == 1 << 17
    more = np.array([-5, -5, 7, *range(8, 608)], dtype=np.int64)  # large: placed in numpy
    assert table.add_many(more)[:4].tolist() == [n, n, n + 1, n + 2]
    assert table._old is not None and table._moved == 0 < table._target == n
    table.step()
    assert 0 < table._moved < table._target  # a bounded share per step, not all at once
    assert table.get(5 * 1_000_003) == 4 and table.get(n * 1_000_003) == n - 1
    assert table.get(-5) == n and table.get(7) == n + 1
    while table._old is not None:
        table.step()
    assert all(table.get(k * 1_000_003) == k - 1 for k in range(1, n + 1, 97))


def test_a_small_batch_gets_the_ids_one_by_one_adds_would() -> None:
    # (below _LOOP_BELOW keys add_many adds them in a loop: a small listing costs less so)
    rng = np.random.default_rng(7)
    a, b = IdTable(bits=10), IdTable(bits=10)
    for _ in range(40):  # through several growths of the slots
        keys = rng.integers(-(2**50), 2**50, int(rng.integers(1, 300)))
        keys[::7] = keys[0]  # a hard link's key repeats: one id
        assert a.add_many(keys).tolist() == [b.add(k) for k in keys.tolist()]
    assert len(a) == len(b) and all(a.get(k) == b.get(k) for k in a.keys[: len(a)].tolist())


def test_single_adds_alone_finish_every_growth() -> None:
    # Reads of files never listed add their keys one by one: the ids still in the old slots
    # count against the grown ones' room, and single adds move them over too.
    table = IdTable(bits=10)
    keys = np.random.default_rng(5).integers(-(2**50), 2**50, 200_000).tolist()
    for i, key in enumerate(keys):
        assert table.add(key) == i
    assert all(table.get(k) == i for i, k in enumerate(keys[::101]) for i in [i * 101])
    live = table._s.used + table._target - table._moved
    assert live == len(keys) and live * 3 <= len(table._s.slots) * 2


def test_the_trackers_counts_kept_per_job_equal_a_full_recount() -> None:
    from shadefs.readers.tracker import Tracker

    rng = np.random.default_rng(9)
    t = Tracker()
    for step in range(3000):
        op = rng.random()
        row = int(rng.integers(0, 4))
        if op < 0.85:
            t.read(int(rng.integers(1, 60)), row)  # inferred epochs come with re-reads
        elif op < 0.9:
            t.leave(row)
        elif op < 0.95:
            t.announce(max(t.epochs_of().values(), default=0) + 1, row)
        else:
            t.announce(int(rng.integers(0, 5)))  # every job
        if step % 50 == 0:
            want, done = t.want[: t.n].copy(), t.done[: t.n].copy()
            t.recount()
            assert want.tolist() == t.want[: t.n].tolist()
            assert done.tolist() == t.done[: t.n].tolist()
