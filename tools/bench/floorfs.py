"""The floor of a pyfuse3 + trio daemon: a read-only tree served from memory, nothing else.

    python tools/bench/floorfs.py SRC MNT [--no-open]

`bench_cpu.py` measures the daemon's CPU per opened file against this filesystem in the same
run: it reads SRC into memory before mounting and then answers lookup, getattr, readdir,
open (with keep_cache), read and release from dicts, with long entry and attribute timeouts,
and leaves flush unimplemented as shadefs does (ENOSYS once, then the kernel stops sending
it). No Python pyfuse3 daemon can serve a file with less work, so its CPU per open is the
floor that shadefs's figures are divided by.

It counts its requests by type (the only work beyond the minimum, one dict increment each):
`getfattr -n user.floorfs.requests MNT` returns them as JSON.

`--no-open` is the floor of kernel hits (shadefs's `--kernel-hits`, FUSE no-open mode):
`open` answers ENOSYS, after which the kernel opens every file itself and sends a READ only
for pages it lacks. It needs the project's patched pyfuse3 (`make pyfuse3`), which passes
the inode as the READ's file handle; with a stock one it refuses to start.

SIGTERM or SIGINT unmounts.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import stat
from collections import Counter

import pyfuse3
import trio
from pyfuse3 import FileHandleT, InodeT

_TIMEOUT = 1e6  # seconds: the tree never changes while it is mounted


class FloorOperations(pyfuse3.Operations):
    """A read-only in-memory copy of a tree."""

    def __init__(self, src: str) -> None:
        super().__init__()
        self.attrs: dict[int, pyfuse3.EntryAttributes] = {}
        self.children: dict[int, dict[bytes, int]] = {}
        self.data: dict[int, bytes] = {}
        self.requests: Counter[str] = Counter()
        self.no_open = False
        self._load(os.fsencode(src), pyfuse3.ROOT_INODE)

    def _load(self, path: bytes, ino: int) -> None:
        self.attrs[ino] = self._attr(ino, os.lstat(path))
        kids: dict[bytes, int] = {}
        self.children[ino] = kids
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            child = len(self.attrs) + pyfuse3.ROOT_INODE
            kids[entry.name] = child
            if entry.is_dir(follow_symlinks=False):
                self._load(entry.path, child)
            elif entry.is_file(follow_symlinks=False):
                with open(entry.path, "rb") as f:
                    self.data[child] = f.read()
                self.attrs[child] = self._attr(child, entry.stat(follow_symlinks=False))

    @staticmethod
    def _attr(ino: int, st: os.stat_result) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = InodeT(ino)
        a.st_mode = pyfuse3.ModeT(st.st_mode)
        a.st_nlink = st.st_nlink
        a.st_size = st.st_size
        a.st_blocks = st.st_blocks
        a.st_blksize = 4096
        a.st_mtime_ns = st.st_mtime_ns
        a.st_ctime_ns = st.st_ctime_ns
        a.st_atime_ns = st.st_atime_ns
        a.entry_timeout = _TIMEOUT
        a.attr_timeout = _TIMEOUT
        return a

    async def lookup(
        self, parent_inode: InodeT, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self.requests["lookup"] += 1
        ino = self.children.get(parent_inode, {}).get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.attrs[ino]

    async def getattr(self, inode: InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        self.requests["getattr"] += 1
        return self.attrs[inode]

    async def opendir(self, inode: InodeT, ctx: pyfuse3.RequestContext) -> FileHandleT:
        self.requests["opendir"] += 1
        return FileHandleT(inode)

    async def readdir(self, fh: FileHandleT, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        self.requests["readdir"] += 1
        names = list(self.children[fh].items())
        for i in range(start_id, len(names)):
            name, ino = names[i]
            if not pyfuse3.readdir_reply(token, name, self.attrs[ino], i + 1):
                break

    async def releasedir(self, fh: FileHandleT) -> None:
        self.requests["releasedir"] += 1

    async def open(
        self, inode: InodeT, flags: pyfuse3.FlagT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.FileInfo:
        self.requests["open"] += 1
        if self.no_open:
            raise pyfuse3.FUSEError(errno.ENOSYS)
        if not stat.S_ISREG(self.attrs[inode].st_mode):
            raise pyfuse3.FUSEError(errno.EISDIR)
        return pyfuse3.FileInfo(fh=FileHandleT(inode), keep_cache=True)

    async def read(self, fh: FileHandleT, off: int, size: int) -> bytes:
        self.requests["read"] += 1
        data = self.data.get(fh)  # (with --no-open, fh is the inode: the patched pyfuse3)
        if data is None:
            raise pyfuse3.FUSEError(errno.EIO)
        return data[off : off + size]

    async def release(self, fh: FileHandleT) -> None:
        self.requests["release"] += 1

    async def forget(self, inode_list: list[tuple[InodeT, int]]) -> None:
        self.requests["forget"] += 1

    async def getxattr(self, inode: InodeT, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if inode == pyfuse3.ROOT_INODE and name == b"user.floorfs.requests":
            return json.dumps(dict(self.requests)).encode()
        raise pyfuse3.FUSEError(errno.ENODATA)


async def _serve() -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_signals)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


async def _signals() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            pyfuse3.terminate()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("mountpoint")
    ap.add_argument("--no-open", action="store_true", help="FUSE no-open mode (patched pyfuse3)")
    args = ap.parse_args()
    if args.no_open and not getattr(pyfuse3, "NO_OPEN_FH_IS_INODE", False):
        ap.error("--no-open needs the patched pyfuse3 (make pyfuse3)")
    ops = FloorOperations(args.source)
    ops.no_open = args.no_open
    # The options shadefs mounts with (daemon.fuse_options), so that the kernel behaves alike.
    options = set(pyfuse3.default_options) | {"fsname=floorfs", "subtype=floorfs", "noatime"}
    pyfuse3.init(ops, args.mountpoint, options)
    try:
        trio.run(_serve)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()
