"""The importance table: one smoothed, rank-based score for every registered sample.

This module owns the "ghost table" of the shade policy: a score in [0, 1] for every sample of
the registered dataset, cached or not, so that admission can compare a miss with the least
important cached entry and the PADS order (``shadefs.sampling.pads``) can draw by importance.

Scores follow SHADE's insight (docs/design.md §5): only the *rank* of a sample's loss
within its mini-batch is kept, never the loss magnitude, so scores computed by different model
versions stay comparable.  Unlike the released SHADE code, scores land on exactly the indices
the loader returned, and they are smoothed over time with an exponential moving average
instead of being overwritten by the latest rank.

Everything is numpy-vectorised: ImageNet-1k has 1.28 M samples and the table is touched on
every reported batch.
"""

from __future__ import annotations

import logging

import numpy as np

from shadefs.stats import TableStats

log = logging.getLogger(__name__)

#: Score of a sample that was never scored: the middle of the rank range, so an unscored
#: sample is neither favoured nor starved (SHADE's init_fac made them 2-4x *less* likely).
NEUTRAL_SCORE = 0.5

_SEEN_MAX = np.iinfo(np.uint32).max


def _ordered_bits(losses: np.ndarray) -> np.ndarray:
    """Map float32 losses to uint32 keys that sort in the same order (NaN excluded)."""
    # Adding +0.0 turns -0.0 into +0.0 so the two compare as the tie they are.
    bits = (np.asarray(losses, dtype=np.float32) + np.float32(0.0)).view(np.uint32)
    # Non-negative floats: set the sign bit; negative ones: flip every bit (IEEE-754 trick).
    mask = (bits >> np.uint32(31)) * np.uint32(0x7FFFFFFF) | np.uint32(0x80000000)
    return bits ^ mask


def batch_rank_scores(losses: np.ndarray, batch_lengths: np.ndarray) -> np.ndarray:
    """Return the within-batch rank score of every loss, in the order of ``losses``.

    ``losses`` holds several batches back to back, of the sizes in ``batch_lengths``.  Within
    a batch of size B the lowest loss scores 0 and the highest 1 (rank / (B - 1)); ties share
    their average rank; a batch of one scores 0.5 (nothing to compare it with).
    """
    m = len(losses)
    if m == 0:
        return np.empty(0, dtype=np.float64)
    lengths = np.asarray(batch_lengths, dtype=np.int64)
    # One sortable integer key per sample, (batch id, loss), so a single sort ranks every
    # batch of the report at once; ties then get the mean position of their run.
    key = _ordered_bits(losses).astype(np.uint64)
    if len(lengths) > 1:
        batch_id = np.repeat(np.arange(len(lengths), dtype=np.uint64), lengths)
        key |= batch_id << np.uint64(32)
    # The unstable sort is fine: tied entries share one averaged position anyway.
    order = np.argsort(key)
    sorted_key = key[order]
    tie = sorted_key[1:] == sorted_key[:-1]
    avg_pos = np.empty(m, dtype=np.float64)
    if not tie.any():  # the usual case with float losses
        avg_pos[order] = np.arange(m, dtype=np.float64)
    else:
        run_start = np.empty(m, dtype=bool)
        run_start[0] = True
        np.logical_not(tie, out=run_start[1:])
        first = np.flatnonzero(run_start)
        last = np.append(first[1:], m) - 1
        avg_pos[order] = ((first + last) * 0.5)[np.cumsum(run_start) - 1]
    if len(lengths) == 1:
        return avg_pos / (m - 1) if m > 1 else np.full(1, NEUTRAL_SCORE)
    starts = np.cumsum(lengths) - lengths
    idx = batch_id.astype(np.intp)
    denom = (lengths - 1).astype(np.float64)
    single = denom == 0
    denom[single] = 1.0
    out = (avg_pos - starts[idx]) / denom[idx]
    if single.any():
        out[single[idx]] = NEUTRAL_SCORE
    return out


class ImportanceTable:
    """Smoothed rank-based importance of every registered sample (the ghost table).

    Attributes:
        n: number of registered samples.
        scores: float64[n] in [0, 1]; unscored samples hold ``NEUTRAL_SCORE``.
        seen: uint32[n], how many times each sample was scored (saturating).
        version: incremented by every non-empty ingest, so policies can notice changes.
        last_updated: int64 indices whose score the latest ingest changed (sorted, unique),
            so a policy can re-key just those entries of its priority order.
    """

    def __init__(self, n: int, *, smoothing: float = 0.3) -> None:
        if n < 0:
            raise ValueError(f"table size must be >= 0, got {n}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.n: int = int(n)
        self.smoothing: float = float(smoothing)
        self.scores: np.ndarray = np.full(self.n, NEUTRAL_SCORE, dtype=np.float64)
        self.seen: np.ndarray = np.zeros(self.n, dtype=np.uint32)
        self.version: int = 0
        self.last_updated: np.ndarray = np.empty(0, dtype=np.int64)
        # Running totals for stats(); kept as Python ints so they never overflow.
        self._ingested_samples = 0
        self._ingested_batches = 0

    def ingest(self, indices: np.ndarray, losses: np.ndarray, batch_lengths: np.ndarray) -> None:
        """Fold one report of per-sample losses (possibly several batches) into the table.

        The arrays come from ``wire.decode_losses`` and are already validated; the checks
        here are O(batch) and only guard against programming errors, because a negative
        index would otherwise silently score the wrong sample (the released SHADE bug).
        """
        indices = np.asarray(indices, dtype=np.int64)
        losses = np.asarray(losses)
        batch_lengths = np.asarray(batch_lengths)
        m = len(indices)
        if len(losses) != m:
            raise ValueError(f"{m} indices but {len(losses)} losses")
        if int(batch_lengths.sum(dtype=np.uint64)) != m:
            raise ValueError("batch lengths do not sum to the number of losses")
        if m == 0:
            return
        if int(indices.min()) < 0 or int(indices.max()) >= self.n:
            raise ValueError(f"sample index out of range [0, {self.n})")

        rank_score = batch_rank_scores(losses, batch_lengths)

        # A sample replayed within one report gets the mean of its rank scores, and is
        # smoothed once: replay copies should not age its history faster than other samples.
        # Hand-rolled np.unique: the common case (no duplicate) then costs one small sort.
        by_index = np.argsort(indices)
        sorted_idx = indices[by_index]
        fresh = np.empty(m, dtype=bool)
        fresh[0] = True
        np.not_equal(sorted_idx[1:], sorted_idx[:-1], out=fresh[1:])
        if fresh.all():
            uniq = sorted_idx
            new = rank_score[by_index]
            counts: np.ndarray | int = 1
        else:
            starts = np.flatnonzero(fresh)
            uniq = sorted_idx[starts]
            counts = np.diff(np.append(starts, m)).astype(np.uint64)
            new = np.add.reduceat(rank_score[by_index], starts) / counts

        old_seen = self.seen[uniq]
        old = self.scores[uniq]
        updated = old + self.smoothing * (new - old)
        # A first score replaces the neutral prior outright: blending with 0.5 would make
        # newly scored samples look alike for several epochs.
        first = old_seen == 0
        updated[first] = new[first]
        self.scores[uniq] = updated
        self.seen[uniq] = np.minimum(old_seen.astype(np.uint64) + counts, _SEEN_MAX)

        self.last_updated = uniq
        self.version += 1
        self._ingested_samples += m
        self._ingested_batches += len(batch_lengths)

    def top(self, k: int) -> np.ndarray:
        """Indices of the ``k`` highest scores, highest first (ties: lower index first)."""
        k = max(0, min(int(k), self.n))
        if k == 0:
            return np.empty(0, dtype=np.int64)
        if k < self.n:
            # O(n) selection first: sorting all 1.28 M scores for a small k is wasteful.
            kth = self.scores[np.argpartition(-self.scores, k - 1)[k - 1]]
            # argpartition splits ties at the boundary arbitrarily (and the initial table is
            # all ties); take the lowest tied indices so the answer is deterministic.
            above = np.flatnonzero(self.scores > kth)
            tied = np.flatnonzero(self.scores == kth)[: k - len(above)]
            cand = np.concatenate((above, tied))
        else:
            cand = np.arange(self.n)
        order = np.lexsort((cand, -self.scores[cand]))
        return cand[order[:k]].astype(np.int64)

    def describe(self) -> TableStats:
        """The summary for ``stats.json`` (``sampler.table``)."""
        scored_mask = self.seen > 0
        scored = int(np.count_nonzero(scored_mask))
        mean_scored = float(self.scores[scored_mask].mean()) if scored else None
        return TableStats(
            samples=self.n,
            scored=scored,
            scored_fraction=scored / self.n if self.n else 0.0,
            mean_score=float(self.scores.mean()) if self.n else None,
            mean_score_scored=mean_scored,
            max_seen=int(self.seen.max()) if self.n else 0,
            ingested_samples=self._ingested_samples,
            ingested_batches=self._ingested_batches,
            version=self.version,
            smoothing=self.smoothing,
        )
