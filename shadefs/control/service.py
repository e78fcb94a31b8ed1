"""What the control directory needs from the daemon: one narrow interface.

Control parses and validates what a client writes, then calls the methods below, which hold
the business logic (switching policies, evicting, building epoch orders, installing plans).
The daemon's service object (shadefs/service.py) implements them; control sees it only as a
`ControlService`, so it never imports the daemon, the cache or the prefetcher.

The contract for every method that takes client input: it raises `Rejected`, with a
one-line reason, for input it refuses, and then it has changed nothing. Control turns that
into EINVAL. A ctl write calls the checking methods (`resolve_files`, the properties) for
every line before it calls any method that changes state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shadefs.sampling.wire import OrderRequest
from shadefs.sampling.wire_nodes import NodeOrder

RESIDENCY_STATES = ("none", "ram", "ssd", "missing")


class Rejected(ValueError):
    """Input the daemon refuses (EINVAL); the message says why, in one line."""


@dataclass(frozen=True)
class DatasetInfo:
    """What reading `.shadefs/dataset` shows."""

    samples: int
    registered_at: float  # time.time() of the registration, 0 if none
    resolved: int  # samples whose file was found in the mount


class ControlService(Protocol):
    """The daemon as the control directory sees it."""

    # --- what can be asked for ----------------------------------------------------------

    @property
    def policy_names(self) -> Sequence[str]:
        """The policies `set_policy` accepts."""
        ...

    @property
    def has_ssd(self) -> bool:
        """Whether the mount has an SSD tier (`set_ssd` needs one)."""
        ...

    @property
    def prefetching(self) -> bool:
        """Whether the mount prefetches (plans need it)."""
        ...

    def plan_names(self) -> list[str]:
        """The prefetch plans now active, by name."""
        ...

    async def resolve_files(self, rels: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """(cache keys as uint64, sizes as int64) of regular files given relative to the
        mount root; Rejected naming the first path that is not one."""
        ...

    async def residency(self, rels: list[bytes]) -> list[str]:
        """For each relative path, one of RESIDENCY_STATES."""
        ...

    # --- ctl commands, applied once every line of a write is valid ----------------------

    def set_policy(self, name: str) -> None:
        """Switch every tier to a fresh policy `name` (one of policy_names)."""
        ...

    def set_ram(self, size: int) -> None:
        """Set the RAM budget in bytes; shrinking evicts at once."""
        ...

    async def set_ssd(self, size: int) -> None:
        """Set the SSD budget in bytes (only when has_ssd)."""
        ...

    def drop_ram(self) -> int:
        """Forget every file cached in RAM; returns how many."""
        ...

    async def evict(self, keys: np.ndarray) -> int:
        """Drop these cache keys from every tier; returns how many were cached."""
        ...

    def prefetch(
        self, rels: list[bytes], keys: np.ndarray, sizes: np.ndarray, name: str | None = None
    ) -> str:
        """Fetch these files ahead, in this order (only when prefetching): a plan named
        `name` (replacing one of that name), or a fresh name; returns the name."""
        ...

    def drop_plans(self, names: Sequence[str]) -> int:
        """Forget these prefetch plans; returns how many there were."""
        ...

    def begin_epoch(self, epoch: int, pid: int = 0) -> None:
        """The job of process `pid` (0: every job) starts epoch `epoch`."""
        ...

    def name_job(self, pid: int, name: str, group: str) -> None:
        """Process `pid`'s job is called `name`, in sweep group `group` ("" for none)."""
        ...

    def report(
        self,
        epoch: int | None,
        train_loss: float | None,
        val_accuracy: float | None,
        pid: int = 0,
    ) -> str:
        """End-of-epoch progress of process `pid`'s job; returns the resulting replay
        factor, as a sentence."""
        ...

    def set_replay(self, value: float | None) -> None:
        """Fix the replay factor (1 to 64), or None to let the daemon adapt it."""
        ...

    def set_log_level(self, level: str) -> None:
        """Set the daemon's log level (debug, info, warning or error)."""
        ...

    # --- the sampler's channel ----------------------------------------------------------

    async def register_dataset(self, paths: list[str]) -> None:
        """Adopt `paths` (relative to the mount root) as the sampler's dataset."""
        ...

    def dataset_info(self) -> DatasetInfo: ...

    def ingest_losses(self, message: bytes) -> int:
        """Feed one losses message (wire format SHDL) to the importance table; returns the
        number of losses."""
        ...

    async def order(self, request: OrderRequest, pid: int = 0) -> np.ndarray:
        """The requesting rank's share of the epoch order, as sample ids; from then on the
        daemon prefetches it for that rank. `pid`: the requesting process (its job's group
        shares one order per epoch)."""
        ...

    async def resident_bitmap(self, n: int) -> np.ndarray:
        """bool[n]: which registered samples this node holds (Rejected unless n samples
        are registered)."""
        ...

    async def install_order(self, msg: NodeOrder) -> np.ndarray:
        """Adopt a multi-node job's epoch (wire_nodes.py); returns the global order."""
        ...
