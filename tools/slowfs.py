#!/usr/bin/env python3
"""slowfs.py - a read-only FUSE passthrough that behaves like a slow remote filer.

shadefs is benchmarked against NFS servers backed by spinning disks or busy cloud filers,
but development machines have neither NFS nor tc-netem. slowfs mirrors a local directory
and charges every request what such a server would:

* ``--open-latency MS`` on every open (default 5), ``--read-latency MS`` on every read
  request (default 0), ``--meta-latency MS`` on lookup, getattr and readdir (default 0.5);
* ``--bandwidth MB/s`` (10**6 bytes/s, default 100, 0 = unlimited), one link shared by all
  concurrent readers, so four readers split it rather than getting it four times;
* ``--jitter FRACTION`` scales each latency by a random factor in [1-F, 1+F].

Latencies are ``trio.sleep`` calls, so concurrent requests overlap like requests queued
on a real server. The kernel is told to cache nothing (direct I/O, no keep_cache, zero
entry and attribute timeouts): otherwise the page cache above the emulator would hide
the remote that it is meant to emulate.

``getfattr -n user.slowfs.stats MNT`` returns JSON counters (opens, reads, bytes, ...)
so that tests can check which requests reached the "remote".

Usage: ``python tools/slowfs.py SRC MNT [--daemon] [options]``; SIGTERM or SIGINT
unmounts cleanly, as does ``fusermount3 -u MNT``.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import random
import signal
import sys
from collections.abc import Sequence
from typing import Any

import pyfuse3
import trio

# The script runs as __main__, so name the logger after the tool instead.
log = logging.getLogger("slowfs")

STATS_XATTR = b"user.slowfs.stats"


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

    async def transfer(self, nbytes: int) -> None:
        """Wait until *nbytes* have crossed the link behind earlier replies."""
        if self.rate <= 0 or nbytes <= 0:
            return
        start = max(trio.current_time(), self._free_at)
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
    ) -> None:
        super().__init__()
        self.source = os.path.abspath(source)
        self.open_latency = open_latency
        self.read_latency = read_latency
        self.meta_latency = meta_latency
        self.jitter = jitter
        self.direct_io = direct_io
        self.link = Link(bandwidth)
        # Our own inode numbers: source st_ino values may collide with ROOT_INODE.
        self._path: dict[int, str] = {pyfuse3.ROOT_INODE: self.source}
        self._inode: dict[str, int] = {self.source: pyfuse3.ROOT_INODE}
        self._lookups: dict[int, int] = {pyfuse3.ROOT_INODE: 1}
        self._next_inode = pyfuse3.ROOT_INODE + 1
        self._listings: dict[int, tuple[str, list[str]]] = {}
        self._next_dir_handle = 1
        self.stats: dict[str, int] = dict.fromkeys(
            ("opens", "reads", "bytes", "lookups", "getattrs", "readdirs", "open_files"), 0
        )

    # -- helpers ---------------------------------------------------------------------

    async def _delay(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if self.jitter:
            seconds *= max(0.0, random.uniform(1 - self.jitter, 1 + self.jitter))
        await trio.sleep(seconds)

    def _path_of(self, inode: int) -> str:
        try:
            return self._path[inode]
        except KeyError:
            # The kernel only uses inodes that it looked up and has not forgotten.
            log.warning("request for unknown inode %d", inode)
            raise pyfuse3.FUSEError(errno.ESTALE) from None

    def _inode_of(self, path: str) -> int:
        inode = self._inode.get(path)
        if inode is None:
            inode = self._next_inode
            self._next_inode += 1
            self._inode[path] = inode
            self._path[inode] = path
            self._lookups[inode] = 0
        return inode

    def _drop_if_unused(self, inode: int) -> None:
        # The path keeps its inode number after the kernel forgets it, for the life of the
        # mount: an NFS server's file ids are stable too, and caches above key on them.
        # (One int and one path per file ever looked up: fine for a benchmark tool.)
        pass

    def _attributes(self, inode: int, path: str) -> pyfuse3.EntryAttributes:
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
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
        # Zero timeouts: every stat and path walk must reach the emulated server.
        attrs.entry_timeout = 0
        attrs.attr_timeout = 0
        return attrs

    def _child(self, parent_inode: int, name: bytes) -> str:
        parent = self._path_of(parent_inode)
        if name == b".":
            return parent
        if name == b"..":
            return parent if parent == self.source else os.path.dirname(parent)
        return os.path.join(parent, os.fsdecode(name))

    # -- metadata --------------------------------------------------------------------

    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
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

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for inode, count in inode_list:
            if inode in self._lookups:
                self._lookups[inode] = max(0, self._lookups[inode] - count)
                self._drop_if_unused(inode)

    async def getattr(
        self, inode: int, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        self.stats["getattrs"] += 1
        await self._delay(self.meta_latency)
        return self._attributes(inode, self._path_of(inode))

    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        await self._delay(self.meta_latency)
        try:
            return os.fsencode(os.readlink(self._path_of(inode)))
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        path = self._path_of(inode)
        try:
            # Snapshot the listing so that offsets stay stable across readdir calls.
            names = sorted(os.listdir(path))
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        handle = self._next_dir_handle
        self._next_dir_handle += 1
        self._listings[handle] = (path, names)
        return handle

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        self.stats["readdirs"] += 1
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

    async def releasedir(self, fh: int) -> None:
        self._listings.pop(fh, None)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = os.statvfs(self.source)
        data = pyfuse3.StatvfsData()
        for name in (
            "f_bsize",
            "f_frsize",
            "f_blocks",
            "f_bfree",
            "f_bavail",
            "f_files",
            "f_ffree",
            "f_favail",
            "f_namemax",
        ):
            setattr(data, name, getattr(st, name))
        return data

    # -- data ------------------------------------------------------------------------

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise pyfuse3.FUSEError(errno.EROFS)
        self.stats["opens"] += 1
        await self._delay(self.open_latency)
        try:
            fd = os.open(self._path_of(inode), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        self.stats["open_files"] += 1
        # keep_cache=False drops the page cache on every open; direct_io also keeps
        # reads within one open from being served by kernel readahead.
        return pyfuse3.FileInfo(fh=fd, direct_io=self.direct_io, keep_cache=False)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        self.stats["reads"] += 1
        await self._delay(self.read_latency)
        try:
            # The source is a local disk: pread returns in microseconds, and a thread
            # hop per read would cost more than the call itself.
            data = os.pread(fh, size, off)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        await self.link.transfer(len(data))
        self.stats["bytes"] += len(data)
        return data

    async def release(self, fh: int) -> None:
        self.stats["open_files"] -= 1
        os.close(fh)

    # -- extended attributes ---------------------------------------------------------

    def stats_document(self) -> dict[str, Any]:
        """Return the counters and settings reported by the stats xattr."""
        return {
            **self.stats,
            "pid": os.getpid(),
            "source": self.source,
            "open_latency_ms": self.open_latency * 1e3,
            "read_latency_ms": self.read_latency * 1e3,
            "meta_latency_ms": self.meta_latency * 1e3,
            "bandwidth_mb_s": self.link.rate / 1e6,
            "jitter": self.jitter,
        }

    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if inode == pyfuse3.ROOT_INODE and name == STATS_XATTR:
            return json.dumps(self.stats_document(), sort_keys=True).encode()
        try:
            return os.getxattr(self._path_of(inode), name, follow_symlinks=False)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        # The stats attribute stays unlisted so that `cp -a` or `rsync -X` of the mount
        # does not copy it into the destination.
        try:
            names = os.listxattr(self._path_of(inode), follow_symlinks=False)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        return [os.fsencode(name) for name in names]

    # -- everything that would modify the tree ---------------------------------------
    # The mount is also made with "ro", so the kernel refuses most of these first; the
    # handlers make the answer EROFS rather than ENOSYS if a request gets through.

    async def _read_only(self, *args: object, **kwargs: object) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = _read_only
    write = create = setxattr = removexattr = _read_only


# -- command line --------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="slowfs.py",
        description="Mount SRC read-only on MNT with the latency and bandwidth of a slow "
        "remote filer. Stats: getfattr -n user.slowfs.stats MNT",
    )
    parser.add_argument("source", metavar="SRC", help="directory to mirror")
    parser.add_argument("mountpoint", metavar="MNT", help="empty directory to mount on")
    parser.add_argument(
        "--open-latency", type=float, default=5.0, metavar="MS", help="per open (default 5)"
    )
    parser.add_argument(
        "--read-latency", type=float, default=0.0, metavar="MS", help="per read (default 0)"
    )
    parser.add_argument(
        "--meta-latency",
        type=float,
        default=0.5,
        metavar="MS",
        help="per lookup, getattr and readdir (default 0.5)",
    )
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=100.0,
        metavar="MB/S",
        help="shared by all readers, in 10**6 bytes/s (default 100, 0 = unlimited)",
    )
    parser.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="scale each latency by a random factor in [1-F, 1+F] (default 0)",
    )
    parser.add_argument(
        "--no-direct-io",
        dest="direct_io",
        action="store_false",
        help="allow readahead and mmap within one open (the cache is still dropped on every open)",
    )
    parser.add_argument("--allow-other", action="store_true", help="let other users read")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "-f", "--foreground", action="store_true", help="stay in the foreground (default)"
    )
    mode.add_argument(
        "--daemon",
        action="store_true",
        help="go to the background once mounted; exit 0 when the mount is ready",
    )
    parser.add_argument("--log", metavar="FILE", help="log here (default: stderr; none daemonized)")
    parser.add_argument(
        "--log-level",
        type=str.upper,
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="default: warning",
    )
    args = parser.parse_args(argv)
    for name in ("open_latency", "read_latency", "meta_latency", "bandwidth"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative")
    if not 0 <= args.jitter <= 1:
        parser.error("--jitter must be between 0 and 1")
    if not os.path.isdir(args.source):
        parser.error(f"{args.source} is not a directory")
    if not os.path.isdir(args.mountpoint):
        parser.error(f"{args.mountpoint} is not a directory")
    # --daemon changes directory to /, so relative paths would break afterwards.
    args.source = os.path.abspath(args.source)
    args.mountpoint = os.path.abspath(args.mountpoint)
    return args


def _daemonize() -> int:
    """Fork; the parent waits until the child reports the mount ready, then exits.

    Return the pipe descriptor on which the child reports readiness.
    """
    read_end, write_end = os.pipe()
    if os.fork():
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            answer = pipe.read()
        # The child's start-up errors already went to our shared stderr.
        os._exit(0 if answer == b"ready" else 1)
    os.close(read_end)
    os.setsid()
    # Do not pin the caller's working directory (and its filesystem) for our lifetime;
    # the source is already absolute and the log file already open.
    os.chdir("/")
    return write_end


def _detach_stdio(log_file: str | None) -> None:
    """Point stdio at /dev/null, so that a caller capturing our output sees EOF."""
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    if log_file is None:
        # Logging would otherwise write into a pipe that nobody reads any more.
        logging.disable(logging.CRITICAL)
    os.dup2(devnull, 2)
    os.close(devnull)


async def _serve(ready_fd: int | None, log_file: str | None) -> None:
    # Install the handlers before reporting ready, so that a caller may signal at once.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_unmount_on_signal, signals)
            if ready_fd is not None:
                _detach_stdio(log_file)
                os.write(ready_fd, b"ready")
                os.close(ready_fd)
            await pyfuse3.main()
            # main() also returns after an external `fusermount3 -u`; stop the watcher.
            nursery.cancel_scope.cancel()


async def _unmount_on_signal(signals: Any) -> None:
    async for signum in signals:
        log.info("%s received, unmounting", signal.Signals(signum).name)
        pyfuse3.terminate()
        return


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        filename=args.log,
        level=args.log_level,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
    )
    ops = SlowOperations(
        args.source,
        open_latency=args.open_latency / 1e3,
        read_latency=args.read_latency / 1e3,
        meta_latency=args.meta_latency / 1e3,
        bandwidth=args.bandwidth * 1e6,
        jitter=args.jitter,
        direct_io=args.direct_io,
    )
    options = set(pyfuse3.default_options)
    options |= {"fsname=slowfs", "subtype=slowfs", "ro"}
    if args.allow_other:
        options.add("allow_other")

    ready_fd = _daemonize() if args.daemon else None
    try:
        pyfuse3.init(ops, args.mountpoint, options)
    except RuntimeError as exc:
        log.error("cannot mount %s: %s", args.mountpoint, exc)
        return 1
    log.info(
        "serving %s on %s (open %.1f ms, read %.1f ms, meta %.1f ms, %s MB/s)",
        args.source,
        args.mountpoint,
        args.open_latency,
        args.read_latency,
        args.meta_latency,
        args.bandwidth or "unlimited",
    )
    try:
        trio.run(_serve, ready_fd, args.log)
    finally:
        # Unmounting is safe after an external unmount too: libfuse notices the closed
        # channel and skips it.
        pyfuse3.close(unmount=True)
    log.info("unmounted %s", args.mountpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
