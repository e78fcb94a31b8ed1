"""Reads still to come this epoch: what the known orders will read again, per sample.

The daemon builds every epoch order that a `ShadeSampler` reads, so it knows how many
times each sample will be read this epoch (PADS replays resident samples, r copies each).
A resident sample that is evicted before its last read is fetched again later in the same
epoch: bytes over the link twice, and a stall for a sample that was a hit when the order
was made. `PendingReads` counts, per sample, the reads still to come; the `shade` policy
keeps an entry with reads to come above every entry without (cache/policies/shade.py), so
it is not evicted for a miss until the epoch has read it for the last time.

The counts are exact for one job on one node, whatever its number of ranks (the order is
built once and holds every rank's share), for a multi-node job (this node's ranks' shares)
and for a sweep group (its members read one order each). Several jobs' orders of one epoch
add up; an order of a later epoch than the counts' starts them afresh, so a job that runs
ahead cuts the protection of one that runs behind short: it then fetches a little more,
never wrongly. Counts of a job that stops mid-epoch stay until the next order is built;
they only keep entries resident.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


class PendingReads:
    """`left[sample]`: the reads of the current epoch's known orders not yet seen."""

    def __init__(self, sample_of: Callable[[int], int]) -> None:
        """`sample_of(key)`: the sample id of a cache key, or -1 outside the dataset."""
        self.sample_of = sample_of
        self.left = np.zeros(0, dtype=np.int32)
        self.epoch = -1  # no order yet: reads cost one comparison

    def reset(self, n: int) -> None:
        """A new dataset of `n` samples: nothing is pending."""
        self.left = np.zeros(n, dtype=np.int32)
        self.epoch = -1

    def expect(self, epoch: int, samples: np.ndarray, readers: int = 1) -> None:
        """This node's readers will read `samples` (ids, repeats counted) in `epoch`;
        `readers` times (the members of a sweep group read one order each)."""
        if epoch > self.epoch:
            self.left[:] = 0
            self.epoch = epoch
        if len(samples):
            counts = np.bincount(samples, minlength=len(self.left)).astype(np.int32)
            counts *= max(1, readers)
            if len(counts) > len(self.left):  # ids past the registered ones (a test's table)
                counts[: len(self.left)] += self.left
                self.left = counts
            else:
                self.left += counts

    def read(self, key: int) -> None:
        """One open of `key`: one pending read fewer (the cache calls this on every open)."""
        if self.epoch < 0:
            return
        sid = self.sample_of(key) if key >= 0 else -1
        if sid >= 0 and self.left[sid] > 0:
            self.left[sid] -= 1

    def pending(self, key: int) -> bool:
        """Whether a known order reads `key` again this epoch."""
        if self.epoch < 0 or key < 0:
            return False
        sid = self.sample_of(key)
        return sid >= 0 and bool(self.left[sid] > 0)
