"""Policies on shuffled-epoch traces: the epoch policy reaches f, LRU thrashes at ~f^2/2."""

from __future__ import annotations

import numpy as np
import pytest

from shadefs.cache.policies import EpochPolicy, LruPolicy, Policy, make_policy


def simulate(policy: Policy, sizes: np.ndarray, capacity: int, epochs: int, seed: int = 0):
    """Drive a policy like the cache does; return per-epoch hit ratios and peak bytes."""
    rng = np.random.default_rng(seed)
    resident: dict[int, int] = {}
    used = peak = 0
    ratios = []
    for _ in range(epochs):
        hits = 0
        for key in rng.permutation(len(sizes)):
            key = int(key)
            size = int(sizes[key])
            hit = key in resident
            if isinstance(policy, EpochPolicy):
                policy.tracker.read(key, 0)  # the cache tells the readers' tracker first
            policy.accessed(key, hit)
            if hit:
                hits += 1
                continue
            victims = policy.admit(key, size, capacity - used)
            if victims is None:
                continue
            for v in victims:
                used -= resident.pop(v)
                policy.removed(v)
            assert used + size <= capacity, "policy returned too few victims"
            resident[key] = size
            used += size
            policy.inserted(key, size)
            peak = max(peak, used)
        ratios.append(hits / len(sizes))
    return ratios, peak


@pytest.mark.parametrize("seed", [0, 1])
def test_epoch_policy_reaches_cache_fraction(seed: int) -> None:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(50_000, 150_000, size=2000)
    capacity = int(0.2 * sizes.sum())
    ratios, peak = simulate(EpochPolicy(), sizes, capacity, epochs=5, seed=seed)
    assert peak <= capacity
    assert ratios[0] == 0.0
    # Every later epoch hits about the fraction of files that fit (object ratio ~ f).
    assert min(ratios[1:]) >= 0.18, ratios


def test_lru_thrashes_under_shuffled_epochs() -> None:
    sizes = np.full(4000, 100_000)
    capacity = int(0.2 * sizes.sum())
    ratios, peak = simulate(LruPolicy(), sizes, capacity, epochs=5)
    assert peak <= capacity
    steady = float(np.mean(ratios[1:]))
    # Theory: f + (1 - f) ln(1 - f) = 0.0215 at f = 0.2.
    assert 0.005 < steady < 0.045, ratios


def _read(p: EpochPolicy, key: int, hit: bool = True, job: int = 0) -> None:
    """A read as the cache reports it: to the readers' tracker, then to the policy."""
    p.tracker.read(key, job)
    p.accessed(key, hit, job)


def test_epoch_policy_infers_epochs_and_protects_unread() -> None:
    p = EpochPolicy()
    for k in range(3):
        _read(p, k, hit=False)
        p.inserted(k, 10)
    assert p.epoch == 0
    _read(p, 0)  # 0 was read in epoch 0, and so was all the job read: a new pass began
    assert p.epoch == 1
    # 1 and 2 were read last epoch and not yet this one: protected, not victims.
    _read(p, 99, hit=False)
    assert p.admit(99, 10, 0) is None
    # Shrinking takes the consumed entry (0) before the protected ones.
    assert p.shrink(10) == [0]
    assert p.shrink(25)[:1] == [0] and len(p.shrink(25)) == 3


def test_epoch_policy_evicts_stale_entries_for_new_files() -> None:
    p = EpochPolicy()
    for k in (1, 2):
        _read(p, k, hit=False)
        p.inserted(k, 10)
    p.tracker.announce(3)  # neither was read in epochs 1-2: they are no longer being read
    assert p.admit(3, 15, 0) == [1, 2]


def test_explicit_epochs_switch_off_inference() -> None:
    p = EpochPolicy()
    p.tracker.announce(0)
    _read(p, 1, hit=False)
    p.inserted(1, 10)
    _read(p, 1)  # a replay within the same epoch, not a new epoch
    _read(p, 2, hit=False)
    _read(p, 1, hit=False)
    assert p.epoch == 0


def test_lru_order_and_refusal() -> None:
    p = LruPolicy()
    for k in (1, 2, 3):
        p.inserted(k, 10)
    p.accessed(1, True)
    assert p.admit(4, 10, 0) == [2]
    assert p.admit(4, 15, 0) == [2, 3]
    assert p.admit(4, 100, 0) is None
    assert p.admit(4, 5, 10) == []


def test_make_policy_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")


def test_restored_entries_are_protected_and_do_not_start_epochs() -> None:
    p = EpochPolicy()
    for k in range(5):
        p.restored(k, 10)
    for k in range(5):
        _read(p, k)  # first reads after a restart: still epoch 0
    assert p.epoch == 0
    _read(p, 0)  # read again after the whole pass: now a new epoch has begun
    assert p.epoch == 1


def test_ranked_walks_never_offer_an_entry_twice() -> None:
    """A score that drops below entries already offered must not shift one of them back
    under the walk (that returned [0, 1, 1] and crashed the cache with a KeyError)."""
    from shadefs.cache.policies import BeladyPolicy, ShadePolicy

    scores = {k: float(k) for k in range(6)}
    shade = ShadePolicy(lambda k: scores[k])
    for k in range(5):
        shade.inserted(k, 1)
    scores[2], scores[9] = -1.0, 10.0
    victims = shade.admit(9, 3, 0)
    assert victims is not None and len(set(victims)) == 3 and 2 in victims
    assert sorted(shade.shrink(5)) == [0, 1, 2, 3, 4]

    uses = {k: float(k) for k in range(6)}
    belady = BeladyPolicy(lambda k: uses[k])
    for k in range(5):
        belady.inserted(k, 1)
    uses[2], uses[9] = 99.0, -1.0  # 2 is now needed last of all
    victims = belady.admit(9, 3, 0)
    assert victims is not None and len(set(victims)) == 3 and victims[0] in (4, 2) and 2 in victims
