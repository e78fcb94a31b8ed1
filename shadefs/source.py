"""All access to the backing tree (usually an NFS mount).

Every call that may block on the remote runs in a worker thread behind one
`trio.CapacityLimiter`, under a timeout: a hung NFS server turns into EIO for the caller
instead of a hung training job, and the number of threads stuck in the kernel is bounded by
the limiter (a token comes back only when its thread really finishes, so abandoned calls
keep holding theirs); `source_calls.py` does both at the least cost trio allows. Errors
become `pyfuse3.FUSEError` with the source's errno.

Paths are bytes relative to the source root (b"" is the root itself), so names that are not
valid UTF-8 survive unchanged. They are resolved by `source_paths.Resolver` from a descriptor
of the root that is held for the daemon's life, and never through a symlink: whoever can
write into the source may swap a file or a directory for a symlink at any moment, and the
daemon must never open anything outside it. A symlink met on the way is ELOOP.

Fetches are bounded: a file is read up to the size that was looked up plus a small margin,
however fast it grows while it is read (see `read_file`).

The outage state is tracked here so that a dead server is logged once per outage, not once
per request.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

import pyfuse3
import trio

from shadefs.source_calls import Calls, TimedOut
from shadefs.source_paths import Resolver
from shadefs.stats import SourceStats

log = logging.getLogger(__name__)

T = TypeVar("T")

# Errors that answer a question about a file rather than say the source is failing. ELOOP is
# a symlink where the daemon expected a directory or a file: it is refused, not followed.
_ANSWERS = (errno.ENOENT, errno.ENOTDIR, errno.ENODATA, errno.ELOOP)
# How far a fetch may read past the size it expects: enough to see that the file grew,
# never enough to follow a file that grows without end.
_MARGIN = 64 << 10


class Source:
    """The backing tree, seen through bounded, timed-out worker threads.

    :root: the source directory (absolute, bytes; for messages: access goes through `paths`)
    :paths: the no-follow resolver, holding the root's descriptor
    :timeout: seconds before a source call is abandoned and answered with EIO
    :healthy: False between a timeout and the next successful call
    """

    def __init__(
        self,
        root: str | bytes,
        *,
        max_threads: int = 32,
        timeout: float = 30.0,
        use_openat2: bool | None = None,
    ):
        self.root = os.path.abspath(os.fsencode(root))
        self.paths = Resolver(self.root, use_openat2=use_openat2)
        self.timeout = timeout
        self.limiter = trio.CapacityLimiter(max_threads)
        self.calls = Calls(self.limiter)  # threads and deadlines (source_calls.py)
        self.healthy = True
        self.timeouts = 0
        self.errors = 0
        self.bytes_read = 0
        self._outage_since = 0.0

    def root_stat(self) -> os.stat_result:
        """The root's stat, from its held descriptor (no worker thread: used at start)."""
        return self.paths.lstat(b"")

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
        try:
            result = await self.calls.run(self.timeout, fn, *args)
        except OSError as exc:
            # ENOENT and friends are answers, not outages.
            self._mark_healthy()
            if exc.errno not in _ANSWERS:
                self.errors += 1
            # A dead server (ENOTCONN from a crashed FUSE source, ESTALE from NFS) is an
            # I/O error to the reader, not a property of the file.
            code = exc.errno if exc.errno not in (None, errno.ENOTCONN, errno.ESTALE) else errno.EIO
            raise pyfuse3.FUSEError(code) from None
        except TimedOut:
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
            raise pyfuse3.FUSEError(errno.EIO) from None
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
        return await self.run(self.paths.lstat, rel)

    async def listdir(self, rel: bytes) -> list[tuple[bytes, os.stat_result]]:
        """The directory's entries with their lstat, sorted by name (one thread hop)."""
        return await self.run(self.paths.scandir, rel)

    async def readlink(self, rel: bytes) -> bytes:
        return await self.run(self.paths.readlink, rel)

    async def getxattr(self, rel: bytes, name: bytes) -> bytes:
        """The attribute of a regular file or directory; ENODATA for anything else."""
        return await self.run(self.paths.getxattr, rel, name)

    async def listxattr(self, rel: bytes) -> list[bytes]:
        return await self.run(self.paths.listxattr, rel)

    async def statvfs(self) -> os.statvfs_result:
        return await self.run(self.paths.statvfs)

    # --- data -------------------------------------------------------------------------

    async def read_file(self, rel: bytes, size: int | None = None) -> tuple[bytes, os.stat_result]:
        """The file's bytes and the fstat taken on the open descriptor.

        At most min(fstat size, `size`) plus a margin are read (`size`: what the caller
        looked up), so a file that grows while it is read costs a bounded fetch. The bytes
        are a clean copy of the file only if len(data) == st.st_size (== `size` when given):
        otherwise the file changed size since it was looked up or while it was read, and
        the caller must not cache them as the file's content (they are still one read's
        consistent prefix, fit to answer the reader that asked).
        """
        data, st = await self.run(_read_bounded, self.paths, rel, size)
        self.bytes_read += len(data)
        return data, st

    async def open_fd(self, rel: bytes) -> int:
        """A read descriptor for pass-through reads (regular files only)."""
        fd, _ = await self.run(self.paths.open_regular, rel)
        return fd

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


def _read_bounded(paths: Resolver, rel: bytes, size: int | None) -> tuple[bytes, os.stat_result]:
    fd, st = paths.open_regular(rel)
    try:
        want = st.st_size if size is None else min(st.st_size, size)
        cap = want + max(_MARGIN, want // 100)
        chunks = []
        got = 0
        while got < cap:
            # What fstat promised first, then once more to see EOF (or that the file grew).
            chunk = os.read(fd, min(max(want - got, _MARGIN), cap - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return data, st
    finally:
        os.close(fd)
