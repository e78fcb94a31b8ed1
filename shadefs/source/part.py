"""All access to the backing tree (usually an NFS mount).

Every call that may block on the remote runs in a worker thread behind one
`trio.CapacityLimiter`, under a timeout that runs from the call, whether it waits for a
thread or runs in one: a hung NFS server turns into EIO for the caller instead of a hung
training job, even when every thread is stuck in it. The number of threads stuck in the
kernel is bounded by the limiter (a token comes back only when its thread really finishes,
so abandoned calls keep holding theirs, counted as `threads_stuck`); `source/calls.py` does
all this at the least cost trio allows. Every source access goes through `Source.run`:
lookups, opens, reads, listings, links, xattrs, statfs, the prefetcher's and speculation's
batches, block loads. Errors become `pyfuse3.FUSEError` with the source's errno.

Paths are bytes relative to the source root (b"" is the root itself), so names that are not
valid UTF-8 survive unchanged. They are resolved by `source_paths.Resolver` from a descriptor
of the root that is held for the daemon's life, and never through a symlink: whoever can
write into the source may swap a file or a directory for a symlink at any moment, and the
daemon must never open anything outside it. A symlink met on the way is ELOOP.

Fetches are bounded: a file is read up to the size that was looked up plus a small margin,
however fast it grows while it is read (see `read_file`). A fetch is one version of the file:
its fstat is taken before and after the read, and a read during which the file changed is
retried once, then fails with EIO; it is never handed out as the file.

The outage state is tracked here so that a dead server is logged once per outage, not once
per request. A source that is remounted on the same path (a FUSE or automounted source that
was restarted) leaves the held root descriptor on the dead mount: a call that fails with
an outage's errno (EIO, ENOTCONN, ECONNABORTED, ESTALE, ENODEV) looks at the path again, and
when it resolves to another root (st_dev, st_ino) the root is reopened and the call is
retried once. A root that was a mount point must be one again: until the new source is
mounted, the path shows the empty directory under it, which is not the source.

Descriptors held open for readers (pass-through and block handles) are counted per user:
with `--allow-other`, another user holding thousands of opens would otherwise fill the
daemon's descriptor table, and every user's reads would fail with EMFILE. A user other than
the mount's owner (and root) may hold at most `FdBudget.per_user` source descriptors, and
all of them together at most half of the budget; past that their opens fail with EMFILE,
logged once per user, and the owner keeps working. The opener is the `OPENER` context
variable, which the FUSE open handler sets for the duration of the request.
"""

from __future__ import annotations

import contextvars
import errno
import logging
import os
import resource
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import pyfuse3
import trio

from shadefs.source.calls import Calls, TimedOut
from shadefs.source.inline import InlineReads
from shadefs.source.paths import Resolver, version
from shadefs.source.reads import pread_spread, readahead_bytes
from shadefs.stats import SourceStats

log = logging.getLogger(__name__)

T = TypeVar("T")

# Errors that answer a question about a file rather than say the source is failing. ELOOP is
# a symlink where the daemon expected a directory or a file: it is refused, not followed.
_ANSWERS = (errno.ENOENT, errno.ENOTDIR, errno.ENODATA, errno.ELOOP)
# What a dead mount under the held root descriptor answers.
_OUTAGES = (errno.EIO, errno.ENOTCONN, errno.ECONNABORTED, errno.ESTALE, errno.ENODEV)
# How far a fetch may read past the size it expects: enough to see that the file grew,
# never enough to follow a file that grows without end.
_MARGIN = 64 << 10

#: The uid of the process whose open request is being served (None: the daemon's own work).
OPENER: contextvars.ContextVar[int | None] = contextvars.ContextVar("opener", default=None)


class FdBudget:
    """Source descriptors held for readers, per user, against the daemon's own limit.

    :per_user: the most one user other than the owner may hold
    :others: the most all users other than the owner may hold together
    """

    def __init__(self, budget: int, owner: int) -> None:
        self.owner = owner
        self.per_user = max(budget // 8, 8)
        self.others = max(budget // 2, self.per_user)
        self.held: dict[int, int] = {}  # uid -> descriptors held
        self._uid_of: dict[int, int] = {}  # fd -> the uid it counts against
        self._others_held = 0
        self._warned: set[int] = set()

    @staticmethod
    def of_process(threads: int) -> int:
        """What the source may hold: the descriptor limit less a reserve for the daemon's
        own files (/dev/fuse, the SSD tier, sockets) and one per worker thread's fetch."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return max(soft - 128 - 2 * threads, 16)

    def _capped(self, uid: int) -> bool:
        return uid not in (self.owner, 0)

    def take(self, uid: int | None) -> None:
        """Count one more descriptor for `uid` (before it is opened, so that concurrent
        opens cannot overshoot); EMFILE if `uid` may not have another."""
        if uid is None:
            return
        mine = self.held.get(uid, 0)
        if self._capped(uid) and (mine >= self.per_user or self._others_held >= self.others):
            if uid not in self._warned:
                self._warned.add(uid)
                log.warning(
                    "user %d holds %d source descriptors (at most %d per user, %d for all "
                    "users but the owner): its further read-through opens fail with EMFILE",
                    uid,
                    mine,
                    self.per_user,
                    self.others,
                )
            raise pyfuse3.FUSEError(errno.EMFILE)
        self._add(uid, 1)

    def opened(self, fd: int, uid: int | None) -> None:
        """The descriptor `take` counted for `uid` is `fd`."""
        if uid is not None:
            self._uid_of[fd] = uid

    def give_back(self, uid: int | None) -> None:
        """Uncount a descriptor `take` counted but that was never opened."""
        if uid is not None:
            self._add(uid, -1)

    def closing(self, fd: int) -> None:
        uid = self._uid_of.pop(fd, None)
        if uid is not None:
            self._add(uid, -1)

    def _add(self, uid: int, n: int) -> None:
        left = self.held.get(uid, 0) + n
        if left:
            self.held[uid] = left
        else:
            del self.held[uid]
        if self._capped(uid):
            self._others_held += n


class Source:
    """The backing tree, seen through bounded, timed-out worker threads.

    :root: the source directory (absolute, bytes; for messages: access goes through `paths`)
    :paths: the no-follow resolver, holding the root's descriptor
    :timeout: seconds before a source call is abandoned and answered with EIO
    :healthy: False between a timeout and the next successful call
    :fds: the descriptors held for readers, per user
    """

    def __init__(
        self,
        root: str | bytes,
        *,
        max_threads: int = 32,
        timeout: float = 30.0,
        use_openat2: bool | None = None,
        fd_budget: int | None = None,
        inline: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._clock = clock  # (seconds: how long an outage has lasted)
        self.root = os.path.abspath(os.fsencode(root))
        self.paths = Resolver(self.root, use_openat2=use_openat2)
        # Small files the source has cached are read on the loop (source/inline.py).
        self.inline = InlineReads(self.paths, enabled=inline)
        self._use_openat2 = use_openat2
        self._root_id = _identity(os.fstat(self.paths.root_fd))
        self._mount_point = _is_mount_point(self.root)
        self._reopen_lock = threading.Lock()
        self.reopens = 0
        self.timeout = timeout
        self.limiter = trio.CapacityLimiter(max_threads)
        self.calls = Calls(self.limiter)  # threads and deadlines (source/calls.py)
        self.healthy = True
        self.timeouts = 0
        self.errors = 0
        self.bytes_read = 0
        self._outage_since = 0.0
        budget = FdBudget.of_process(max_threads) if fd_budget is None else fd_budget
        self.fds = FdBudget(budget, os.getuid())
        # A random reader's large reads go in pieces of this size at once (source/reads.py).
        self.piece = readahead_bytes(self._root_id[0])

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
            inline_reads=self.inline.reads,
            threads_busy=self.limiter.borrowed_tokens,
            threads_stuck=self.calls.stuck,
            queue_timeouts=self.calls.queue_timeouts,
        )

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run fn(*args) in a worker thread; OSError -> FUSEError, timeout -> EIO."""
        try:
            result: T = await self.calls.run(self.timeout, self._call, fn, args)
        except OSError as exc:
            raise self._failed(exc) from None
        except TimedOut:
            self.timeouts += 1
            if self.healthy:
                self.healthy = False
                self._outage_since = self._clock()
                log.error(
                    "source %s did not answer within %.1f s: serving cached files only, "
                    "misses fail with EIO until it recovers",
                    os.fsdecode(self.root),
                    self.timeout,
                )
            raise pyfuse3.FUSEError(errno.EIO) from None
        self._mark_healthy()
        return result

    def _failed(self, exc: OSError) -> pyfuse3.FUSEError:
        """The FUSE error a source call's OSError answers (ENOENT and friends are answers,
        not outages)."""
        self._mark_healthy()
        if exc.errno not in _ANSWERS:
            self.errors += 1
        # A dead server (ENOTCONN or ECONNABORTED from a crashed FUSE source, ESTALE from
        # NFS) is an I/O error to the reader, not a property of the file.
        return pyfuse3.FUSEError(exc.errno if exc.errno not in (None, *_OUTAGES) else errno.EIO)

    def _call(self, fn: Callable[..., T], args: tuple[object, ...]) -> T:
        """fn(*args) in the worker thread, retried once on a reopened root (module doc)."""
        old = self.paths
        try:
            return fn(*args)
        except OSError as exc:
            if exc.errno not in _OUTAGES or not self._reopen(old):
                raise
        new = self.paths
        # The call is rebuilt on the new root: a method of the old resolver, or the old
        # resolver as an argument. Anything else (a descriptor of the dead mount) fails again.
        if getattr(fn, "__self__", None) is old:
            fn = getattr(new, fn.__name__)
        return fn(*(new if a is old else a for a in args))

    def _reopen(self, old: Resolver) -> bool:
        """Whether the root was reopened since `old` (a new root at the same path)."""
        with self._reopen_lock:
            if self.paths is not old:
                return True  # another thread got there first
            try:
                if _identity(os.stat(self.root)) == self._root_id:
                    return False  # the same root: a real outage, or a real EIO
                if _is_mount_point(self.root) != self._mount_point:
                    return False  # not mounted again yet: the directory under the mount
                new = Resolver(self.root, use_openat2=self._use_openat2)
            except OSError:
                return False
            # The old resolver is not closed here: calls in other threads may still use its
            # descriptor, and a closed number could be reused for another directory. It is
            # closed when the last of them lets it go.
            self._root_id = _identity(os.fstat(new.root_fd))
            self.paths = new
            self.reopens += 1
        log.warning("source %s was remounted: reopened its new root", os.fsdecode(self.root))
        return True

    def _mark_healthy(self) -> None:
        if not self.healthy:
            self.healthy = True
            log.warning(
                "source %s answers again after %.1f s",
                os.fsdecode(self.root),
                self._clock() - self._outage_since,
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
        """The file's bytes and the fstat taken on the open descriptor, unchanged by the
        end of the read (else retried once, then EIO: a torn read is never returned).

        At most min(fstat size, `size`) plus a margin are read (`size`: what the caller
        looked up), so a file that grows while it is read costs a bounded fetch. The bytes
        are the whole file only if len(data) == st.st_size; otherwise they are the start
        of a version larger than `size` (and its fstat says how large).
        """
        got = self.read_now(rel, size)
        if got is None:
            got = await self.run(_read_bounded, self.paths, rel, size)
            self.bytes_read += len(got[0])
        return got

    def read_now(self, rel: bytes, size: int | None = None) -> tuple[bytes, os.stat_result] | None:
        """`read_file` answered at once on the calling thread, where the source holds the
        file in memory (`InlineReads`: a local disk's page cache); None where it would
        wait (then `read_files`)."""
        got = self.inline.read(self.paths, rel, size) if self.inline.enabled else None
        if got is not None:
            self.bytes_read += len(got[0])
        return got

    async def read_files(
        self, items: Sequence[tuple[bytes, int | None]]
    ) -> tuple[list[tuple[bytes, os.stat_result] | pyfuse3.FUSEError], float]:
        """`read_file` of each (path, size) in one worker thread: what a small file costs
        in the thread (a few syscalls) is far less than a thread hop (prefetch batches).
        Each file's outcome: (bytes, fstat) or its FUSE error; and the seconds the thread
        spent reading, per file (the source's own latency, without the hop). The files the
        source answers at once are the caller's to read first (`read_now`, flights.py)."""
        got, seconds = await self.run(self._read_many, items)
        out = [self._failed(res) if isinstance(res, OSError) else res for res in got]
        self.bytes_read += sum(len(one[0]) for one in out if isinstance(one, tuple))
        return out, seconds

    def _read_many(
        self, items: Sequence[tuple[bytes, int | None]]
    ) -> tuple[list[tuple[bytes, os.stat_result] | OSError], float]:
        t0 = time.perf_counter()
        got: list[tuple[bytes, os.stat_result] | OSError] = []
        for rel, size in items:
            try:  # each file on the current root (_call: a remounted source is reopened)
                got.append(self._call(_read_bounded, (self.paths, rel, size)))
            except OSError as exc:
                got.append(exc)
        return got, (time.perf_counter() - t0) / max(len(items), 1)

    async def open_fd(self, rel: bytes) -> int:
        """A read descriptor for pass-through reads (regular files only)."""
        fd, _ = await self.open_file(rel)
        return fd

    async def open_file(self, rel: bytes) -> tuple[int, os.stat_result]:
        """A read descriptor and its fstat (which file and version the reads will give);
        EMFILE when the opening user holds its share of descriptors already (`FdBudget`)."""
        uid = OPENER.get()
        self.fds.take(uid)
        try:
            fd, st = await self.run(self.paths.open_regular, rel)
        except BaseException:
            self.fds.give_back(uid)
            raise
        self.fds.opened(fd, uid)
        return fd, st

    async def pread(self, fd: int, size: int, off: int, random: bool = False) -> bytes:
        """`random`: the descriptor is read at random (fadvised so); a large read then goes
        in pieces that travel together (source/reads.py)."""
        data = await self.run(pread_spread, fd, size, off, self.piece if random else 0)
        self.bytes_read += len(data)
        return data

    async def close_fd(self, fd: int) -> None:
        # close() on NFS can block (it flushes), so it goes through a thread as well.
        self.fds.closing(fd)
        try:
            await self.run(os.close, fd)
        except pyfuse3.FUSEError:
            pass


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _is_mount_point(path: bytes) -> bool:
    """Whether `path` is the root of a mounted filesystem (another device than its parent)."""
    st = os.stat(path)
    parent = os.stat(os.path.join(path, b".."))
    return st.st_dev != parent.st_dev or st.st_ino == parent.st_ino


def _read_bounded(paths: Resolver, rel: bytes, size: int | None) -> tuple[bytes, os.stat_result]:
    for _ in range(2):
        fd, st = paths.open_regular(rel)
        try:
            data = _read_fd(fd, st, size)
            after = os.fstat(fd)
        finally:
            os.close(fd)
        if version(after) == version(st):
            return data, st
        log.info("%r changed while it was read: reading it again", rel)
    raise OSError(errno.EIO, "the file kept changing while it was read")


def _read_fd(fd: int, st: os.stat_result, size: int | None) -> bytes:
    want = st.st_size if size is None else min(st.st_size, size)
    cap = want + max(_MARGIN, want // 100)
    chunks = []
    got = 0
    while got < cap:
        # What fstat promised first, then once more to see EOF (or that the file grew).
        asked = min(max(want - got, _MARGIN), cap - got)
        chunk = os.read(fd, asked)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
        if len(chunk) < asked and got >= want:
            # A short read of a regular file is its end: no read more to see it (the fstat
            # after the read tells whether the file changed meanwhile).
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
