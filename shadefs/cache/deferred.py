"""A miss answered before its fetch: the bytes come with the first read that needs them.

Files evicted from RAM are often still in the kernel's page cache of the mount, and an open
answered with keep_cache lets the kernel serve every read of them from its own pages: a
fetch of the whole file at open would go unread, source bytes for nothing. The file system
therefore asks for a deferred miss (`CacheFace.open(..., lazy=True)`, cache/face.py) when
the kernel may hold pages of the node (kernel/pages.py: opened since the kernel last
forgot it). A wrong guess only changes which path an open takes, never what it serves.

The open does its bookkeeping at once (hit/miss counts, the jobs' reads, the policies'
notes, a staged file taken, the pass-through and handle-limit decisions) and, where it
would fetch, gets a `Deferred` instead: one per handle. Its first read that reaches the
daemon fetches through the cache's ordinary miss path (single flight, joining a prefetch,
admission, the SSD tier's write-behind), pinned for the handle; concurrent first reads
share that fetch. A handle released unread fetches nothing: `HandleLedger.unread` counts
those, and so does `Metrics.kernel_hits` (the kernel served the open from its own pages).
Two misses still fetch at open: one that finds a fetch of the file in flight joins it (the
bytes are on their way; a prefetch landing after the open would be staged for nobody), and
an empty file (no read will ever reach the daemon, which would then never cache it).

The version: the open answered with keep_cache for the version it looked up (`st`; the
file system checked with one lstat that the source still has it). A fetch that meets
another version is never served, since the kernel may have given this handle pages of the
old one: `read` raises `Changed` (the file system makes the node due a check, and its next
open retires it), and every later read of the handle fails the same way, as after any
failed fetch (a retry could mix versions).

The handle-limit rule stays whole: the open reserves the file's size in the ledger, as if
it already held the bytes, so that opens answered before their fetch cannot together pass
the limit; the reservation turns into the pin when the bytes come, or goes at release.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable

import pyfuse3
import trio

from shadefs.cache.entry import Entry
from shadefs.cache.handles import HandleLedger
from shadefs.file_version import Changed, Signature, StatLike, serves
from shadefs.kernel.pages import KernelPages
from shadefs.stats import Metrics

__all__ = ["Deferred"]

log = logging.getLogger(__name__)


class Deferred:
    """The fetch of one open's miss, run by its handle's first read.

    :key, path, st: the file as the open looked it up (`st` is the version it answered)
    """

    __slots__ = (
        "_fetch",
        "_ledger",
        "_kernel",
        "_metrics",
        "key",
        "path",
        "st",
        "_reserved",
        "_answered",
        "_done",
        "_view",
        "_error",
    )

    def __init__(
        self,
        fetch: Callable[[int, bytes, StatLike], Awaitable[Entry]],
        ledger: HandleLedger,
        kernel: KernelPages,
        metrics: Metrics,
        key: int,
        path: bytes,
        st: StatLike,
    ) -> None:
        """`fetch`: the cache's miss fetch (pinned for the handle in `ledger`); `kernel`:
        which files the kernel may hold pages of."""
        self._fetch = fetch
        self._ledger = ledger
        self._kernel = kernel
        self._metrics = metrics
        self.key, self.path, self.st = key, path, st
        self._reserved: int | None = st.st_size  # None once read or dropped
        ledger.reserve(st.st_size)
        self._answered = False
        self._done: trio.Event | None = None  # set when the first read's fetch has ended
        self._view: memoryview | None = None
        self._error: BaseException | None = None

    def answered(self) -> None:
        """The open was answered before the fetch."""
        self._answered = True
        self._ledger.deferred += 1

    async def read(self) -> memoryview:
        """The handle's bytes, the version the open answered, whole: its first read fetches
        them (pinned for the handle until the caller unpins them at release), later and
        concurrent reads share that outcome. Raises the fetch's FUSEError (a path that no
        longer leads to the file: ENOENT/ENOTDIR), or `Changed`."""
        if self._done is None:
            self._done = trio.Event()
            try:
                self._view = await self._first()
            except BaseException as exc:
                # Sticky: the kernel may have served this handle pages already, and a later
                # fetch could meet another version. Cancelled (unmount) or a bug: EIO.
                ok = isinstance(exc, pyfuse3.FUSEError | Changed)
                self._error = exc if ok else pyfuse3.FUSEError(errno.EIO)
                raise
            finally:
                self._done.set()
        else:
            await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._view is not None
        return self._view

    async def _first(self) -> memoryview:
        if self._answered and self._reserved is not None:
            self._kernel.served(False)  # a read reached the daemon
        self._unreserve()
        got = await self._fetch(self.key, self.path, self.st)
        if serves(got.sig, len(got.data), Signature.of(self.st)):
            return memoryview(got.data)
        # Another version than the open answered with keep_cache: never mixed with pages
        # of the old one that the kernel may have served this handle already.
        self._ledger.unpin(got.data)
        log.info("%r changed between its open and first read: EIO", self.path)
        raise Changed(self.path)

    def drop(self) -> None:
        """The handle was released (or its open failed): if no read came, nothing was
        fetched."""
        if self._answered and self._reserved is not None:
            # The kernel served every read of this open from its own pages: a kernel hit
            # (stats.json `kernel_hits`, in the hit ratio), though the open counted a miss.
            self._ledger.unread += 1
            self._metrics.kernel_hits += 1
            self._kernel.served(True)
        self._unreserve()

    def _unreserve(self) -> None:
        if self._reserved is not None:
            self._ledger.unreserve(self._reserved)
            self._reserved = None
