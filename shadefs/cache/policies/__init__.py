"""Cache policies: pure decision objects that never do I/O and never take locks.

One module per policy, all on the interface in `base` (`Policy`):

- `lru`: the baseline, which shuffled epochs defeat.
- `epoch` (the default): keep what has not been read this epoch; reaches the hit ratio
  f = cache/dataset on shuffled epochs.
- `shade`: keep the samples the training job finds most important (SHADE's APP).
- `belady`: evict what a known order reads furthest in the future.

`make_policy` builds one by name; `POLICIES` lists the names the control file accepts.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from shadefs.cache.policies.base import Policy
from shadefs.cache.policies.belady import BeladyPolicy
from shadefs.cache.policies.epoch import EpochPolicy
from shadefs.cache.policies.lru import LruPolicy
from shadefs.cache.policies.owned import Owned
from shadefs.cache.policies.shade import ShadePolicy
from shadefs.readers.tracker import Tracker

__all__ = [
    "POLICIES",
    "BeladyPolicy",
    "EpochPolicy",
    "LruPolicy",
    "Owned",
    "Policy",
    "ShadePolicy",
    "make_policy",
]

POLICIES = ("epoch", "lru", "shade", "belady")


def make_policy(
    name: str,
    score: Callable[[int], float] | None = None,
    next_use: Callable[[int], float] | None = None,
    owns: Callable[[int], bool] | None = None,
    pending: Callable[[int], bool] | None = None,
    tracker: Tracker | None = None,
) -> Policy:
    """A fresh policy by name; `shade` ranks by `score` (neutral for every key if None),
    `belady` by `next_use` (every key infinitely far if None), `epoch` by the demand that
    the readers' `tracker` counts (a fresh one if None). With `owns`, admission favours
    the keys this node owns in a multi-node job (`Owned`). `shade` and `epoch` keep what
    `pending` says the known orders still read."""
    policy = _make(name, score, next_use, pending, tracker)
    return Owned(policy, owns) if owns is not None else policy


def _make(
    name: str,
    score: Callable[[int], float] | None,
    next_use: Callable[[int], float] | None,
    pending: Callable[[int], bool] | None = None,
    tracker: Tracker | None = None,
) -> Policy:
    if name == "epoch":
        return EpochPolicy(tracker, pending)
    if name == "lru":
        return LruPolicy()
    if name == "shade":
        return ShadePolicy(score or (lambda key: 0.5), pending)
    if name == "belady":
        return BeladyPolicy(next_use or (lambda key: math.inf))
    raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
