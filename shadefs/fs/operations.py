"""The pyfuse3 `Operations`: a read-only mirror of the source with a caching data path.

Kernel request -> here -> namespace (which file) -> cache (where its bytes are) -> source
(only on a miss). This module makes no policy decision and does no blocking I/O itself.

Speed rules (docs/design.md §6): entry and attribute timeouts are long (the tree is
read-only), readdir answers with attributes (pyfuse3 always uses readdirplus), a resident
file is opened with keep_cache so the kernel page cache serves repeated reads without
asking us, and a cache hit never leaves the trio thread. `flush` is left unimplemented:
pyfuse3 answers ENOSYS, after which the kernel stops sending it at all, which saves one
round trip per close.

Every write-type operation fails with EROFS; only the control file takes writes.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Sequence
from typing import cast

import pyfuse3
from pyfuse3 import FileHandleT, FlagT, InodeT

from shadefs.cache.block_handle import BlockHandle
from shadefs.cache.deferred import Deferred
from shadefs.cache.face import CacheFace
from shadefs.control.entries import DIR_INODE, NAME
from shadefs.control.files import Control
from shadefs.file_version import Changed, Signature, StatLike
from shadefs.fs.guard import PASS, Pass, guard_handlers
from shadefs.fs.inode_numbers import ROOT_INODE
from shadefs.fs.namespace import MOVED, Namespace
from shadefs.fs.readonly import ReadOnly, erofs
from shadefs.fs.records import attrs_of_row, statfs_reply
from shadefs.fs.snapshots import Snapshot
from shadefs.fs.xattrs import Xattrs
from shadefs.kernel.no_open import KERNEL_PID
from shadefs.kernel.notify import PUSH_MAX, entries_forgotten, push_pages
from shadefs.kernel.pages import BulkDrops, KernelPages
from shadefs.source.part import OPENER, Source
from shadefs.source.reads import advise
from shadefs.stats import Metrics

log = logging.getLogger(__name__)


# Directory rows converted to Python values per step of readdir.
_READDIR_CHUNK = 64
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT
# Under kernel hits: files whose handle is kept between their READs (`_read_node`), at most.
_PARTIAL = 64
# Under kernel hits, a READ that failed with EIO fails again at once for this long: the
# kernel retries a failed read-ahead READ with a READ of its own, which would wait for a hung
# source's timeout a second time.
_RETRY_WINDOW = 1.0
# A READ that answers ESTALE first waits this long at most for the kernel to drop the
# node's dentry (kernel/notify.py, `entries_forgotten`).
_FORGET_WAIT = 1.0


@guard_handlers
class Operations(ReadOnly):
    """Request handlers. `handles` maps an open file to its bytes or a source descriptor."""

    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(
        self,
        ns: Namespace,
        cache: CacheFace,
        control: Control,
        metrics: Metrics,
        source: Source,
        *,
        kernel_pages: KernelPages,
        kernel_hits: bool = False,
    ) -> None:
        super().__init__()
        # FUSE no-open mode (kernel/no_open.py): every open answers ENOSYS, and a read's
        # `fh` is its inode.
        self.kernel_hits = metrics.no_open = kernel_hits
        self._blk: dict[FileHandleT, BlockHandle] = {}
        self.ns = ns
        self._clock = ns.clock  # (the namespace's: the ages of its checks)
        self.cache = cache
        self.control = control
        self.metrics = metrics
        self.source = source
        self.xattrs = Xattrs(ns, source)
        # A RAM handle's bytes: a hit's until its first read makes them a memoryview (a
        # warm open is mostly served by the kernel's pages alone and never reads).
        self._mem: dict[FileHandleT, memoryview | bytes] = {}
        self._fds: dict[FileHandleT, int] = {}
        self._inode_of: dict[FileHandleT, int] = {}  # the inode of each data handle
        self._next: dict[FileHandleT, int] = {}  # pass-through: where the last read ended
        self._random: set[FileHandleT] = set()  # pass-through handles read at random
        self._partial: dict[int, list[int]] = {}  # kernel hits: inode -> [handle, users]
        self._failed: dict[int, float] = {}  # kernel hits: inode -> when a READ of it failed
        # Misses fetched at their first read (cache/deferred.py), where the kernel may hold
        # the pages (`kernel_pages`: the service's one map, which deferred opens feed).
        self._later: dict[FileHandleT, Deferred] = {}
        self._kernel = kernel_pages
        ns.on_change = cache.unverify  # a node's change ends the hit path's record of it
        self._reopen = cache.reopen
        self._unpin = cache.unpin
        self._settle = cache.take_hits  # before every handler but a hit's (fs/guard.py)
        self._next_fh = 1
        self._hit_info = pyfuse3.FileInfo(fh=0, keep_cache=True)  # (`_hit_open`'s answer)
        self._drops = BulkDrops()  # whether reopens push their bytes (kernel/pages.py)

    # --- namespace --------------------------------------------------------------------

    async def lookup(
        self, parent_inode: InodeT, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        if parent_inode == ROOT_INODE and name == NAME or Control.owns(parent_inode):
            return self.control.lookup(parent_inode, name, ctx)
        ino, st = await self.ns.lookup(parent_inode, name)
        if self.ns.retired:
            await self._drop_retired()
        return self.ns.attrs(ino, st)

    async def forget(self, inode_list: Sequence[tuple[InodeT, int]]) -> None:
        if self.control.sessions:  # an open control file ends when the kernel forgets it
            inode_list = self.control.forget(inode_list)
            if self._partial:  # (a forget can name many inodes: no coroutine per inode)
                for ino, _ in inode_list:
                    if ino in self._partial:
                        await self._let_go(ino)
        self.ns.forget(list(inode_list))
        # (also a partial forget: the kernel's pages may be gone)
        self._kernel.forget(ino for ino, _ in inode_list)
        unverify = self.cache.unverify
        for ino, _ in inode_list:
            unverify(ino)

    async def getattr(self, inode: InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if Control.owns(inode):
            return self.control.attrs(inode)
        return self.ns.attrs(inode, self.ns.stat(inode))

    async def readlink(self, inode: InodeT, ctx: pyfuse3.RequestContext) -> bytes:
        snap, i = self.ns.locate(inode)
        if not stat.S_ISLNK(snap.stat(i).st_mode):
            raise pyfuse3.FUSEError(errno.EINVAL)
        return await self.source.readlink(snap.child_path(i))

    async def opendir(self, inode: InodeT, ctx: pyfuse3.RequestContext) -> FileHandleT:
        if inode == DIR_INODE:
            self.control.check_access(ctx)
            return inode
        # List now, so that readdir (and errors) come from one snapshot.
        await self.ns.listing(inode)
        return inode

    async def readdir(self, fh: FileHandleT, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        if fh == DIR_INODE:
            for i, (name, entry) in enumerate(self.control.listing()):
                if i >= start_id and not pyfuse3.readdir_reply(token, name, entry, i + 1):
                    break
            return
        listing = await self.ns.listing(fh)
        # "." and ".." come first. The kernel takes no reference for them, so they are not
        # counted as lookups; ".." carries the directory's own attributes (the parent is
        # not tracked), which only `ls -ai` would notice.
        if start_id < 2:
            dot = self.ns.attrs(fh, self.ns.stat(fh))
            for i, name in ((0, b"."), (1, b"..")):
                if i >= start_id and not pyfuse3.readdir_reply(token, name, dot, i + 1):
                    return
            start_id = 2
        self._reply_rows(listing, start_id - 2, token)
        if self.ns.retired:
            await self._drop_retired()

    def _reply_rows(self, listing: Snapshot, start: int, token: pyfuse3.ReaddirToken) -> None:
        """readdirplus entries from row `start` of `listing` until the kernel's buffer is
        full."""
        remember_rows, timeout = self.ns.remember_rows, self.ns.timeout
        names, offs, n = listing.names, listing.offs, len(listing)
        # Rows are converted a chunk at a time: the kernel's buffer takes a few dozen.
        for lo in range(start, n, _READDIR_CHUNK):
            hi = min(lo + _READDIR_CHUNK, n)
            rows = listing.rows[lo:hi].tolist()
            inos = self.ns.claim_rows(listing, lo, hi)
            for k in range(hi - lo):
                i = lo + k
                name = names[offs[i] : offs[i + 1]]
                if not pyfuse3.readdir_reply(
                    token, name, attrs_of_row(inos[k], rows[k], timeout), i + 3
                ):
                    # Accepted readdirplus entries are lookups: the kernel will forget them.
                    remember_rows(listing, lo, i)
                    return
            remember_rows(listing, lo, hi)

    async def releasedir(self, fh: FileHandleT) -> None:
        pass

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        sv = await self.source.statvfs()
        return statfs_reply(sv)

    async def getxattr(self, inode: InodeT, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if Control.owns(inode):
            raise pyfuse3.FUSEError(errno.ENODATA)
        return await self.xattrs.get(inode, name)

    async def listxattr(self, inode: InodeT, ctx: pyfuse3.RequestContext) -> list[bytes]:
        if Control.owns(inode):
            return []
        return await self.xattrs.names(inode)

    # --- data -------------------------------------------------------------------------

    def _hit_open(
        self, inode: InodeT, flags: FlagT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.FileInfo | Pass:
        """The hit path, run before `open` (`_guarded`): a reopen of a file whose RAM entry
        an open verified since its node last changed (cache/face.py, `reopen`). PASS:
        `open`."""
        if flags & _WRITE_FLAGS or self.kernel_hits:
            return PASS
        data = self._reopen(inode, ctx.pid)
        if data is None:
            return PASS
        # (Nor is the kernel told of the open (KernelPages.opened): it was at the open that
        # verified, and a forget since would have dropped the record.)
        fh = self._next_fh
        self._next_fh = fh + 1
        self._inode_of[fh] = inode
        self._mem[fh] = data  # unpinned at release; a memoryview from its first read
        if self._drops.push(fh) and push_pages(inode, fh, data, self._inode_of):
            self.metrics.bytes_served += len(data)
        # One FileInfo for every hit: pyfuse3 copies its fields into the reply as the
        # handler returns, before any other request runs (no allocation per open).
        fi = self._hit_info
        fi.fh = fh
        return fi

    async def open(
        self, inode: InodeT, flags: FlagT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.FileInfo:
        if self.kernel_hits:
            # No-open mode from here on (kernel/no_open.py): the kernel answers this open
            # itself, and every later one without asking. What an open would do here, its
            # first read does (`_read_node`).
            raise pyfuse3.FUSEError(errno.ENOSYS)
        if Control.owns(inode):
            return self.control.open(inode, flags, ctx)
        # Source descriptors this open takes count against the opener (source/part.py).
        token = OPENER.set(ctx.uid)
        try:
            return await self._open(inode, flags, ctx.pid)
        finally:
            OPENER.reset(token)

    async def _open(self, inode: InodeT, flags: FlagT, pid: int) -> pyfuse3.FileInfo:
        """Open `inode` for reader `pid` (its job is the readers part's to find)."""
        if flags & _WRITE_FLAGS:
            raise erofs()
        st, path, checked = self.ns.opening(inode)
        changes = self.ns.changes  # whether a node changed while this open awaited
        if not stat.S_ISREG(st.st_mode):
            raise pyfuse3.FUSEError(errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EIO)
        due = self._clock() - checked >= self.ns.revalidate
        if due and await self.ns.fresh_stat(inode):  # a new version: a new node (namespace.py)
            raise await self._retire(inode)
        # Defer a miss's fetch where the kernel may serve every read (cache/deferred.py). Not
        # for a no-open read: the kernel asks because it lacks the pages.
        kernel = self._kernel
        seen = kernel.opened(inode)  # False: the kernel holds no pages of it
        if self.kernel_hits:
            # A READ: the kernel lacks the pages. Of a file it was thought to hold, it says
            # the kernel's pages are being reclaimed (speculation stages such files again).
            if seen:
                kernel.served(False)
            seen = lazy = False
        else:
            lazy = seen and kernel.worth_deferring()
        sig = Signature.of(st)  # the version looked up: the one the cache serves, whole
        try:
            got = await self.cache.open(inode, path, st, pid, lazy=lazy, sig=sig)
        except pyfuse3.FUSEError as exc:
            if exc.errno in MOVED:
                raise self.ns.stale(inode) from None
            raise
        except Changed:
            # The source has another version than the one looked up: the node is retired
            # (ESTALE, as when the path now leads to another file), never served under the
            # old version's inode and size.
            if await self.ns.fresh_stat(inode, force=True):
                raise await self._retire(inode) from None
            raise pyfuse3.FUSEError(errno.EIO) from None
        data = got.data
        if data is None:
            if got.later is not None:
                return await self._open_later(inode, got.later)
            if got.block is not None:
                self._blk[fh := self._handle(inode)] = got.block
                # Only a file whose every block is resident may keep the kernel's pages:
                # otherwise they could outlive a change that this open has just revalidated.
                return pyfuse3.FileInfo(fh=fh, keep_cache=got.keep)
            return await self._open_through(inode, path, st)
        self._mem[fh := self._handle(inode)] = data  # unpinned at release
        if changes == self.ns.changes:  # (the hit path's record: only the resident entry's)
            self.cache.verify(inode, data, sig, path, checked + self.ns.revalidate)
        # (Not while answering a no-open read: the kernel holds the pages it reads locked.)
        push = not self.kernel_hits and (not seen or self._drops.push(fh))
        if push and push_pages(inode, fh, data, self._inode_of):
            self.metrics.bytes_served += len(data)  # the kernel has them all
        # keep_cache: a node is one version (fs/namespace.py), and so are its pages.
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    async def _open_later(self, inode: InodeT, later: Deferred) -> pyfuse3.FileInfo:
        """A miss whose fetch waits for the handle's first read: answered with the kernel's
        pages once one lstat shows that the source still has the version looked up (else
        the node is retired, as at any open)."""
        try:
            changed = await self.ns.fresh_stat(inode, force=True)
        except BaseException:
            later.drop()
            raise
        if changed:
            later.drop()
            raise await self._retire(inode)
        self._later[fh := self._handle(inode)] = later
        later.answered()
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)  # the version looked up

    async def _retire(self, inode: int) -> pyfuse3.FUSEError:
        """ESTALE for an open of a node whose file has a new version (its cached bytes go)."""
        self.ns.retired.append((inode, True))
        await self._drop_retired()
        return self.ns.retire(inode)

    async def _drop_retired(self) -> None:
        """Drop what is cached under nodes that lost their file or version (`ns.retired`):
        no open of them is served again, and the new node has its own."""
        while self.ns.retired:
            inode, stale = self.ns.retired.pop()
            await self.cache.drop(inode, stale=stale)  # stale_entries, or evictions

    async def _open_through(self, inode: InodeT, path: bytes, st: StatLike) -> pyfuse3.FileInfo:
        fd, now = await self.source.open_file(path)
        try:
            # Another version than looked up: the node is retired as in `_open` (ESTALE
            # too if the path leads to another file now).
            moved = Signature.of(now) != Signature.of(st)
            if moved and await self.ns.fresh_stat(inode, force=True):
                raise await self._retire(inode)
        except BaseException:
            await self.source.close_fd(fd)
            raise
        self._fds[fh := self._handle(inode)] = fd
        # No pages kept: the source is read as it is now, the pages are of earlier reads.
        return pyfuse3.FileInfo(fh=fh, keep_cache=False)

    def _handle(self, inode: int) -> FileHandleT:
        """A new file handle of `inode`."""
        fh = self._next_fh
        self._next_fh += 1
        self._inode_of[fh] = inode
        return fh

    async def read(self, fh: FileHandleT, off: int, size: int) -> bytes:
        if self.kernel_hits:
            return await self._read_node(fh, off, size)
        return await self._read(fh, off, size)

    async def _read_node(self, inode: InodeT, off: int, size: int) -> bytes:
        """A READ under no-open, which names the inode (kernel/no_open.py): the kernel lacks
        these pages. A resident file whose version an earlier read verified (the record the
        hit path reads) is served at once; anything else is opened as an open would be,
        read, and let go. A read at offset 0 counts as the file's open: the kernel serves
        the pages it holds without asking, so a read that starts there is a reader's first
        look at a file it lacks."""
        if Control.owns(inode):
            return self.control.read(inode, off, size)
        if self.control.pending_plans:  # (no close is seen: control/files.py, Sessions)
            self.control.install_plans()
        data = self._reopen(inode, KERNEL_PID) if not off else self.cache.verified_bytes(inode)
        if data is not None:
            if not off:
                self._unpin(data)  # (`reopen` pins for a handle; this read holds none)
            chunk = cast(bytes, memoryview(data)[off : off + size])
            self.metrics.bytes_served += len(chunk)
            return chunk
        # A file the kernel reads in several READs (some at once: its read-ahead) keeps the
        # handle that the first opened (`_partial`: [handle, READs using it, whether one
        # reached the end]): its bytes are fetched once, whether or not the cache admitted
        # them, and a large file's source descriptor is opened once. A handle is let go when
        # no READ uses it, once a READ reached the file's end, or as the oldest idle one
        # past _PARTIAL.
        got = self._partial.get(inode)
        if got is None:
            failed = self._failed.get(inode)
            if failed is not None and self._clock() - failed < _RETRY_WINDOW:
                raise pyfuse3.FUSEError(errno.EIO)  # (the kernel's retry of a failed READ)
            try:
                fh = (await self._open(inode, os.O_RDONLY, KERNEL_PID)).fh
            except pyfuse3.FUSEError as exc:
                if exc.errno == errno.EIO:
                    self._failed_read(inode)
                elif exc.errno == errno.ESTALE:  # the reader's next open must look it up
                    await entries_forgotten(_FORGET_WAIT)
                raise
            got = self._partial.setdefault(inode, [fh, 0, 0])
            if got[0] != fh:
                await self._release(fh)  # (another READ of it opened first)
            elif len(self._partial) > _PARTIAL:
                await self._let_go(next((i for i, g in self._partial.items() if not g[1]), -1))
        got[1] += 1
        try:
            chunk = await self._read(got[0], off, size)
        except BaseException:
            got[1] -= 1
            await self._let_go(inode, got)
            raise
        got[1] -= 1
        if len(chunk) < size or off + size >= self.ns.stat(inode).st_size:
            got[2] = 1  # read to its end
        # (verified: the next READs are served above)
        if got[2] or self.cache.verified_bytes(inode) is not None:
            await self._let_go(inode, got)
        return chunk

    def _failed_read(self, inode: int) -> None:
        now = self._clock()
        if len(self._failed) >= _PARTIAL:
            self._failed = {i: t for i, t in self._failed.items() if now - t < _RETRY_WINDOW}
        self._failed[inode] = now

    async def _let_go(self, inode: int, got: list[int] | None = None) -> None:
        """Release `inode`'s kept handle (`_read_node`) if no READ uses it (and it is
        `got`, when given)."""
        kept = self._partial.get(inode)
        if kept is not None and not kept[1] and (got is None or kept is got):
            del self._partial[inode]
            await self._release(kept[0])

    async def _read(self, fh: FileHandleT, off: int, size: int) -> bytes:
        mv = self._mem.get(fh)
        if mv is not None:
            if type(mv) is bytes:  # its first read: the kernel lacked the pages
                mv = self._mem[fh] = memoryview(mv)
                if len(mv) <= PUSH_MAX:  # (a larger file is read whatever the kernel keeps)
                    self._drops.read(fh)
            # A slice of the resident bytes, not a copy: pyfuse3 takes any buffer.
            chunk = cast(bytes, mv[off : off + size])
        elif fh in self._fds:
            fd = self._fds[fh]
            if off != self._next.get(fh, off) and fh not in self._random:
                self._random.add(fh)  # a random reader: no source read-ahead under ours
                advise(fd, True)
            self._next[fh] = off + size
            chunk = await self.source.pread(fd, size, off, fh in self._random)
        elif fh in self._blk:
            chunk = await self.cache.read_block(self._blk[fh], off, size)
        elif fh in self._later:  # its first read fetches (cache/deferred.py)
            mv = self._mem[fh] = await self._read_later(fh)
            chunk = cast(bytes, mv[off : off + size])
        else:
            return self.control.read(fh, off, size)
        self.metrics.bytes_served += len(chunk)
        return chunk

    async def _read_later(self, fh: FileHandleT) -> memoryview:
        """The bytes of a deferred handle (cache/deferred.py), which then serves them as any
        RAM handle: its first read fetches, and every read sees the same outcome."""
        later = self._later[fh]
        try:
            mv = await later.read()
        except pyfuse3.FUSEError as exc:
            if exc.errno in MOVED:
                raise self.ns.stale(self._inode_of[fh]) from None
            raise
        except Changed:
            # The file changed between the open and its first read: EIO (the kernel may
            # have served this handle the old version's pages), and the node is due a
            # check: its next open retires it, and the kernel's retry opens the new
            # version under a new node.
            await self.ns.fresh_stat(self._inode_of[fh], force=True)
            raise pyfuse3.FUSEError(errno.EIO) from None
        self._later.pop(fh, None)
        return mv

    def _hit_release(self, fh: FileHandleT) -> None | Pass:
        """The release of a handle that serves resident bytes (every hit's): no coroutine
        beyond the handler's (`_guarded`). PASS: `release`."""
        mv = self._mem.pop(fh, None)
        if mv is None:
            return PASS
        del self._inode_of[fh]
        self._unpin(mv if isinstance(mv, bytes) else cast(bytes, mv.obj))
        return None

    async def release(self, fh: FileHandleT) -> None:
        await self._release(fh)

    async def _release(self, fh: FileHandleT) -> None:
        self._inode_of.pop(fh, None)
        mv = self._mem.pop(fh, None)
        if mv is not None:
            self._unpin(mv if isinstance(mv, bytes) else cast(bytes, mv.obj))
            return
        fd = self._fds.pop(fh, None)
        if fd is not None:
            self._next.pop(fh, None)
            self._random.discard(fh)
            await self.source.close_fd(fd)
        elif fh in self._blk:
            await self.cache.release_block(self._blk.pop(fh))
        elif (later := self._later.pop(fh, None)) is not None:
            later.drop()
        elif self.control.owns_handle(fh):
            self.control.release(fh)

    async def write(self, fh: FileHandleT, off: int, buf: bytes) -> int:
        if self.control.holds(fh):
            return await self.control.write(fh, buf)
        raise erofs()

    async def setattr(
        self,
        inode: InodeT,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: FileHandleT | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        # `echo cmd > ctl` truncates first; truncating a control file is a no-op.
        if Control.owns(inode) and inode != DIR_INODE and not fields.update_mode:
            return self.control.attrs(inode)
        raise erofs()
