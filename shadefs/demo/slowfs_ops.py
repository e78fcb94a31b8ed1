"""The slow-remote emulator's filesystem: a read-only passthrough that charges latency.

This module owns what every request costs: ``SlowOperations`` mirrors a local directory
through pyfuse3 and sleeps (``trio.sleep``) for each open, read and metadata request, and
``Link`` makes every reply cross one shared link of fixed bandwidth. The command line that
mounts it is ``shadefs.demo.slowfs``.

The kernel is told to cache no file data or file attributes (direct I/O, no keep_cache,
zero entry and attribute timeouts for files): otherwise the page cache above the emulator
would hide the remote that it is meant to emulate. Directories' attributes and entries may
be cached for ``dir_timeout`` seconds, as an NFS client caches them.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import resource
import stat
import time
from collections.abc import Sequence
from typing import Any

import pyfuse3
import trio
from pyfuse3 import FileHandleT, InodeT

from shadefs.fs.records import statfs_reply

log = logging.getLogger(__name__)

STATS_XATTR = b"user.slowfs.stats"
#: The kinds of request that can be made to hang (`SlowOperations.hang`).
HANG_KINDS = frozenset({"open", "read", "readdir"})


def _fuse_error(exc: OSError) -> pyfuse3.FUSEError:
    """The FUSE reply for a failed call on the source (EIO when it carries no errno)."""
    return pyfuse3.FUSEError(exc.errno or errno.EIO)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Link:
    """A network link of fixed bandwidth shared by every request.

    Each reply reserves its transfer time on one shared clock: a token bucket with no
    burst depth. N bytes therefore take at least N / rate seconds however many readers
    there are, and an idle link does not bank credit for later.

    :rate: bytes per second; 0 or less means unlimited.
    """

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._free_at = 0.0

    async def transfer(self, nbytes: int, ready: float | None = None) -> None:
        """Wait until *nbytes* have crossed the link behind earlier replies; `ready` (a
        trio time) is when the reply is ready to be sent, now when None."""
        now = trio.current_time()
        ready = now if ready is None else ready
        if self.rate <= 0 or nbytes <= 0:
            if ready > now:
                await trio.sleep_until(ready)
            return
        start = max(ready, self._free_at)
        # Reserve before sleeping, so that concurrent replies queue behind this one.
        self._free_at = start + nbytes / self.rate
        await trio.sleep_until(self._free_at)


class SlowOperations(pyfuse3.Operations):
    """Read-only passthrough of *source* with emulated remote latency and bandwidth."""

    # With writeback caching the kernel would buffer writes it can never flush.
    enable_writeback_cache = False

    def __init__(
        self,
        source: str,
        *,
        open_latency: float = 0.005,
        read_latency: float = 0.0,
        meta_latency: float = 0.0005,
        bandwidth: float = 100e6,
        jitter: float = 0.0,
        direct_io: bool = True,
        dir_timeout: float = 0.0,
        hang_on: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__()
        self.hang_on = hang_on  # the kinds of request that `hang` stops
        self._resumed: trio.Event | None = None  # set by `resume`; None while not hanging
        self.dir_timeout = dir_timeout
        self.source = os.path.abspath(source)
        self.open_latency = open_latency
        self.read_latency = read_latency
        self.meta_latency = meta_latency
        self.jitter = jitter
        self.direct_io = direct_io
        # Not named `link`: that is the FUSE handler for hard links (EROFS below).
        self.wire = Link(bandwidth)
        # Our own inode numbers: source st_ino values may collide with ROOT_INODE.
        self._path: dict[InodeT, str] = {pyfuse3.ROOT_INODE: self.source}
        self._inode: dict[str, InodeT] = {self.source: pyfuse3.ROOT_INODE}
        self._lookups: dict[InodeT, int] = {pyfuse3.ROOT_INODE: 1}
        self._next_inode = pyfuse3.ROOT_INODE + 1
        self._listings: dict[FileHandleT, tuple[str, list[str]]] = {}
        self._next_dir_handle = 1
        self.stats: dict[str, int] = dict.fromkeys(
            ("opens", "reads", "bytes", "lookups", "getattrs", "readdirs", "open_files"), 0
        )
        self.stats["reads_in_flight_max"] = 0
        self._reading = 0  # reads waiting for their latency and the link now
        self._started = self._last_read = (time.monotonic(), _cpu_seconds())

    # -- helpers ---------------------------------------------------------------------

    def hang(self) -> None:
        """Stop answering the `hang_on` kinds of request until `resume`: a server that
        stops answering some requests but not others."""
        if self._resumed is None:
            self._resumed = trio.Event()

    def resume(self) -> None:
        if self._resumed is not None:
            self._resumed.set()
            self._resumed = None

    async def _gate(self, kind: str) -> None:
        """Wait while requests of `kind` hang."""
        resumed = self._resumed
        if resumed is not None and kind in self.hang_on:
            await resumed.wait()

    def _scaled(self, seconds: float) -> float:
        if self.jitter and seconds > 0:
            seconds *= max(0.0, random.uniform(1 - self.jitter, 1 + self.jitter))
        return seconds

    async def _delay(self, seconds: float) -> None:
        seconds = self._scaled(seconds)
        if seconds > 0:
            await trio.sleep(seconds)

    def _path_of(self, inode: InodeT) -> str:
        try:
            return self._path[inode]
        except KeyError:
            # The kernel only uses inodes that it looked up and has not forgotten.
            log.warning("request for unknown inode %d", inode)
            raise pyfuse3.FUSEError(errno.ESTALE) from None

    def _inode_of(self, path: str) -> InodeT:
        inode = self._inode.get(path)
        if inode is None:
            inode = self._next_inode
            self._next_inode += 1
            self._inode[path] = inode
            self._path[inode] = path
            self._lookups[inode] = 0
        return inode

    def _drop_if_unused(self, inode: InodeT) -> None:
        # The path keeps its inode number after the kernel forgets it, for the life of the
        # mount: an NFS server's file ids are stable too, and caches above key on them.
        # (One int and one path per file ever looked up: fine for a benchmark tool.)
        pass

    def _attributes(self, inode: InodeT, path: str) -> pyfuse3.EntryAttributes:
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise _fuse_error(exc) from None
        attrs = pyfuse3.EntryAttributes()
        for name in (
            "st_mode",
            "st_nlink",
            "st_uid",
            "st_gid",
            "st_rdev",
            "st_size",
            "st_blksize",
            "st_blocks",
            "st_atime_ns",
            "st_mtime_ns",
            "st_ctime_ns",
        ):
            setattr(attrs, name, getattr(st, name))
        attrs.st_ino = inode
        # Zero timeouts: every stat and open of a file must reach the emulated server. A
        # directory's may be cached for --dir-timeout, as NFS clients do (acdirmin).
        timeout = self.dir_timeout if stat.S_ISDIR(st.st_mode) else 0
        attrs.entry_timeout = timeout
        attrs.attr_timeout = timeout
        return attrs

    def _child(self, parent_inode: InodeT, name: bytes) -> str:
        parent = self._path_of(parent_inode)
        if name == b".":
            return parent
        if name == b"..":
            return parent if parent == self.source else os.path.dirname(parent)
        return os.path.join(parent, os.fsdecode(name))

    # -- metadata --------------------------------------------------------------------

    async def lookup(
        self, parent_inode: InodeT, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self.stats["lookups"] += 1
        await self._delay(self.meta_latency)
        path = self._child(parent_inode, name)
        inode = self._inode_of(path)
        try:
            attrs = self._attributes(inode, path)
        except pyfuse3.FUSEError:
            self._drop_if_unused(inode)
            raise
        self._lookups[inode] += 1
        return attrs

    async def forget(self, inode_list: Sequence[tuple[InodeT, int]]) -> None:
        for inode, count in inode_list:
            if inode in self._lookups:
                self._lookups[inode] = max(0, self._lookups[inode] - count)
                self._drop_if_unused(inode)

    async def getattr(
        self, inode: InodeT, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        self.stats["getattrs"] += 1
        await self._delay(self.meta_latency)
        return self._attributes(inode, self._path_of(inode))

    async def readlink(self, inode: InodeT, ctx: pyfuse3.RequestContext) -> bytes:
        await self._delay(self.meta_latency)
        try:
            return os.fsencode(os.readlink(self._path_of(inode)))
        except OSError as exc:
            raise _fuse_error(exc) from None

    async def opendir(self, inode: InodeT, ctx: pyfuse3.RequestContext) -> FileHandleT:
        await self._gate("readdir")
        path = self._path_of(inode)
        try:
            # Snapshot the listing so that offsets stay stable across readdir calls.
            names = sorted(os.listdir(path))
        except OSError as exc:
            raise _fuse_error(exc) from None
        handle = self._next_dir_handle
        self._next_dir_handle += 1
        self._listings[handle] = (path, names)
        return handle

    async def readdir(self, fh: FileHandleT, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        self.stats["readdirs"] += 1
        await self._gate("readdir")
        await self._delay(self.meta_latency)
        parent, names = self._listings[fh]
        for index in range(start_id, len(names)):
            path = os.path.join(parent, names[index])
            inode = self._inode_of(path)
            try:
                attrs = self._attributes(inode, path)
            except pyfuse3.FUSEError:
                # Vanished since opendir: skip it rather than fail the whole listing.
                self._drop_if_unused(inode)
                continue
            if not pyfuse3.readdir_reply(token, os.fsencode(names[index]), attrs, index + 1):
                self._drop_if_unused(inode)
                return
            self._lookups[inode] += 1

    async def releasedir(self, fh: FileHandleT) -> None:
        self._listings.pop(fh, None)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = os.statvfs(self.source)
        return statfs_reply(st)

    # -- data ------------------------------------------------------------------------

    async def open(
        self, inode: InodeT, flags: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.FileInfo:
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise pyfuse3.FUSEError(errno.EROFS)
        self.stats["opens"] += 1
        await self._gate("open")
        await self._delay(self.open_latency)
        try:
            fd = os.open(self._path_of(inode), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise _fuse_error(exc) from None
        self.stats["open_files"] += 1
        # keep_cache=False drops the page cache on every open; direct_io also keeps
        # reads within one open from being served by kernel readahead.
        return pyfuse3.FileInfo(fh=fd, direct_io=self.direct_io, keep_cache=False)

    async def read(self, fh: FileHandleT, off: int, size: int) -> bytes:
        self.stats["reads"] += 1
        await self._gate("read")
        try:
            # The source is a local disk: pread returns in microseconds, and a thread
            # hop per read would cost more than the call itself.
            data = os.pread(fh, size, off)
        except OSError as exc:
            raise _fuse_error(exc) from None
        # How many reads wait at once: whether a client keeps several requests in flight
        # or sends them one after the other (tests/test_source_reads.py).
        self._reading += 1
        self.stats["reads_in_flight_max"] = max(self.stats["reads_in_flight_max"], self._reading)
        try:
            # One sleep for the read's latency and its transfer (each sleep costs the loop
            # CPU): the reply is ready after the latency, then queues for the link.
            now = trio.current_time()
            await self.wire.transfer(len(data), now + self._scaled(self.read_latency))
        finally:
            self._reading -= 1
        self.stats["bytes"] += len(data)
        return data

    async def release(self, fh: FileHandleT) -> None:
        self.stats["open_files"] -= 1
        os.close(fh)

    # -- extended attributes ---------------------------------------------------------

    def stats_document(self) -> dict[str, Any]:
        """Return the counters and settings reported by the stats xattr.

        `cpu_seconds` is this process's CPU time; `cpu_share` its share of one core since
        the mount, `cpu_share_recent` since the previous read of the stats (a benchmark
        reading them once per epoch gets the epoch's share).
        """
        now, cpu = time.monotonic(), _cpu_seconds()
        (t0, c0), (t1, c1) = self._started, self._last_read
        self._last_read = (now, cpu)
        return {
            **self.stats,
            "cpu_seconds": round(cpu, 3),
            "cpu_share": round((cpu - c0) / max(now - t0, 1e-9), 4),
            "cpu_share_recent": round((cpu - c1) / max(now - t1, 1e-9), 4),
            "pid": os.getpid(),
            "source": self.source,
            "open_latency_ms": self.open_latency * 1e3,
            "read_latency_ms": self.read_latency * 1e3,
            "meta_latency_ms": self.meta_latency * 1e3,
            "bandwidth_mb_s": self.wire.rate / 1e6,
            "jitter": self.jitter,
            "dir_timeout_s": self.dir_timeout,
        }

    async def getxattr(self, inode: InodeT, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if inode == pyfuse3.ROOT_INODE and name == STATS_XATTR:
            return json.dumps(self.stats_document(), sort_keys=True).encode()
        try:
            return os.getxattr(self._path_of(inode), name, follow_symlinks=False)
        except OSError as exc:
            raise _fuse_error(exc) from None

    async def listxattr(self, inode: InodeT, ctx: pyfuse3.RequestContext) -> list[bytes]:
        # The stats attribute stays unlisted so that `cp -a` or `rsync -X` of the mount
        # does not copy it into the destination.
        try:
            names = os.listxattr(self._path_of(inode), follow_symlinks=False)
        except OSError as exc:
            raise _fuse_error(exc) from None
        return [os.fsencode(name) for name in names]

    # -- everything that would modify the tree ---------------------------------------
    # The mount is also made with "ro", so the kernel refuses most of these first; the
    # handlers make the answer EROFS rather than ENOSYS if a request gets through.

    async def _read_only(self, *args: object, **kwargs: object) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = _read_only
    write = create = setxattr = removexattr = _read_only
