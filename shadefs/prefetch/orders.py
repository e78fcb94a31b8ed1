"""The prefetch plans of known orders: a rank's share of an epoch's order, read back by the
sampler, whose misses are fetched ahead of the rank's reads.

One plan per (seed, or sweep group; world size; rank). The members of a sweep group share
one plan, the furthest ahead's: a member that asks for an earlier epoch's order leaves it in
place. Gathering and sorting a plan of a whole epoch takes long, so a worker thread does it
over the registered arrays (a registration replaces them, never mutates them), and the plan
is installed only if no later epoch's plan took its name meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import trio

from shadefs.prefetch.plans import Plan, order_name
from shadefs.prefetch.prefetcher import Prefetcher

__all__ = ["OrderPlans"]


class Paths(Protocol):
    """The registered dataset's paths (sampling/registry.py's PathTable)."""

    def take(self, ids: np.ndarray) -> Sequence[bytes]: ...


class OrderPlans:
    """The plans of the known orders that ranks reading through this node asked for."""

    def __init__(self, prefetcher: Prefetcher) -> None:
        self.prefetcher = prefetcher
        self._epochs: dict[str, int] = {}  # plan name -> the epoch of its order

    async def install(
        self,
        *,
        epoch: int,
        seed: int,
        group: str,
        members: int,
        world_size: int,
        rank: int,
        dataset: tuple[np.ndarray, Paths, np.ndarray],
        share: np.ndarray,
    ) -> None:
        """Install the plan of `share` (sample ids into `dataset`: keys, paths, sizes), the
        order of `epoch` for `rank` of `world_size`, read by `members` jobs of `group`."""
        name = order_name(seed, group, world_size, rank)
        plan = self.prefetcher.plans.get(name)
        if group and plan is not None and self._epochs.get(name, -1) >= epoch:
            plan.readers = members
            return
        self._epochs[name] = epoch
        keys, paths, sizes = dataset
        plan = await trio.to_thread.run_sync(_plan_of, name, keys, paths, sizes, share)
        if self._epochs.get(name) != epoch:
            return  # a later epoch's plan was installed meanwhile
        plan.readers = members
        self.prefetcher.add_plan(plan)


def _plan_of(
    name: str, keys: np.ndarray, paths: Paths, sizes: np.ndarray, share: np.ndarray
) -> Plan:
    """The plan of `share` (in any thread: it reads only its arguments)."""
    return Plan(name, keys[share], paths.take(share), sizes[share])
