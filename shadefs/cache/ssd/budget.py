"""The SSD tier's budget for a cache directory: chosen once, recorded in DIR/budget.

A budget recomputed from the free space at every mount would shrink on each remount by what
the cache itself already occupies, so the first mount's choice is kept in the directory and
reused by later mounts that give no SIZE.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from shadefs.cache.ssd.owner import check_owner

log = logging.getLogger(__name__)


def ssd_defaults(path: str, size: int | None, min_free: int | None) -> tuple[int, int]:
    """(budget, free-space floor) for a cache directory.

    By default the floor is 5% of the cache filesystem (at most 1 GiB) and the budget 80% of
    what is free above it when the cache is created. The budget is recorded in DIR/budget
    and reused by later mounts that give no SIZE: recomputed from the free space, it would
    shrink on every remount by what the cache itself already occupies.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    # Nothing is written into a directory that someone else could have prepared.
    check_owner(os.stat(path), f"cache directory {path}")
    sv = os.statvfs(path)
    total, free = sv.f_blocks * sv.f_frsize, sv.f_bavail * sv.f_frsize
    floor = min(total // 20, 1 << 30) if min_free is None else min_free
    record = Path(path) / "budget"
    if size is None:
        try:
            size = int(record.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            size = int(max(free - floor, 0) * 0.8)
    try:
        tmp = record.with_suffix(".tmp")
        tmp.write_text(f"{size}\n")
        tmp.replace(record)
    except OSError as exc:
        log.warning("cannot record the SSD budget in %s: %s", record, exc.strerror)
    return size, floor
