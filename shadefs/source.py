"""All access to the backing tree (usually an NFS mount).

Every call that may block on the remote runs in a worker thread behind one
`trio.CapacityLimiter`, under a timeout: a hung NFS server turns into EIO for the caller
instead of a hung training job, and the number of threads stuck in the kernel is bounded by
the limiter (trio returns a token only when its thread really finishes, so abandoned calls
keep holding theirs). Errors become `pyfuse3.FUSEError` with the source's errno.

Paths are bytes relative to the source root (b"" is the root itself), so names that are not
valid UTF-8 survive unchanged.

The outage state is tracked here so that a dead server is logged once per outage, not once
per request.
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

import pyfuse3
import trio

from shadefs.stats import SourceStats

log = logging.getLogger(__name__)

T = TypeVar("T")

# trio renamed `cancellable` to `abandon_on_cancel` in 0.23.
_ABANDON_KW = (
    "abandon_on_cancel"
    if "abandon_on_cancel" in inspect.signature(trio.to_thread.run_sync).parameters
    else "cancellable"
)


class Source:
    """The backing tree, seen through bounded, timed-out worker threads.

    :root: the source directory (absolute, bytes)
    :timeout: seconds before a source call is abandoned and answered with EIO
    :healthy: False between a timeout and the next successful call
    """

    def __init__(self, root: str | bytes, *, max_threads: int = 32, timeout: float = 30.0):
        self.root = os.path.abspath(os.fsencode(root))
        self.timeout = timeout
        self.limiter = trio.CapacityLimiter(max_threads)
        self.healthy = True
        self.timeouts = 0
        self.errors = 0
        self.bytes_read = 0
        self._outage_since = 0.0

    def path(self, rel: bytes) -> bytes:
        return self.root + b"/" + rel if rel else self.root

    def describe(self) -> SourceStats:
        return SourceStats(
            root=os.fsdecode(self.root),
            bytes_read=self.bytes_read,
            healthy=self.healthy,
            timeouts=self.timeouts,
            errors=self.errors,
        )

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run fn(*args) in a worker thread; OSError -> FUSEError, timeout -> EIO."""
        with trio.move_on_after(self.timeout) as scope:
            try:
                result = await trio.to_thread.run_sync(
                    fn, *args, limiter=self.limiter, **{_ABANDON_KW: True}
                )
            except OSError as exc:
                # ENOENT and friends are answers, not outages.
                self._mark_healthy()
                if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ENODATA):
                    self.errors += 1
                # A dead server (ENOTCONN from a crashed FUSE source, ESTALE from NFS) is an
                # I/O error to the reader, not a property of the file.
                code = (
                    exc.errno
                    if exc.errno not in (None, errno.ENOTCONN, errno.ESTALE)
                    else errno.EIO
                )
                raise pyfuse3.FUSEError(code) from None
        if scope.cancelled_caught:
            self.timeouts += 1
            if self.healthy:
                self.healthy = False
                self._outage_since = time.monotonic()
                log.error(
                    "source %s did not answer within %.1f s: serving cached files only, "
                    "misses fail with EIO until it recovers",
                    os.fsdecode(self.root),
                    self.timeout,
                )
            raise pyfuse3.FUSEError(errno.EIO)
        self._mark_healthy()
        return result

    def _mark_healthy(self) -> None:
        if not self.healthy:
            self.healthy = True
            log.warning(
                "source %s answers again after %.1f s",
                os.fsdecode(self.root),
                time.monotonic() - self._outage_since,
            )

    # --- metadata ---------------------------------------------------------------------

    async def lstat(self, rel: bytes) -> os.stat_result:
        return await self.run(os.lstat, self.path(rel))

    async def listdir(self, rel: bytes) -> list[tuple[bytes, os.stat_result]]:
        """The directory's entries with their lstat, sorted by name (one thread hop)."""
        return await self.run(_scan, self.path(rel))

    async def readlink(self, rel: bytes) -> bytes:
        return await self.run(os.readlink, self.path(rel))

    async def getxattr(self, rel: bytes, name: bytes) -> bytes:
        return await self.run(_getxattr, self.path(rel), name)

    async def listxattr(self, rel: bytes) -> list[bytes]:
        return await self.run(_listxattr, self.path(rel))

    async def statvfs(self) -> os.statvfs_result:
        return await self.run(os.statvfs, self.root)

    # --- data -------------------------------------------------------------------------

    async def read_file(self, rel: bytes) -> tuple[bytes, os.stat_result]:
        """The whole file and the fstat taken on the open descriptor."""
        data, st = await self.run(_read_whole, self.path(rel))
        self.bytes_read += len(data)
        return data, st

    async def open_fd(self, rel: bytes) -> int:
        return await self.run(os.open, self.path(rel), os.O_RDONLY | os.O_CLOEXEC)

    async def pread(self, fd: int, size: int, off: int) -> bytes:
        data = await self.run(os.pread, fd, size, off)
        self.bytes_read += len(data)
        return data

    async def close_fd(self, fd: int) -> None:
        # close() on NFS can block (it flushes), so it goes through a thread as well.
        try:
            await self.run(os.close, fd)
        except pyfuse3.FUSEError:
            pass


def _scan(path: bytes) -> list[tuple[bytes, os.stat_result]]:
    out = []
    with os.scandir(path) as it:
        for entry in it:
            try:
                out.append((entry.name, entry.stat(follow_symlinks=False)))
            except FileNotFoundError:
                continue  # removed between readdir and lstat
    out.sort(key=lambda item: item[0])
    return out


def _read_whole(path: bytes) -> tuple[bytes, os.stat_result]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not os.path.stat.S_ISREG(st.st_mode):
            raise OSError(errno.EISDIR, "not a regular file")
        chunks = []
        want = st.st_size
        while True:
            # Read what fstat promised, then once more to see EOF (the file may have grown).
            chunk = os.read(fd, max(want, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            want = max(want - len(chunk), 0)
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return data, st
    finally:
        os.close(fd)


def _getxattr(path: bytes, name: bytes) -> bytes:
    return os.getxattr(path, name, follow_symlinks=False)


def _listxattr(path: bytes) -> list[bytes]:
    return [os.fsencode(n) for n in os.listxattr(path, follow_symlinks=False)]
