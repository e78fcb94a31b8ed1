"""The entries of the control directory and the state of one open control file.

Shared by files.py (which serves them), commands.py (`ctl`) and channel.py (the sampler's
channel and the line files).
"""

from __future__ import annotations

import stat
from dataclasses import dataclass

import numpy as np

from shadefs.common import CONTROL_NAME

NAME = CONTROL_NAME.encode()
DIR_INODE = 2
# Control file handles are numbered from here, far above the data path's.
FH_BASE = 1 << 62
# Under kernel hits (no-open mode), every lookup of a control file makes a node of its own,
# numbered from here, above every data inode (fs/inode_numbers.py: below 2**63): the node
# is the open file (files.py, "Sessions").
SESSION_BASE = 1 << 63


@dataclass(frozen=True)
class Spec:
    name: bytes
    ino: int
    mode: int


STATS = Spec(b"stats", 3, stat.S_IFREG | 0o400)
STATS_JSON = Spec(b"stats.json", 4, stat.S_IFREG | 0o400)
CTL = Spec(b"ctl", 5, stat.S_IFREG | 0o600)
METRICS = Spec(b"metrics", 6, stat.S_IFREG | 0o400)
DATASET = Spec(b"dataset", 7, stat.S_IFREG | 0o600)
LOSSES = Spec(b"losses", 8, stat.S_IFREG | 0o200)
ORDER = Spec(b"order", 9, stat.S_IFREG | 0o600)
RESIDENCY = Spec(b"residency", 10, stat.S_IFREG | 0o600)
PLAN = Spec(b"plan", 11, stat.S_IFREG | 0o200)
FILES = (STATS, STATS_JSON, METRICS, CTL, DATASET, LOSSES, ORDER, RESIDENCY, PLAN)
BY_NAME = {s.name: s for s in FILES}
BY_INO = {s.ino: s for s in FILES}
# Binary message streams (the sampler's channel), as opposed to text lines.
STREAMS = (DATASET, LOSSES, ORDER)
# What channel.py takes writes for (ctl is commands.py's).
CHANNEL = (*STREAMS, RESIDENCY, PLAN)


class Handle:
    """One open control file: what reads return, and what writes left half-done."""

    __slots__ = ("spec", "data", "pending", "poisoned", "plan", "owner", "written", "base", "pid")

    def __init__(self, spec: Spec, data: bytes | bytearray, owner: str = "", pid: int = 0) -> None:
        self.spec = spec
        self.data = data  # what reads return
        self.pending = bytearray()  # written bytes not yet processed
        self.poisoned = False
        # A plan being written: (keys, relative paths, sizes) of each complete chunk of lines.
        self.plan: list[tuple[np.ndarray, list[bytes], np.ndarray]] = []
        self.owner = owner  # who opened it, as a plan name
        self.pid = pid  # the process that opened it (its job is the writer's)
        self.written = 0  # bytes written so far (the file offset after the request)
        self.base: int | None = None  # where the response starts in the reader's offsets
