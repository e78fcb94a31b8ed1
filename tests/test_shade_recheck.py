"""`shade` after a new order: the kept entries are checked again a batch per admission,
never all at once in the event loop, and only when an order may have released some."""

from __future__ import annotations

from shadefs.cache.policies import ShadePolicy


def _policy(n: int, pending: set[int]) -> ShadePolicy:
    p = ShadePolicy(lambda k: 0.9 if k >= n else 0.5, lambda k: k in pending)
    for k in range(n):
        p.inserted(k, 1)
    return p


def test_kept_entries_are_checked_again_a_batch_per_admission() -> None:
    n = 2 * ShadePolicy.RECHECK + 10
    pending = set(range(n))
    p = _policy(n, pending)
    assert p.describe().kept == n
    pending.clear()  # the next order reads none of them again
    p.begin_epoch(1, job=0)
    assert p.describe().kept == n  # the order's request checked nothing
    for left in (n - ShadePolicy.RECHECK, n - 2 * ShadePolicy.RECHECK, 0):
        victims = p.admit(n + left, 1, 0)  # a more important file needs room
        assert p.describe().kept == left
    assert victims is not None and len(victims) == 1 and victims[0] < n


def test_only_an_order_that_may_release_reads_starts_a_check() -> None:
    # 0-9 are kept (low scores: first to go once released), 10-19 are not, 100+ arrive.
    pending = set(range(10))
    p = ShadePolicy(lambda k: 0.1 if k < 10 else 0.5 if k < 100 else 0.9, pending.__contains__)
    for k in range(20):
        p.inserted(k, 1)
    p.begin_epoch(1, job=0)
    assert p.admit(100, 1, 0) == [10]  # checked again: still read by the order, still kept
    pending.clear()
    p.begin_epoch(1, job=0)  # another rank of job 0's epoch 1: it released nothing
    p.begin_epoch(1, job=0)
    assert p.admit(101, 1, 0) == [10] and p.describe().kept == 10
    p.begin_epoch(1, job=1)  # another job's first order: it may have
    assert p.admit(102, 1, 0) == [0] and p.describe().kept == 0
