"""The epoch order (PADS) and the replay controller.

This module owns how the next epoch's index list is built from the importance table and the
set of resident (cached) samples, and how the replay factor r follows training progress.
It is pure numpy and deterministic: every rank of a job computes the same global list from
(scores, resident, seed, epoch) and takes its DistributedSampler-style share of it.

The released SHADE sampler (docs/design.md §5) draws with replacement (about 37%
of the data never seen per epoch), puts every hit before every miss, and does not partition
ranks.  Here instead:

1. a coverage stratum (1/K of the data, from a seed-only permutation) is mandatory each
   epoch, so every sample is trained at least once every K epochs;
2. the other samples get a priority from an importance draw without replacement
   (Gumbel-top-k over ``(1 - floor) * score + floor * uniform``);
3. resident samples appear ``r`` times; their copies replace the lowest-priority
   non-mandatory misses, so the epoch stays exactly N long and the hit fraction is about
   ``min(1, r * resident fraction)`` (SHADE's substitution);
4. copy j of a sample with c copies lands at a random place in the j-th of c equal segments
   of the epoch, so hits and misses are mixed throughout and replays are spread out.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

# Distinct SeedSequence spawn keys keep the seed-only coverage stream and the per-epoch
# stream independent even when an epoch number happens to equal another stream's tag.
_COVERAGE_STREAM = 0xC0DE
_EPOCH_STREAM = 0xE90C


@dataclass(frozen=True)
class OrderParams:
    """Everything besides the scores and the resident set that decides an epoch's order."""

    epoch: int
    seed: int
    world_size: int
    rank: int
    #: r >= 1: a resident sample appears up to r times (floor(r) copies plus a seeded coin
    #: with probability frac(r) for one more).
    replay: float
    #: K: every sample is trained at least once every K epochs.
    coverage_epochs: int = 4
    #: Weight of the uniform distribution mixed into the importance distribution.
    floor: float = 0.1

    def __post_init__(self) -> None:
        if self.epoch < 0 or self.seed < 0:
            raise ValueError(f"epoch and seed must be >= 0, got {self.epoch}, {self.seed}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"bad rank {self.rank} for world size {self.world_size}")
        if not (math.isfinite(self.replay) and self.replay >= 1.0):
            raise ValueError(f"replay must be a finite number >= 1, got {self.replay}")
        if self.coverage_epochs < 1:
            raise ValueError(f"coverage_epochs must be >= 1, got {self.coverage_epochs}")
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"floor must be in [0, 1], got {self.floor}")


@functools.lru_cache(maxsize=1)
def _coverage_permutation(seed: int, n: int) -> np.ndarray:
    """Seed-only permutation whose K contiguous chunks are the coverage strata.

    Cached (one job per daemon is the common case) because it is the same for every epoch
    and costs about 0.1 s at 1.28 M; int32 keeps it at 4 bytes per sample.
    """
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_COVERAGE_STREAM,)))
    perm = rng.permutation(n).astype(np.int32 if n < 2**31 else np.int64)
    perm.setflags(write=False)
    return perm


def _mandatory(seed: int, n: int, k: int, epoch: int) -> np.ndarray:
    """Mask of this epoch's coverage stratum: chunk ``epoch % k`` of the seed's permutation.

    The chunks partition the samples (sizes differ by at most one), so any k consecutive
    epochs visit every chunk once: every sample is mandatory once every k epochs.
    """
    stratum = epoch % k
    lo = -(-stratum * n // k)
    hi = -(-(stratum + 1) * n // k)
    mask = np.zeros(n, dtype=bool)
    mask[_coverage_permutation(seed, n)[lo:hi]] = True
    return mask


def _take(demand: np.ndarray, keys: np.ndarray, budget: int) -> np.ndarray:
    """Grant slots to ``demand`` in descending ``keys`` order until ``budget`` runs out.

    Returns the number of slots granted per entry; the last entry served may get a part of
    its demand.
    """
    total = int(demand.sum())
    if total <= budget:
        return demand.copy()
    granted = np.zeros_like(demand)
    if budget <= 0:
        return granted
    if total == len(demand):
        # Unit demand (the misses): an O(n) selection of the top keys, no full sort.
        granted[np.argpartition(-keys, budget - 1)[:budget]] = 1
        return granted
    order = np.argsort(-keys, kind="stable")
    wanted = demand[order]
    before = np.cumsum(wanted) - wanted
    granted[order] = np.clip(budget - before, 0, wanted)
    return granted


def copy_counts(scores: np.ndarray, resident: np.ndarray, params: OrderParams) -> np.ndarray:
    """How many times each sample appears in the epoch (int64[N], summing to N).

    The multiset of ``build_global_order`` without the placement step: cheaper when only
    the epoch's contents matter (a policy asking which samples the epoch needs, tests).
    """
    counts, _ = _counts_and_rng(scores, resident, params)
    return counts


def _counts_and_rng(
    scores: np.ndarray, resident: np.ndarray, params: OrderParams
) -> tuple[np.ndarray, np.random.Generator]:
    scores = np.asarray(scores, dtype=np.float64)
    resident = np.asarray(resident, dtype=bool)
    n = len(scores)
    if scores.ndim != 1 or resident.shape != scores.shape:
        raise ValueError(f"scores {scores.shape} and resident {resident.shape} do not match")
    rng = np.random.default_rng(
        np.random.SeedSequence([params.seed, params.epoch], spawn_key=(_EPOCH_STREAM,))
    )
    if n == 0:
        return np.zeros(0, dtype=np.int64), rng

    mandatory = _mandatory(params.seed, n, params.coverage_epochs, params.epoch)

    # Importance priority: Gumbel-top-k draws without replacement with probability p, and
    # the floor keeps every sample reachable (zero-score samples included).  The key
    # log(p) + Gumbel equals log(p / E) with E ~ Exp(1), so p / E sorts the same way and
    # costs no logarithm (the exponential race; 3x faster than rng.gumbel at 1.28 M).
    s = np.where(np.isfinite(scores) & (scores > 0.0), scores, 0.0)
    total = float(s.sum())
    if total > 0.0:
        p = (1.0 - params.floor) * (s / total) + params.floor / n
    else:
        p = np.full(n, 1.0 / n)
    keys = p / rng.standard_exponential(n)

    # Copies wanted by each resident sample: floor(r) plus a seeded coin for the fraction.
    # The coin is drawn for all n samples so the stream does not depend on the resident set.
    whole = math.floor(params.replay)
    frac = params.replay - whole
    coin = rng.random(n) < frac
    want = np.where(resident, whole + coin.astype(np.int64), 1)

    counts = mandatory.astype(np.int64)
    budget = n - int(counts.sum())
    # Who gets the remaining slots, class by class: first copies of resident samples (cheap
    # hits, and diversity before repetition), then replay copies, and last the misses in
    # importance order, so replay copies replace the lowest-priority non-mandatory misses.
    first_hits = np.flatnonzero(resident & ~mandatory)
    replays = np.flatnonzero(resident)
    misses = np.flatnonzero(~resident & ~mandatory)
    # Every resident's first copy is already covered (mandatory, or the first_hits class,
    # which exhausts the budget before this class if it is cut short).
    extra = want[replays] - 1
    for ids, demand in (
        (first_hits, np.ones(len(first_hits), dtype=np.int64)),
        (replays, extra),
        (misses, np.ones(len(misses), dtype=np.int64)),
    ):
        if budget <= 0:
            break
        granted = _take(demand, keys[ids], budget)
        counts[ids] += granted
        budget -= int(granted.sum())
    return counts, rng


def build_global_order(scores: np.ndarray, resident: np.ndarray, params: OrderParams) -> np.ndarray:
    """The whole job's epoch list: int64[N], identical on every rank (``params.rank`` unused)."""
    counts, rng = _counts_and_rng(scores, resident, params)
    n = len(counts)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    entries = np.repeat(np.arange(n, dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    copy_index = np.arange(len(entries), dtype=np.int64) - np.repeat(first, counts)
    # Copy j of a sample with c copies goes to a uniform spot in segment j of c: misses land
    # anywhere, replays are spread out, and each part of the epoch gets its share of hits.
    # An independent spot per copy keeps the hits from repeating in the same relative order
    # in each segment (which would put the same samples in the same batches again).
    pos = (copy_index + rng.random(len(entries))) / counts[entries]
    # Sort (position, sample) packed into one uint64 instead of argsorting the positions:
    # np.sort of plain integers is about 7x faster than argsort at 1.28 M, and equal keys
    # are the same sample, so the result cannot depend on the sort's tie handling.
    id_bits = max(1, (n - 1).bit_length())
    # At most 52 position bits, so pos_max is exact in float64 and the shift cannot overflow.
    pos_max = (1 << min(52, 64 - id_bits)) - 1
    quantised = np.minimum(pos * float(pos_max + 1), float(pos_max)).astype(np.uint64)
    keys = (quantised << np.uint64(id_bits)) | entries.astype(np.uint64)
    keys.sort()
    order = (keys & np.uint64((1 << id_bits) - 1)).astype(np.int64)
    log.debug(
        "epoch %d: %d entries, %d distinct, %d resident entries",
        params.epoch,
        len(order),
        int(np.count_nonzero(counts)),
        int(counts[np.asarray(resident, dtype=bool)].sum()),
    )
    result: np.ndarray = order
    return result


def rank_slice(order: np.ndarray, world_size: int, rank: int) -> np.ndarray:
    """DistributedSampler-style share: pad by wrapping to a multiple of world_size, stride."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad rank {rank} for world size {world_size}")
    length = len(order)
    if length == 0:
        return np.empty(0, dtype=np.int64)
    padded = -(-length // world_size) * world_size
    # Index arithmetic instead of materialising the padded list; the modulo wraps as many
    # times as needed when world_size > N, like DistributedSampler.
    return np.asarray(order, dtype=np.int64)[np.arange(rank, padded, world_size) % length]


def build_order(scores: np.ndarray, resident: np.ndarray, params: OrderParams) -> np.ndarray:
    """This rank's share of the epoch's global order."""
    return rank_slice(build_global_order(scores, resident, params), params.world_size, params.rank)


class ReplayController:
    """Adapts r to the training progress the sampler reports: more replay while validation
    accuracy (or, without it, training loss) improves, less when it stalls; bounded to
    [r_min, r_max].

    Progress is the mean of the last ``window`` per-report changes: absolute changes of
    validation accuracy, or relative decreases of training loss.  Above ``tolerance`` the
    model is still learning from what it sees, so replaying cheap cached samples is worth
    it; at or below it the model may be overfitting the replayed subset, so r steps down
    towards plain epochs (SHADE's aggressive/relaxed switch, made gradual).
    """

    def __init__(
        self,
        r_init: float = 3.0,
        r_min: float = 1.0,
        r_max: float = 4.0,
        window: int = 3,
        *,
        step: float = 0.5,
        tolerance: float = 1e-3,
    ) -> None:
        if not 1.0 <= r_min <= r_init <= r_max or not math.isfinite(r_max):
            raise ValueError(f"need 1 <= r_min <= r_init <= r_max, got {r_min}, {r_init}, {r_max}")
        if window < 1 or step <= 0 or tolerance < 0:
            raise ValueError("window must be >= 1, step > 0 and tolerance >= 0")
        self.r: float = float(r_init)
        self.r_min = float(r_min)
        self.r_max = float(r_max)
        self.window = int(window)
        self.step = float(step)
        self.tolerance = float(tolerance)
        self._accuracy: list[float] = []
        self._loss: list[float] = []

    def report(
        self, *, train_loss: float | None = None, val_accuracy: float | None = None
    ) -> float:
        """Record one epoch's figures and return the new r."""
        if train_loss is None and val_accuracy is None:
            raise ValueError("report needs train_loss or val_accuracy")
        for name, value in (("train_loss", train_loss), ("val_accuracy", val_accuracy)):
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value}")
        if train_loss is not None:
            self._loss.append(float(train_loss))
            del self._loss[: -(self.window + 1)]
        if val_accuracy is not None:
            self._accuracy.append(float(val_accuracy))
            del self._accuracy[: -(self.window + 1)]

        progress = self._progress(use_accuracy=val_accuracy is not None)
        if progress is None:
            return self.r
        old = self.r
        if progress > self.tolerance:
            self.r = min(self.r_max, self.r + self.step)
        else:
            self.r = max(self.r_min, self.r - self.step)
        if self.r != old:
            log.debug("replay r %.2f -> %.2f (progress %.4g)", old, self.r, progress)
        return self.r

    def _progress(self, *, use_accuracy: bool) -> float | None:
        """Mean recent improvement, or None before two reports of the signal exist."""
        if use_accuracy:
            acc = np.asarray(self._accuracy)
            return float(np.diff(acc).mean()) if len(acc) >= 2 else None
        loss = np.asarray(self._loss)
        if len(loss) < 2:
            return None
        prev = np.maximum(np.abs(loss[:-1]), 1e-12)
        return float(((loss[:-1] - loss[1:]) / prev).mean())
