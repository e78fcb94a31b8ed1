"""Tests of the PADS epoch order and the replay controller."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadefs.sampling.pads import (
    OrderParams,
    ReplayController,
    build_global_order,
    build_order,
    copy_counts,
    rank_slice,
)


def _params(epoch: int = 0, *, seed: int = 1, replay: float = 3.0, **kw: object) -> OrderParams:
    base: dict[str, object] = {"world_size": 1, "rank": 0}
    base.update(kw)
    return OrderParams(epoch=epoch, seed=seed, replay=replay, **base)  # type: ignore[arg-type]


def _inputs(n: int, resident_fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random(n), rng.random(n) < resident_fraction


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize(
    ("resident_fraction", "replay", "floor", "k"),
    [(0.2, 3.0, 0.1, 4), (0.5, 4.0, 0.0, 3), (0.0, 1.0, 0.1, 5), (0.9, 2.5, 0.0, 2)],
)
def test_every_sample_within_k_epochs(
    seed: int, resident_fraction: float, replay: float, floor: float, k: int
) -> None:
    n = 3001
    rng = np.random.default_rng(seed)
    # Adversarial scores: most samples score zero, so with floor 0 only coverage reaches them.
    scores = np.where(rng.random(n) < 0.05, 1.0, 0.0)
    resident = rng.random(n) < resident_fraction
    for start in (0, 5):  # any K consecutive epochs, not only those starting at 0
        seen = np.zeros(n, dtype=bool)
        for epoch in range(start, start + k):
            params = _params(epoch, seed=seed, replay=replay, floor=floor, coverage_epochs=k)
            order = build_global_order(scores, resident, params)
            assert len(order) == n
            seen[order] = True
        assert seen.all()


def test_hit_fraction_and_interleaving() -> None:
    n = 20000
    scores, resident = _inputs(n, 0.2)
    order = build_global_order(scores, resident, _params(3))
    hits = resident[order]
    # Substitution: about min(1, r * c) = 0.6 of the entries are hits.
    assert hits.mean() >= 0.5
    # Not hits first (the released SHADE bug): every quarter gets its share of hits.
    assert not hits[: n // 5].all()
    for quarter in np.array_split(hits, 4):
        assert 0.5 <= quarter.mean() <= 0.7
    # Some early entry is a miss, well within the first batch.
    assert not hits[:64].all()


def test_replay_copies_are_spread_out() -> None:
    n = 20000
    scores, resident = _inputs(n, 0.2)
    order = build_global_order(scores, resident, _params(2, replay=3.0))
    counts = np.bincount(order, minlength=n)
    assert set(np.unique(counts[resident])) <= {1, 3}
    assert (counts[~resident] <= 1).all()
    triple = np.flatnonzero(counts == 3)
    assert len(triple) > 0.1 * n
    # Positions of each triple-copy sample, grouped: sort (sample, position).
    pos = np.flatnonzero(np.isin(order, triple))
    grouped = pos[np.argsort(order[pos], kind="stable")].reshape(-1, 3)
    gaps = np.diff(grouped, axis=1)
    # Copy j sits in the j-th third, so consecutive copies are about n / 3 apart and
    # practically never in the same batch.
    assert 0.25 * n < gaps.mean() < 0.42 * n
    assert (gaps < 64).mean() < 0.01
    thirds = (grouped * 3) // n
    assert (thirds == [0, 1, 2]).all(axis=1).mean() > 0.9


def test_fractional_replay() -> None:
    n = 20000
    scores, resident = _inputs(n, 0.1)
    counts = copy_counts(scores, resident, _params(0, replay=2.5))
    assert counts.sum() == n
    res_counts = counts[resident]
    assert set(np.unique(res_counts)) <= {2, 3}
    assert res_counts.mean() == pytest.approx(2.5, abs=0.05)


def test_two_ranks_partition_the_global_list() -> None:
    n = 4001  # odd: the last entry is padded by wrapping
    scores, resident = _inputs(n, 0.2)
    glob = build_global_order(scores, resident, _params(1, world_size=2))
    r0 = build_order(scores, resident, _params(1, world_size=2, rank=0))
    r1 = build_order(scores, resident, _params(1, world_size=2, rank=1))
    assert len(r0) == len(r1) == (n + 1) // 2
    padded = np.concatenate((glob, glob[:1]))
    interleaved = np.empty(n + 1, dtype=np.int64)
    interleaved[0::2], interleaved[1::2] = r0, r1
    np.testing.assert_array_equal(interleaved, padded)
    # Samples that appear once in the global list (the non-replayed part) go to one rank.
    once = np.flatnonzero(np.bincount(glob, minlength=n) == 1)
    once = np.setdiff1d(once, glob[:1])  # the padding entry is the one allowed overlap
    assert len(np.intersect1d(np.intersect1d(r0, r1), once)) == 0
    assert len(once) > 0.3 * n  # the misses, about 0.4 n here
    np.testing.assert_array_equal(np.union1d(r0, r1), np.unique(glob))


def test_world_larger_than_n() -> None:
    scores, resident = _inputs(3, 0.0)
    glob = build_global_order(scores, resident, _params(0, world_size=8))
    slices = [build_order(scores, resident, _params(0, world_size=8, rank=r)) for r in range(8)]
    assert all(len(s) == 1 for s in slices)
    assert set(np.concatenate(slices)) == set(glob) == {0, 1, 2}
    assert len(rank_slice(np.empty(0, np.int64), 4, 3)) == 0


def test_deterministic_from_seed_and_epoch() -> None:
    n = 5000
    scores, resident = _inputs(n, 0.2)
    a = build_global_order(scores, resident, _params(4, seed=11))
    b = build_global_order(
        scores.copy(), resident.copy(), _params(4, seed=11, world_size=4, rank=3)
    )
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, build_global_order(scores, resident, _params(5, seed=11)))
    # Epoch 8 shares epoch 4's coverage stratum (K = 4) but must still be a new draw.
    assert not np.array_equal(a, build_global_order(scores, resident, _params(8, seed=11)))
    assert not np.array_equal(a, build_global_order(scores, resident, _params(4, seed=12)))


def test_edge_cases() -> None:
    assert len(build_global_order(np.empty(0), np.empty(0, bool), _params())) == 0
    n = 1000
    # No resident samples: a permutation (importance only decides substitutions).
    scores, _ = _inputs(n, 0.0)
    order = build_global_order(scores, np.zeros(n, bool), _params(0))
    np.testing.assert_array_equal(np.sort(order), np.arange(n))
    # Everything resident: all hits, mandatory stratum still present, length N.
    params = _params(0, replay=3.0)
    counts = copy_counts(scores, np.ones(n, bool), params)
    assert counts.sum() == n
    no_replay = copy_counts(np.ones(n), np.ones(n, bool), _params(0, replay=1.0))
    assert (no_replay == 1).all()
    # Equal scores: misses survive regardless of index (uniform).
    counts = copy_counts(np.full(n * 10, 0.5), np.arange(n * 10) % 5 == 0, _params(1))
    misses = np.flatnonzero(np.arange(n * 10) % 5 != 0)
    low, high = np.array_split(counts[misses], 2)
    assert abs(low.mean() - high.mean()) < 0.05


def test_important_misses_survive_substitution() -> None:
    n = 10000
    rng = np.random.default_rng(5)
    scores = np.where(np.arange(n) < 1000, 1.0, 0.2)
    resident = rng.random(n) < 0.2
    counts = copy_counts(scores, resident, _params(1))
    misses = ~resident
    important = misses & (np.arange(n) < 1000)
    plain = misses & (np.arange(n) >= 1000)
    assert counts[important].mean() > 1.5 * counts[plain].mean()


@pytest.mark.parametrize(
    "kw",
    [
        {"replay": 0.5},
        {"replay": math.nan},
        {"world_size": 2, "rank": 2},
        {"world_size": 0},
        {"coverage_epochs": 0},
        {"floor": 1.5},
        {"seed": -1},
    ],
)
def test_bad_params(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        _params(**kw)  # type: ignore[arg-type]


def test_mismatched_inputs() -> None:
    with pytest.raises(ValueError):
        build_global_order(np.ones(5), np.ones(4, bool), _params())


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 300),
    resident_fraction=st.floats(0.0, 1.0),
    replay=st.floats(1.0, 6.0),
    k=st.integers(1, 6),
    epoch=st.integers(0, 20),
    floor=st.floats(0.0, 1.0),
    zero_scores=st.booleans(),
)
def test_order_invariants(
    n: int,
    resident_fraction: float,
    replay: float,
    k: int,
    epoch: int,
    floor: float,
    zero_scores: bool,
) -> None:
    scores, resident = _inputs(n, resident_fraction, seed=n)
    if zero_scores:
        scores[:] = 0.0
    params = _params(epoch, replay=replay, coverage_epochs=k, floor=floor)
    order = build_global_order(scores, resident, params)
    assert order.dtype == np.int64 and len(order) == n
    counts = np.bincount(order, minlength=n)
    assert (counts[~resident] <= 1).all()
    assert (counts[resident] <= math.ceil(replay)).all()
    # Replay only ever replaces misses: every resident sample keeps at least one slot.
    assert (counts[resident] >= 1).all()


def test_replay_controller_follows_accuracy() -> None:
    ctl = ReplayController(r_init=2.0, r_min=1.0, r_max=4.0, window=3)
    assert ctl.report(val_accuracy=0.50) == 2.0  # one point: no trend yet
    rs = [ctl.report(val_accuracy=acc) for acc in (0.60, 0.70, 0.75, 0.80, 0.85, 0.9)]
    assert rs[0] > 2.0
    assert all(b >= a for a, b in zip(rs, rs[1:], strict=False))
    assert rs[-1] == 4.0  # bounded
    stalled = [ctl.report(val_accuracy=0.9) for _ in range(12)]
    assert stalled[-1] == 1.0
    assert all(b <= a for a, b in zip(stalled, stalled[1:], strict=False))
    assert all(1.0 <= r <= 4.0 for r in rs + stalled)
    assert ctl.r == 1.0


def test_replay_controller_falls_back_to_training_loss() -> None:
    ctl = ReplayController(r_init=3.0)
    for loss in (2.0, 1.5, 1.2, 1.0):
        r = ctl.report(train_loss=loss)
    assert r == 4.0
    for _ in range(10):
        r = ctl.report(train_loss=1.0)
    assert r == 1.0


def test_replay_controller_rejects_bad_input() -> None:
    ctl = ReplayController()
    with pytest.raises(ValueError):
        ctl.report()
    with pytest.raises(ValueError):
        ctl.report(train_loss=math.inf)
    with pytest.raises(ValueError):
        ReplayController(r_init=5.0, r_max=4.0)
    with pytest.raises(ValueError):
        ReplayController(r_min=0.5, r_init=1.0)
