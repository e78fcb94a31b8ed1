"""Which files the kernel may hold pages of, and how often it held a deferred open's.

The kernel keeps a file's pages in its page cache of the mount for as long as it keeps the
inode and has the memory; a keep_cache open then lets it serve reads without asking the
daemon. The daemon cannot see those pages. What it knows:

- the kernel holds no pages of an inode it has not opened since it last forgot it (a
  forget drops the kernel's inode with its pages). `opened` keeps that per inode in a
  fixed bytearray indexed by the inode number's low bits: one byte a slot, no per-file
  object (docs/design.md §6); a collision says "may hold" for a file that does not, which only
  costs what a wrong guess costs below;
- how often a deferred open (cache/deferred.py: a miss answered before its fetch) was released
  without a read, that is, served from the kernel's pages: `held`, a moving average over
  the recent deferred opens. With a dataset that the page cache holds it stays near 1;
  with one larger than the machine's memory the kernel has reclaimed most pages of files
  opened an epoch ago, and it falls towards 0.

Speculation (prefetch/speculate.py) reads both: while `trusted` (most deferred opens were the
kernel's), it does not stage files the kernel may hold; otherwise it stages them as any
other, since the kernel's pages of files opened earlier are mostly gone. The opens read it
too (`worth_deferring`): a deferred open costs a version check at the source (one lstat in
a worker thread) before the fetch that its read then needs anyway, so while the kernel's
pages are mostly gone only one open in `_PROBE` is deferred, which keeps `held` measured.
Everything here runs in the trio thread.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["BulkDrops", "KernelPages"]

_SLOTS = 1 << 22
_MASK = _SLOTS - 1
_WEIGHT = 1 / 32  # of the newest deferred open in `held`
_PROBE = 16  # while not trusted, one open in this many is still deferred


class KernelPages:
    """:held: the recent share of deferred opens that the kernel served without a read"""

    __slots__ = ("_opened", "_view", "held", "_untrusted")

    def __init__(self) -> None:
        self._opened = bytearray(_SLOTS)
        self._view = np.frombuffer(self._opened, dtype=np.uint8)  # the same bytes
        self.held = 1.0  # until told otherwise: a reopen is the kernel's
        self._untrusted = 0  # opens asked about while not trusted

    def opened(self, ino: int) -> bool:
        """An open of `ino`: whether one came before it since the kernel last forgot it."""
        i = ino & _MASK
        seen = self._opened[i]
        self._opened[i] = 1
        return seen != 0

    def forget(self, inos: Iterable[int]) -> None:
        """The kernel dropped these inodes, and their pages with them."""
        opened = self._opened
        for ino in inos:
            opened[ino & _MASK] = 0

    def holds(self, ino: int) -> bool:
        """Whether the kernel may hold pages of `ino` (`may_hold` of one)."""
        return self._opened[ino & _MASK] != 0

    def may_hold(self, keys: np.ndarray) -> np.ndarray:
        """Per key (uint64 inode numbers): whether the kernel may hold pages of it."""
        return np.asarray(self._view[keys & np.uint64(_MASK)] != 0)

    def served(self, unread: bool) -> None:
        """A deferred open ended: released unread (the kernel's pages) or read."""
        self.held += ((1.0 if unread else 0.0) - self.held) * _WEIGHT

    def worth_deferring(self) -> bool:
        """Whether an open of a file the kernel may hold should be answered before its
        fetch: while trusted, yes; otherwise one in `_PROBE`, to notice when it is again."""
        if self.trusted:
            return True
        self._untrusted += 1
        return self._untrusted % _PROBE == 0

    @property
    def trusted(self) -> bool:
        """Whether the kernel served most of the recent deferred opens itself."""
        return self.held >= 0.5


#: After two reads of resident bytes within this many handles, reopens push their bytes to
#: the kernel with their open for this many handles (`BulkDrops`).
REPUSH = 64


class BulkDrops:
    """Whether the kernel has lately been dropping pages in bulk, as judged by the handles
    of resident bytes whose first read reached the daemon (the kernel lacked their pages).

    Two such reads within REPUSH handles of each other say it did (memory pressure, a
    page-cache drop between epochs), and would send READs for the reopens that follow: for
    the next REPUSH handles, a reopen pushes its bytes with its open (kernel/notify.py,
    `push_pages`). A read on its own (one file's pages aged out, as the page-out daemon
    does now and then) pushes nothing. Handles are numbered in the order of the opens.
    """

    __slots__ = ("_read", "_bulk")

    def __init__(self) -> None:
        self._read = -(1 << 62)  # the last handle of resident bytes that was read
        self._bulk = -(1 << 62)  # the last such read within REPUSH of the one before

    def read(self, fh: int) -> None:
        """The first read of handle `fh`, of resident bytes, reached the daemon."""
        if fh - self._read <= REPUSH:
            self._bulk = fh
        self._read = fh

    def push(self, fh: int) -> bool:
        """Whether the open of handle `fh` should push its bytes to the kernel."""
        return fh - self._bulk <= REPUSH
