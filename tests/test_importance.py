"""Tests of the importance table: rank scores, smoothing, attribution and the learning loop."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadefs.sampling import wire
from shadefs.sampling.importance import NEUTRAL_SCORE, ImportanceTable, batch_rank_scores
from shadefs.sampling.pads import OrderParams, build_order


def _u32(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint32)


def test_rank_scores_within_each_batch() -> None:
    losses = np.array([0.3, 5.0, 0.1, 9.0, 2.0, 7.0], dtype=np.float32)
    # Batch 1: [0.3, 5.0, 0.1] -> ranks 1, 2, 0; batch 2: [9.0, 2.0] -> 1, 0; batch 3 alone.
    got = batch_rank_scores(losses, _u32(3, 2, 1))
    np.testing.assert_allclose(got, [0.5, 1.0, 0.0, 1.0, 0.0, NEUTRAL_SCORE])


def test_ties_share_the_average_rank() -> None:
    losses = np.array([1.0, 2.0, 2.0, 3.0, 2.0], dtype=np.float32)
    got = batch_rank_scores(losses, _u32(5))
    # Sorted ranks 0 | 1 2 3 | 4: the three 2.0s share rank 2 -> 0.5.
    np.testing.assert_allclose(got, [0.0, 0.5, 0.5, 1.0, 0.5])
    np.testing.assert_allclose(batch_rank_scores(np.ones(4, np.float32), _u32(4)), 0.5)


def test_only_the_rank_matters() -> None:
    rng = np.random.default_rng(1)
    losses = rng.random(64).astype(np.float32)
    a = batch_rank_scores(losses, _u32(64))
    b = batch_rank_scores((losses * 1000 + 5).astype(np.float32), _u32(64))
    np.testing.assert_array_equal(a, b)


def _reference_rank_scores(losses: np.ndarray, lengths: list[int]) -> np.ndarray:
    out = []
    start = 0
    for b in lengths:
        batch = losses[start : start + b].astype(np.float64)
        for x in batch:
            rank = (batch < x).sum() + ((batch == x).sum() - 1) / 2
            out.append(rank / (b - 1) if b > 1 else NEUTRAL_SCORE)
        start += b
    return np.array(out)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.lists(
            st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, 1e-30, -1e30])
            | st.floats(allow_nan=False, allow_infinity=False, width=32),
            min_size=1,
            max_size=12,
        ),
        min_size=1,
        max_size=5,
    )
)
def test_rank_scores_match_a_reference(batches: list[list[float]]) -> None:
    losses = np.array([x for b in batches for x in b], dtype=np.float32)
    lengths = [len(b) for b in batches]
    got = batch_rank_scores(losses, np.array(lengths, dtype=np.uint32))
    np.testing.assert_allclose(got, _reference_rank_scores(losses, lengths))


def test_scores_land_on_the_indices_passed() -> None:
    """The released SHADE code scored the pre-shuffle draw, not the batch: guard that."""
    table = ImportanceTable(1000)
    idx = np.array([917, 3, 512, 42], dtype=np.int64)
    table.ingest(idx, np.array([4.0, 1.0, 3.0, 2.0], np.float32), _u32(4))
    np.testing.assert_allclose(table.scores[idx], [1.0, 0.0, 2 / 3, 1 / 3])
    untouched = np.setdiff1d(np.arange(1000), idx)
    assert (table.scores[untouched] == NEUTRAL_SCORE).all()
    assert (table.seen[untouched] == 0).all()
    assert (table.seen[idx] == 1).all()
    np.testing.assert_array_equal(table.last_updated, np.sort(idx))
    assert list(table.top(2)) == [917, 512]


def test_ema_smoothing_and_first_score() -> None:
    table = ImportanceTable(10, smoothing=0.25)
    table.ingest(np.array([0, 1]), np.array([1.0, 0.0], np.float32), _u32(2))
    assert table.scores[0] == 1.0  # first score replaces the neutral prior
    table.ingest(np.array([0, 1]), np.array([0.0, 1.0], np.float32), _u32(2))
    assert table.scores[0] == pytest.approx(0.75)
    assert table.scores[1] == pytest.approx(0.25)
    assert table.version == 2
    assert table.seen[0] == 2


def test_replayed_sample_gets_mean_rank_and_one_smoothing_step() -> None:
    table = ImportanceTable(10, smoothing=0.5)
    table.ingest(np.array([5, 7]), np.array([2.0, 1.0], np.float32), _u32(2))
    assert table.scores[5] == 1.0
    # Two batches in one report; sample 5 ranks top (1.0) in the first, bottom (0.0) in the
    # second: mean 0.5, then one EMA step 0.5 * 1.0 + 0.5 * 0.5 (two steps would give 0.5).
    idx = np.array([5, 1, 2, 5])
    table.ingest(idx, np.array([9.0, 1.0, 9.0, 1.0], np.float32), _u32(2, 2))
    assert table.scores[5] == pytest.approx(0.75)
    assert table.seen[5] == 3
    assert table.scores[1] == 0.0 and table.scores[2] == 1.0


def test_ingest_rejects_programming_errors() -> None:
    table = ImportanceTable(10)
    with pytest.raises(ValueError):
        table.ingest(np.array([-1]), np.array([1.0], np.float32), _u32(1))
    with pytest.raises(ValueError):
        table.ingest(np.array([10]), np.array([1.0], np.float32), _u32(1))
    with pytest.raises(ValueError):
        table.ingest(np.array([1, 2]), np.array([1.0, 2.0], np.float32), _u32(1))
    table.ingest(np.empty(0, np.int64), np.empty(0, np.float32), np.empty(0, np.uint32))
    assert table.version == 0


def test_top_is_deterministic_with_ties() -> None:
    table = ImportanceTable(8)
    assert list(table.top(3)) == [0, 1, 2]  # all neutral: lowest indices first
    table.ingest(np.array([6, 4]), np.array([2.0, 1.0], np.float32), _u32(2))
    assert list(table.top(3)) == [6, 0, 1]
    assert len(table.top(100)) == 8
    assert len(table.top(0)) == 0


def test_the_summary_is_json_ready() -> None:
    import dataclasses
    import json

    table = ImportanceTable(100)
    table.ingest(np.arange(10), np.arange(10, dtype=np.float32), _u32(10))
    stats = json.loads(json.dumps(dataclasses.asdict(table.describe())))
    assert stats["scored"] == 10
    assert stats["samples"] == 100
    assert stats["mean_score_scored"] == pytest.approx(0.5)
    assert stats["ingested_batches"] == 1


def test_hard_samples_rise_to_the_top_and_are_drawn_more() -> None:
    """Closed loop: order -> batches -> losses from hidden difficulty -> wire -> table."""
    n, batch = 2000, 32
    rng = np.random.default_rng(123)
    hard = rng.choice(n, size=200, replace=False)
    difficulty = np.zeros(n)
    difficulty[hard] = 1.0
    # A fixed 20% resident set unrelated to difficulty: the importance draw alone decides
    # which misses survive the replay substitution.
    resident = rng.random(n) < 0.2
    table = ImportanceTable(n)
    counts = np.zeros(n)
    epochs = 6
    for epoch in range(epochs):
        params = OrderParams(epoch=epoch, seed=9, world_size=1, rank=0, replay=3.0)
        order = build_order(table.scores, resident, params)
        assert len(order) == n
        if epoch >= 2:  # after the table has learned
            counts += np.bincount(order, minlength=n)
        for start in range(0, n, batch):
            idx = order[start : start + batch]
            loss = difficulty[idx] + rng.normal(0.0, 0.3, len(idx))
            msg = wire.encode_losses(idx, loss)
            table.ingest(*wire.decode_losses(msg, n))

    top = table.top(len(hard))
    assert len(np.intersect1d(top, hard)) >= 0.8 * len(hard)
    per_epoch = counts / (epochs - 2)
    # Every epoch is n long, so the average sample appears once; with importance ignored,
    # hard samples would average exactly that too.
    assert per_epoch.mean() == 1.0
    assert per_epoch[hard].mean() > 1.05
    # Among misses, importance decides who survives the replay substitution: hard ones
    # (score near 1, p about 1.9/n) must beat easy ones (score about 0.45, p about 0.9/n).
    miss_hard = np.setdiff1d(hard, np.flatnonzero(resident))
    miss_easy = np.setdiff1d(np.flatnonzero(~resident), hard)
    assert per_epoch[miss_hard].mean() > 1.2 * per_epoch[miss_easy].mean()
