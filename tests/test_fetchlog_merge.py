"""The fetch log's sorted keys after many merges of its small buffer: every key noted is
found, and only a key noted before counts as a refetch."""

from __future__ import annotations

import numpy as np

from shadefs.cache.fetchlog import FetchLog


def test_keys_merged_batch_by_batch_stay_found() -> None:
    log = FetchLog()
    keys = np.random.default_rng(0).permutation(10_000)[:3000].tolist()
    assert not any(log.note(k, 1) for k in keys)  # several merges of 512
    assert all(k in log for k in keys)
    assert not any(k in log for k in range(10_000, 10_100))
    assert all(log.note(k, 1) for k in keys[::7]) and log.refetches == len(keys[::7])
    assert np.all(np.diff(log._sorted.astype(np.int64)) > 0)  # sorted, no key twice
