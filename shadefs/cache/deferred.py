"""A miss answered before its fetch: the bytes come with the first read that needs them.

Files evicted from RAM are often still in the kernel's page cache of the mount. An open of
such a file used to fetch it whole, and then the kernel served every read from its own
pages: the fetch was wasted. `Cache.open_entry(..., lazy=True)` therefore does the open's
bookkeeping (hit/miss counts, the jobs' reads, the policies' notes, a staged file taken, the
pass-through and handle-limit decisions) and, where it would fetch, returns a `Deferred`
instead. The handle's first read that reaches the daemon calls `fetch`, which is the
cache's ordinary miss fetch (single flight, joining a prefetch, admission), pinned for the
handle; a handle released unread fetches nothing (`HandleLedger.unread` counts those, and so
does `Metrics.kernel_hits`: the kernel served the open from its own pages).
Two misses still fetch at open: one that finds a fetch of the file in flight joins it (the
bytes are on their way; a prefetch landing after the open would be staged for nobody), and
an empty file (no read will ever reach the daemon, which would then never cache it).

Which opens may be deferred, and what a deferred handle does when its fetch meets another
version, is the file system's business (`fs/deferred.py`): this module only keeps the
handle-limit rule whole. The open reserves the file's size in the ledger, as if it already
held the bytes, so that opens answered before their fetch cannot together pass the limit;
the reservation turns into the pin when the bytes come, or goes at release.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from shadefs.cache.handles import HandleLedger
from shadefs.file_version import StatLike
from shadefs.stats import Metrics

__all__ = ["Deferred"]

E = TypeVar("E", covariant=True)  # the cache's Entry


class Deferred(Generic[E]):
    """The fetch of one open's miss, run by its first read (at most once per handle).

    :key, path, st: the file as the open looked it up (`st` is the version it answered)
    """

    __slots__ = ("_fetch", "_ledger", "_metrics", "key", "path", "st", "_reserved", "_answered")

    def __init__(
        self,
        fetch: Callable[[int, bytes, StatLike], Awaitable[E]],
        ledger: HandleLedger,
        metrics: Metrics,
        key: int,
        path: bytes,
        st: StatLike,
    ) -> None:
        self._fetch = fetch
        self._ledger = ledger
        self._metrics = metrics
        self.key, self.path, self.st = key, path, st
        self._reserved: int | None = st.st_size  # None once read or dropped
        ledger.reserve(st.st_size)
        self._answered = False

    def answered(self) -> None:
        """The open was answered before the fetch (else it fetched at once, `fetch`)."""
        self._answered = True
        self._ledger.deferred += 1

    async def fetch(self) -> E:
        """The bytes (pinned for the handle) and their version; call once."""
        if self._answered and self._reserved is not None:
            self._ledger.kernel.served(False)  # a read reached the daemon
        self._unreserve()
        return await self._fetch(self.key, self.path, self.st)

    def drop(self) -> None:
        """The handle was released (or its open failed) before any read: nothing fetched."""
        if self._answered and self._reserved is not None:
            # The kernel served every read of this open from its own pages: a kernel hit
            # (stats.json `kernel_hits`, in the hit ratio), though the open counted a miss.
            self._ledger.unread += 1
            self._metrics.kernel_hits += 1
            self._ledger.kernel.served(True)
        self._unreserve()

    def _unreserve(self) -> None:
        if self._reserved is not None:
            self._ledger.unreserve(self._reserved)
            self._reserved = None
