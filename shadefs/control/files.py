"""The `.shadefs` control directory: a sysfs-like interface inside the mount.

`MOUNT/.shadefs/` is found by lookup but never listed by readdir of the root (torchvision's
`find_classes` would otherwise make it a class). It belongs to the mounting user with mode
0700, and the daemon refuses anyone else with EACCES even where the kernel would not.
docs/control-protocol.md is the contract for every entry; in short:

- `stats`, `stats.json`, `metrics`: counters, rendered when the file is opened so that one
  read sees one consistent snapshot;
- `ctl`: text commands, one per line, all validated before any is applied (commands.py);
- `dataset`, `losses`, `order`: the sampler's binary channel, and `residency`, `plan`:
  relative paths, one per line (channel.py).

This module serves the inodes and the open handles: attributes, permissions, reads, and
writes dispatched to commands.py or channel.py. Control files use direct_io, so every read
reaches the daemon and their reported size (0) does not matter. Anything malformed fails
the write with EINVAL (a ctl write over the size limit with EFBIG), leaves the state
untouched and poisons the handle of a stream, so that a client retrying a short write sees
the error too. Control parses and dispatches only: the daemon's service object, seen
through control/service.py's ControlService, does the work.

Sessions (under kernel hits, kernel/no_open.py): the kernel then opens every regular file
itself and never says when it closes one, and no `direct_io` can be asked for. So each
lookup of a control file makes a node of its own (numbered from SESSION_BASE, entry and
attribute timeouts 0, so that every path walk looks up anew): the node is the open file,
made with the looking-up process's pid and uid, and ended when the kernel forgets it. Its
reported size bounds what the kernel reads: the content rendered at the lookup, or what a
response holds after a request was written. A file's pages then never outlive its one open.
No close is ever seen, so a `plan` written since is installed once its writer has been
quiet for PLAN_QUIET seconds (`run`), or sooner, before the next read the daemon serves or
the next lookup of a control file (`install_plans`), and again if more is written.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from collections.abc import Callable, Sequence

import pyfuse3
import trio
from pyfuse3 import InodeT

from shadefs.control import commands
from shadefs.control.channel import Channel, dataset_summary
from shadefs.control.commands import CTL_MAX_WRITE, CommandError
from shadefs.control.entries import (
    BY_INO,
    BY_NAME,
    CHANNEL,
    CTL,
    DATASET,
    DIR_INODE,
    FH_BASE,
    FILES,
    METRICS,
    PLAN,
    SESSION_BASE,
    STATS,
    STATS_JSON,
    Handle,
    Spec,
)
from shadefs.control.service import ControlService, Rejected
from shadefs.ops.stats_text import render_text
from shadefs.prefetch.plans import writer_name
from shadefs.sampling import wire
from shadefs.stats import Metrics, Stats

log = logging.getLogger(__name__)

#: Under sessions, a plan is installed once no plan was written for this long (`Control.run`).
PLAN_QUIET = 0.2


class Control:
    """Serves the control inodes and dispatches what is written to them.

    :service: the daemon, as control sees it
    :stats: builds the stats snapshot that `stats`, `stats.json` and `metrics` render
    :metrics: counts rejected control input; its start time dates the control entries
    """

    def __init__(
        self,
        service: ControlService,
        stats: Callable[[], Stats],
        metrics: Metrics,
        *,
        uid: int | None = None,
        gid: int | None = None,
        sessions: bool = False,
    ) -> None:
        self.service = service
        self.stats = stats
        self.metrics = metrics
        self.channel = Channel(service)
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self.last_result = "none yet"
        self._handles: dict[int, Handle] = {}
        self._next_fh = FH_BASE
        self.sessions = sessions  # a node per lookup (module doc, "Sessions")
        self._next_session = SESSION_BASE
        self.pending_plans: set[int] = set()  # sessions whose plan grew since installed
        self._plan_written = trio.Event()  # (set by each write to a plan session: `run`)

    # --- namespace --------------------------------------------------------------------

    @staticmethod
    def owns(ino: int) -> bool:
        return ino == DIR_INODE or ino in BY_INO or ino >= SESSION_BASE

    def attrs(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        handle = self._handles.get(ino) if ino >= SESSION_BASE else None
        if ino == DIR_INODE:
            a.st_mode = stat.S_IFDIR | 0o700
            a.st_nlink = 2
        elif handle is not None:
            a.st_mode = handle.spec.mode
            a.st_nlink = 1
        elif ino in BY_INO:
            a.st_mode = BY_INO[ino].mode
            a.st_nlink = 1
        else:  # a session the kernel forgot
            raise pyfuse3.FUSEError(errno.ESTALE)
        a.st_uid = self.uid
        a.st_gid = self.gid
        # A session's size bounds the kernel's reads (module doc): its content, or after a
        # request the offsets its response is read at (`read`).
        a.st_size = 0 if handle is None else handle.written + len(handle.data)
        a.st_blksize = 4096
        now = int(self.metrics.started * 1e9)
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = now
        if handle is not None:
            # Each response a new mtime: the kernel drops the pages it kept of the request.
            a.st_mtime_ns = a.st_ctime_ns = now + handle.written
        # Short timeouts: nothing is cached about control entries for long; under kernel
        # hits nothing at all, so that every open looks up a session of its own.
        a.entry_timeout = a.attr_timeout = 0.0 if self.sessions else 1.0
        return a

    def lookup(
        self, parent: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        if parent == DIR_INODE:
            spec = BY_NAME.get(name)
            if spec is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            if self.sessions:
                self.install_plans()
                return self.attrs(self._session(spec, ctx))
            return self.attrs(spec.ino)
        return self.attrs(DIR_INODE)

    def _session(self, spec: Spec, ctx: pyfuse3.RequestContext) -> int:
        """A node for one open of `spec` by the process looking it up (module doc)."""
        self.check_access(ctx)
        ino = self._next_session
        self._next_session += 1
        self._handles[ino] = Handle(spec, self._content(spec), writer_name(ctx.pid), ctx.pid)
        return ino

    async def run(self) -> None:
        """Under sessions: install the plans written to, once no plan was written for
        PLAN_QUIET seconds. A plan arrives in many WRITEs, and each install parses the whole
        plan again, so not at each; a writer that pauses longer has its plan installed as
        far as written, then again whole."""
        while True:
            await self._plan_written.wait()
            while True:
                self._plan_written = trio.Event()
                with trio.move_on_after(PLAN_QUIET):
                    await self._plan_written.wait()
                    continue  # written again: wait for quiet anew
                break
            if self.pending_plans:
                self.install_plans()

    def install_plans(self) -> None:
        """Install the plans written to sessions since they were last installed (module
        doc: under kernel hits no close is seen); each replaces its writer's last plan."""
        for ino in self.pending_plans:
            handle = self._handles.get(ino)
            if handle is not None:
                self.channel.release(handle)
        self.pending_plans.clear()

    def forget(self, inodes: Sequence[tuple[InodeT, int]]) -> Sequence[tuple[InodeT, int]]:
        """End the sessions among `inodes` that the kernel forgot; the others."""
        rest = []
        for ino, n in inodes:
            if ino >= SESSION_BASE:
                self.release(ino)
            else:
                rest.append((ino, n))
        return rest

    def listing(self) -> list[tuple[bytes, pyfuse3.EntryAttributes]]:
        return [(s.name, self.attrs(s.ino)) for s in FILES]

    def check_access(self, ctx: pyfuse3.RequestContext) -> None:
        if ctx.uid not in (self.uid, 0):
            raise pyfuse3.FUSEError(errno.EACCES)

    # --- files ------------------------------------------------------------------------

    def owns_handle(self, fh: int) -> bool:
        return fh >= FH_BASE

    def holds(self, fh: int) -> bool:
        """Whether `fh` is an open control file (a handle, or a session's node)."""
        return fh in self._handles

    def open(self, ino: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        self.check_access(ctx)
        spec = BY_INO.get(ino)
        if spec is None:
            raise pyfuse3.FUSEError(errno.EISDIR)
        accmode = flags & os.O_ACCMODE
        if accmode != os.O_RDONLY and not spec.mode & 0o200:
            raise pyfuse3.FUSEError(errno.EACCES)
        if accmode != os.O_WRONLY and not spec.mode & 0o400:
            raise pyfuse3.FUSEError(errno.EACCES)
        fh = self._next_fh
        self._next_fh += 1
        # One plan per writing process: a job that writes a new plan replaces its old one.
        self._handles[fh] = Handle(spec, self._content(spec), writer_name(ctx.pid), ctx.pid)
        return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)

    def _content(self, spec: Spec) -> bytes | bytearray:
        if spec is STATS:
            return render_text(self.stats()).encode()
        if spec is STATS_JSON:
            return (json.dumps(self.stats().to_json(), indent=1, sort_keys=True) + "\n").encode()
        if spec is METRICS:
            from shadefs.ops.prom import render

            return render(self.stats())
        if spec is CTL:
            return commands.help_text(self.service, self.last_result).encode()
        if spec is DATASET:
            return dataset_summary(self.service)
        return bytearray()

    def read(self, fh: int, off: int, size: int) -> bytes:
        handle = self._handles.get(fh)
        if handle is None:  # (under kernel hits: a node that is not a session's)
            raise pyfuse3.FUSEError(errno.EIO)
        if handle.base is None:
            # A transaction file answers from the start of its response whether the client
            # seeks back to 0 after writing its request or reads straight on from there.
            handle.base = handle.written if handle.written and off >= handle.written else 0
        start = off - handle.base
        return bytes(handle.data[start : start + size]) if start >= 0 else b""

    async def write(self, fh: int, buf: bytes) -> int:
        handle = self._handles.get(fh)
        if handle is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        handle.written += len(buf)
        if handle.poisoned:
            # Keep the first error in last_result: that is the one the client must see.
            raise pyfuse3.FUSEError(errno.EINVAL)
        if handle.spec is CTL and len(buf) > CTL_MAX_WRITE:
            # The kernel splits a write larger than max_write, and each part would be
            # applied on its own: refuse the first part, so that the write fails whole.
            self._reject(
                handle,
                f"a ctl write may hold at most {CTL_MAX_WRITE} bytes, got {len(buf)} or more: "
                "nothing was applied",
            )
            raise pyfuse3.FUSEError(errno.EFBIG)
        try:
            if handle.spec is CTL:
                self.last_result = await commands.execute(self.service, buf, handle.pid)
                log.info("control: %s", self.last_result)
            elif handle.spec in CHANNEL:
                result = await self.channel.write(handle, buf)
                if result is not None:
                    self.last_result = result
                if self.sessions and handle.spec is PLAN:
                    self.pending_plans.add(fh)
                    self._plan_written.set()
            else:
                raise pyfuse3.FUSEError(errno.EBADF)
        except (CommandError, Rejected, wire.WireError) as exc:
            # A ctl write stands alone (one echo, one command); a stream does not, and what
            # it buffered is dropped: nothing more is kept for a refused message.
            handle.poisoned = handle.spec is not CTL
            handle.pending = bytearray()
            self._reject(handle, str(exc))
            raise pyfuse3.FUSEError(errno.EINVAL) from None
        return len(buf)

    def _reject(self, handle: Handle, why: str) -> None:
        self.metrics.control_errors += 1
        self.last_result = f"error: {why}"
        log.warning("rejected control input on %s: %s", handle.spec.name.decode(), why)

    def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if handle is None or handle.spec is CTL:
            return
        if self.sessions and handle.spec is PLAN and fh not in self.pending_plans:
            return  # (installed already: install_plans)
        self.pending_plans.discard(fh)
        self.channel.release(handle)
