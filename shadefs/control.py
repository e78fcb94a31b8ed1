"""The `.shadefs` control directory: a sysfs-like interface inside the mount.

`MOUNT/.shadefs/` is found by lookup but never listed by readdir of the root (torchvision's
`find_classes` would otherwise make it a class). It belongs to the mounting user with mode
0700, and the daemon refuses anyone else with EACCES even where the kernel would not.

Entries:

- `stats`: human-readable counters; `stats.json` the same as JSON (both rendered when the
  file is opened, so one read sees one consistent snapshot);
- `ctl`: text commands, one per line. A write is validated as a whole before anything is
  applied: one bad line fails the write() with EINVAL and changes nothing. Reading `ctl`
  gives the command list and the result of the last write.

Control files use direct_io, so every read reaches the daemon and their reported size (0)
does not matter. This module parses and dispatches only: what a command does lives in the
object it is dispatched to.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

import pyfuse3

from shadefs.cache import Cache
from shadefs.common import format_size, parse_size
from shadefs.metrics import Metrics, render_text
from shadefs.policy import POLICIES, make_policy

log = logging.getLogger(__name__)

NAME = b".shadefs"
DIR_INODE = 2
_FH_BASE = 1 << 62

_LOG_LEVELS = ("debug", "info", "warning", "error")

HELP = """\
# shadefs control file: write one command per line, e.g.  echo 'ram 8G' > ctl
# A bad line fails the whole write with EINVAL and changes nothing.
policy NAME      switch the eviction policy ({policies})
ram SIZE         set the RAM budget (bytes or K/M/G/T suffix); shrinking evicts at once
drop             drop every cached file from RAM
log-level LEVEL  set the daemon's log level ({levels})
"""


class CommandError(ValueError):
    """A control command that cannot be accepted; the message says why."""


@dataclass(frozen=True)
class _Spec:
    name: bytes
    ino: int
    mode: int


_STATS = _Spec(b"stats", 3, stat.S_IFREG | 0o400)
_STATS_JSON = _Spec(b"stats.json", 4, stat.S_IFREG | 0o400)
_CTL = _Spec(b"ctl", 5, stat.S_IFREG | 0o600)
_FILES = (_STATS, _STATS_JSON, _CTL)
_BY_NAME = {s.name: s for s in _FILES}
_BY_INO = {s.ino: s for s in _FILES}


class _Handle:
    __slots__ = ("spec", "data")

    def __init__(self, spec: _Spec, data: bytes) -> None:
        self.spec = spec
        self.data = data


class Control:
    """Serves the control inodes and applies control commands."""

    def __init__(
        self,
        cache: Cache,
        metrics: Metrics,
        stats: Callable[[], dict[str, object]],
        *,
        uid: int | None = None,
        gid: int | None = None,
    ) -> None:
        self.cache = cache
        self.metrics = metrics
        self.stats = stats
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self.last_result = "none yet"
        self._handles: dict[int, _Handle] = {}
        self._next_fh = _FH_BASE

    # --- namespace --------------------------------------------------------------------

    @staticmethod
    def owns(ino: int) -> bool:
        return ino == DIR_INODE or ino in _BY_INO

    def attrs(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        if ino == DIR_INODE:
            a.st_mode = stat.S_IFDIR | 0o700
            a.st_nlink = 2
        else:
            a.st_mode = _BY_INO[ino].mode
            a.st_nlink = 1
        a.st_uid = self.uid
        a.st_gid = self.gid
        a.st_size = 0
        a.st_blksize = 4096
        now = int(self.metrics.started * 1e9)
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = now
        # Short timeouts: nothing is cached about control entries for long.
        a.entry_timeout = 1.0
        a.attr_timeout = 1.0
        return a

    def lookup(self, parent: int, name: bytes) -> pyfuse3.EntryAttributes:
        if parent == DIR_INODE:
            spec = _BY_NAME.get(name)
            if spec is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self.attrs(spec.ino)
        return self.attrs(DIR_INODE)

    def listing(self) -> list[tuple[bytes, pyfuse3.EntryAttributes]]:
        return [(s.name, self.attrs(s.ino)) for s in _FILES]

    def check_access(self, ctx: pyfuse3.RequestContext) -> None:
        if ctx.uid not in (self.uid, 0):
            raise pyfuse3.FUSEError(errno.EACCES)

    # --- files ------------------------------------------------------------------------

    def owns_handle(self, fh: int) -> bool:
        return fh >= _FH_BASE

    def open(self, ino: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        self.check_access(ctx)
        spec = _BY_INO.get(ino)
        if spec is None:
            raise pyfuse3.FUSEError(errno.EISDIR)
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        if writing and not spec.mode & 0o200:
            raise pyfuse3.FUSEError(errno.EACCES)
        if spec is _STATS:
            data = render_text(self.stats()).encode()
        elif spec is _STATS_JSON:
            data = (json.dumps(self.stats(), indent=1, sort_keys=True) + "\n").encode()
        else:
            data = (
                HELP.format(policies=", ".join(sorted(POLICIES)), levels=", ".join(_LOG_LEVELS))
                + f"# last write: {self.last_result}\n"
            ).encode()
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = _Handle(spec, data)
        return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)

    def read(self, fh: int, off: int, size: int) -> bytes:
        return self._handles[fh].data[off : off + size]

    def write(self, fh: int, buf: bytes) -> int:
        handle = self._handles[fh]
        if handle.spec is not _CTL:
            raise pyfuse3.FUSEError(errno.EBADF)
        try:
            self.execute(buf)
        except CommandError as exc:
            self.metrics.control_errors += 1
            self.last_result = f"error: {exc}"
            log.warning("rejected control command: %s", exc)
            raise pyfuse3.FUSEError(errno.EINVAL) from None
        return len(buf)

    def release(self, fh: int) -> None:
        self._handles.pop(fh, None)

    # --- commands ---------------------------------------------------------------------

    def execute(self, buf: bytes) -> None:
        """Validate every line of `buf`, then apply them all (or none: CommandError)."""
        try:
            text = buf.decode("utf-8")
        except UnicodeDecodeError:
            raise CommandError("commands must be UTF-8 text") from None
        actions: list[tuple[str, Callable[[], str]]] = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            actions.append((line, self._parse(line)))
        if not actions:
            raise CommandError("no command given")
        results = [f"{line}: {apply()}" for line, apply in actions]
        self.last_result = "ok: " + "; ".join(results)
        log.info("control: %s", self.last_result)

    def _parse(self, line: str) -> Callable[[], str]:
        words = line.split()
        cmd, args = words[0], words[1:]
        if cmd == "policy":
            _nargs(cmd, args, 1)
            try:
                policy = make_policy(args[0])
            except ValueError as exc:
                raise CommandError(str(exc)) from None

            def apply_policy() -> str:
                self.cache.set_policy(policy)
                return f"policy is {policy.name}"

            return apply_policy
        if cmd == "ram":
            _nargs(cmd, args, 1)
            try:
                size = parse_size(args[0])
            except ValueError as exc:
                raise CommandError(str(exc)) from None

            def apply_ram() -> str:
                self.cache.set_capacity(size)
                return f"ram budget {format_size(size)}"

            return apply_ram
        if cmd == "drop":
            _nargs(cmd, args, 0)
            return lambda: f"dropped {self.cache.drop()} files"
        if cmd == "log-level":
            _nargs(cmd, args, 1)
            level = args[0].lower()
            if level not in _LOG_LEVELS:
                raise CommandError(f"unknown log level {args[0]!r}")

            def apply_level() -> str:
                logging.getLogger("shadefs").setLevel(level.upper())
                return f"log level {level}"

            return apply_level
        raise CommandError(f"unknown command {cmd!r} (read the ctl file for the list)")


def _nargs(cmd: str, args: list[str], n: int) -> None:
    if len(args) != n:
        raise CommandError(f"{cmd} takes {n} argument{'s' if n != 1 else ''}, got {len(args)}")
