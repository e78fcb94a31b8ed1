"""Opens of missed files answered before their fetch: the first read that arrives fetches.

Files evicted from RAM are often still in the kernel's page cache of the mount, and an open
answered with keep_cache lets the kernel serve every read of them from its own pages: a
fetch of the whole file at open would go unread, source bytes for nothing. `Operations.open`
therefore asks the cache for a
deferred miss (`Cache.open_entry(..., lazy=True)`, cache/deferred.py) when the kernel may hold
pages of the inode, and the handle's first read that reaches the daemon fetches.

Which opens are deferred: those of inodes the kernel may hold pages of, that is, opened
since the kernel last forgot them (a forget drops the kernel's inode with its pages):
kernel/pages.py keeps that without a per-file object. A wrong guess only changes
which path an open takes (a deferred miss, or the fetch at open as before), never what it
serves.

What the open still checks: a miss that fetched at open met the source's current version,
and the identity rules (docs/developer-notes.md, "Identity") rely on that: a file changed
within `--revalidate` is served in its new version, whole, without the kernel's old pages.
A deferred open makes the same check without the bytes (one lstat, `changed`): a changed
file's node is retired (ESTALE, fs/revalidate.py) as at any open; an unchanged one is
answered with keep_cache, since the kernel's pages, if any, are of the version looked up.

The first read fetches through the cache's ordinary miss path (single flight, admission,
the SSD tier's write-behind). Concurrent reads of one handle share one fetch; a failed
fetch fails every later read of the handle (the kernel may already have served it pages:
a retry could mix). A fetch that meets another version than the open answered (the file
changed between the open and its first read) is never served: the kernel may have given
this handle pages of the old one. The read fails with EIO and the node is due a check
(`fresh_stat`): its next open retires it, and the kernel's retry opens the new version
under a new node. A path that no longer leads to the file is ESTALE, as at open. A handle
released unread fetches nothing (stats.json `handles.unread`).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import pyfuse3
import trio

from shadefs.cache.deferred import Deferred
from shadefs.file_version import Signature
from shadefs.fs.namespace import Namespace
from shadefs.fs.revalidate import MOVED
from shadefs.kernel.pages import KernelPages

__all__ = ["Deferrals"]

log = logging.getLogger(__name__)


def _eio() -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(errno.EIO)


class _Fetched(Protocol):
    """What a deferred fetch returns (the cache's `Entry`): bytes and their version."""

    @property
    def data(self) -> bytes: ...

    @property
    def sig(self) -> Signature: ...


class _Pending:
    """A deferred handle: its fetch and, once its first read has run, the outcome."""

    __slots__ = ("deferred", "inode", "done", "view", "error")

    def __init__(self, deferred: Deferred[_Fetched], inode: int) -> None:
        self.deferred = deferred
        self.inode = inode
        self.done: trio.Event | None = None  # set when the first read's fetch has ended
        self.view: memoryview | None = None
        self.error: pyfuse3.FUSEError | None = None


class Deferrals:
    """The deferred handles of one mount, and which inodes the kernel may hold pages of.

    :handles: file handle -> its deferred fetch, until its first read has fetched
    """

    def __init__(self, ns: Namespace, unpin: Callable[[bytes], None], kernel: KernelPages) -> None:
        """`unpin` gives back the pin of bytes fetched for a handle that will not serve them;
        `kernel` tells which inodes were opened since the kernel last forgot them."""
        self.ns = ns
        self._unpin = unpin
        self.kernel = kernel
        self.handles: dict[int, _Pending] = {}

    def forget(self, items: Sequence[tuple[int, int]]) -> None:
        """The kernel dropped these inodes, and their pages with them."""
        self.kernel.forget(ino for ino, _ in items)

    async def changed(self, inode: int, deferred: Deferred[_Fetched]) -> bool:
        """Whether the file has a new version at the source (one lstat) since the open
        looked it up: the caller retires the node (fs/revalidate.py). The deferral is
        dropped if the check fails."""
        try:
            return await self.ns.fresh_stat(inode, force=True)
        except BaseException:
            deferred.drop()
            raise

    def add(self, fh: int, inode: int, deferred: Deferred[_Fetched]) -> None:
        """`fh` is a deferred handle: its first read fetches."""
        self.handles[fh] = _Pending(deferred, inode)
        deferred.answered()

    async def read(self, fh: int) -> memoryview:
        """The bytes of deferred handle `fh`: its first read fetches them, and the handle
        then leaves `handles` (the caller keeps them as any handle's, pinned until release)."""
        p = self.handles[fh]
        if p.done is None:
            p.done = trio.Event()
            try:
                p.view = await self._fetch(p)
                del self.handles[fh]
            except BaseException as exc:
                # Sticky: the kernel may have served this handle pages already, and a later
                # fetch could meet another version. Cancelled (unmount) or a bug: EIO.
                p.error = exc if isinstance(exc, pyfuse3.FUSEError) else _eio()
                raise
            finally:
                p.done.set()
        else:
            await p.done.wait()
        if p.error is not None:
            raise p.error
        assert p.view is not None
        return p.view

    async def _fetch(self, p: _Pending) -> memoryview:
        try:
            got = await p.deferred.fetch()
        except pyfuse3.FUSEError as exc:
            if exc.errno in MOVED:
                raise self.ns.stale(p.inode) from None
            raise
        st = p.deferred.st
        if got.sig == Signature.of(st) and len(got.data) == st.st_size:
            return memoryview(got.data)
        # Another version than the open answered with keep_cache: never mixed with pages
        # of the old one that the kernel may have served this handle already.
        self._unpin(got.data)
        log.info("%r changed between its open and first read: EIO", p.deferred.path)
        await self.ns.fresh_stat(p.inode, force=True)  # (its next open retires the node)
        raise pyfuse3.FUSEError(errno.EIO)

    def release(self, fh: int) -> bool:
        """Release deferred handle `fh` (unread, or whose first read failed); False if it
        is not one."""
        p = self.handles.pop(fh, None)
        if p is None:
            return False
        p.deferred.drop()
        return True
