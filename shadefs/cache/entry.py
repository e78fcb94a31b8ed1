"""A resident file of the RAM tier (cache/coordinator.py's entries)."""

from __future__ import annotations

from typing import NamedTuple

from shadefs.file_version import Signature

__all__ = ["Entry"]


class Entry(NamedTuple):
    """A resident file: its bytes, its source file's signature and hash() of the path it
    was read by (an inode number reused within a timestamp tick has the same signature)."""

    data: bytes
    sig: Signature
    where: int = 0
