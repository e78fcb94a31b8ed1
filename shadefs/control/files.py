"""The `.shadefs` control directory: a sysfs-like interface inside the mount.

`MOUNT/.shadefs/` is found by lookup but never listed by readdir of the root (torchvision's
`find_classes` would otherwise make it a class). It belongs to the mounting user with mode
0700, and the daemon refuses anyone else with EACCES even where the kernel would not.
docs/control-protocol.md is the contract for every entry; in short:

- `stats`, `stats.json`, `metrics`: counters, rendered when the file is opened so that one
  read sees one consistent snapshot;
- `ctl`: text commands, one per line, all validated before any is applied;
- `dataset`, `losses`, `order`: the sampler's binary channel (shadefs/wire.py);
- `residency`: which tier each of a list of paths is in.

Control files use direct_io, so every read reaches the daemon and their reported size (0)
does not matter. Binary messages may arrive split over several write() calls: a handle
buffers them and processes each message once it is complete. Anything malformed fails the
write with EINVAL, leaves the state untouched and poisons the handle, so that a client
retrying a short write sees the error too. This module parses and dispatches only.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
import pyfuse3

from shadefs.cache.coordinator import Cache
from shadefs.cache.policies import POLICIES, make_policy
from shadefs.cache.prefetch import Plan, Prefetcher
from shadefs.common import format_size, parse_size
from shadefs.fs.namespace import Namespace
from shadefs.sampling import wire
from shadefs.sampling.registry import Sampling, SamplingError
from shadefs.stats import Metrics, render_text

log = logging.getLogger(__name__)

NAME = b".shadefs"
DIR_INODE = 2
_FH_BASE = 1 << 62
_LOG_LEVELS = ("debug", "info", "warning", "error")
_MAX_LINE = 1 << 16
_RESIDENCY_STATES = ("none", "ram", "ssd")

HELP = """\
# shadefs control file: write one command per line, e.g.  echo 'ram 8G' > ctl
# A bad line fails the whole write with EINVAL and changes nothing.
policy NAME          switch the eviction policy ({policies})
ram SIZE             set the RAM budget (bytes or K/M/G/T suffix); shrinking evicts at once
ssd SIZE             set the SSD budget (needs --ssd)
drop                 drop every cached file from RAM (the SSD tier is kept)
evict PATH...        drop these files (relative to the mount root) from every tier
prefetch PATH...     fetch these files ahead, in this order (a small plan)
plan-drop NAME|all   forget prefetch plans (names in stats.json, prefetch.plan_positions)
epoch N              the training job starts epoch N
report [epoch=N] [train_loss=X] [val_accuracy=Y]
                     end-of-epoch progress (adapts the replay factor)
replay R|auto        fix the replay factor r (>= 1) or let the daemon adapt it
log-level LEVEL      set the daemon's log level ({levels})
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
_METRICS = _Spec(b"metrics", 6, stat.S_IFREG | 0o400)
_DATASET = _Spec(b"dataset", 7, stat.S_IFREG | 0o600)
_LOSSES = _Spec(b"losses", 8, stat.S_IFREG | 0o200)
_ORDER = _Spec(b"order", 9, stat.S_IFREG | 0o600)
_RESIDENCY = _Spec(b"residency", 10, stat.S_IFREG | 0o600)
_PLAN = _Spec(b"plan", 11, stat.S_IFREG | 0o200)
_FILES = (_STATS, _STATS_JSON, _METRICS, _CTL, _DATASET, _LOSSES, _ORDER, _RESIDENCY, _PLAN)
_BY_NAME = {s.name: s for s in _FILES}
_BY_INO = {s.ino: s for s in _FILES}


class _Handle:
    __slots__ = ("spec", "data", "pending", "poisoned", "plan", "name", "written", "base")

    def __init__(self, spec: _Spec, data: bytes | bytearray, name: str = "") -> None:
        self.spec = spec
        self.data = data  # what reads return
        self.pending = bytearray()  # written bytes not yet processed
        self.poisoned = False
        self.plan: list[tuple[np.ndarray, list[bytes], np.ndarray]] = []
        self.name = name  # a plan's name: who wrote it
        self.written = 0  # bytes written so far (the file offset after the request)
        self.base: int | None = None  # where the response starts in the reader's offsets


class Control:
    """Serves the control inodes and applies control commands."""

    def __init__(
        self,
        cache: Cache,
        metrics: Metrics,
        ns: Namespace,
        sampling: Sampling,
        stats: Callable[[], dict[str, object]],
        *,
        prefetcher: Prefetcher | None = None,
        uid: int | None = None,
        gid: int | None = None,
    ) -> None:
        self.cache = cache
        self.metrics = metrics
        self.ns = ns
        self.sampling = sampling
        self.prefetcher = prefetcher
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
        accmode = flags & os.O_ACCMODE
        if accmode != os.O_RDONLY and not spec.mode & 0o200:
            raise pyfuse3.FUSEError(errno.EACCES)
        if accmode != os.O_WRONLY and not spec.mode & 0o400:
            raise pyfuse3.FUSEError(errno.EACCES)
        fh = self._next_fh
        self._next_fh += 1
        # One plan per writing process: a job that writes a new plan replaces its old one.
        self._handles[fh] = _Handle(spec, self._content(spec), f"plan:pid={ctx.pid}")
        return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)

    def _content(self, spec: _Spec) -> bytes | bytearray:
        if spec is _STATS:
            return render_text(self.stats()).encode()
        if spec is _STATS_JSON:
            return (json.dumps(self.stats(), indent=1, sort_keys=True) + "\n").encode()
        if spec is _METRICS:
            from shadefs.ops.prom import render

            return render(self.stats())
        if spec is _CTL:
            return (
                HELP.format(policies=", ".join(POLICIES), levels=", ".join(_LOG_LEVELS))
                + f"# last write: {self.last_result}\n"
            ).encode()
        if spec is _DATASET:
            s = self.sampling
            return (
                f"samples {s.n}\nregistered_at {s.registered_at:.3f}\nresolved {len(s.keys)}\n"
            ).encode()
        return bytearray()

    def read(self, fh: int, off: int, size: int) -> bytes:
        handle = self._handles[fh]
        if handle.base is None:
            # A transaction file answers from the start of its response whether the client
            # seeks back to 0 after writing its request or reads straight on from there.
            handle.base = handle.written if handle.written and off >= handle.written else 0
        start = off - handle.base
        return bytes(handle.data[start : start + size]) if start >= 0 else b""

    async def write(self, fh: int, buf: bytes) -> int:
        handle = self._handles[fh]
        handle.written += len(buf)
        if handle.poisoned:
            # Keep the first error in last_result: that is the one the client must see.
            raise pyfuse3.FUSEError(errno.EINVAL)
        try:
            await self._dispatch(handle, buf)
        except (CommandError, SamplingError, wire.WireError) as exc:
            # A ctl write stands alone (one echo, one command); a stream does not.
            handle.poisoned = handle.spec is not _CTL
            self.metrics.control_errors += 1
            self.last_result = f"error: {exc}"
            log.warning("rejected control input on %s: %s", handle.spec.name.decode(), exc)
            raise pyfuse3.FUSEError(errno.EINVAL) from None
        return len(buf)

    def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if handle is not None and handle.spec is _PLAN and handle.plan and not handle.poisoned:
            self._install_plan(handle)
        stream = handle is not None and handle.spec in (_DATASET, _LOSSES, _ORDER)
        if stream and handle.pending and not handle.poisoned:
            log.warning(
                "%s closed with an incomplete message (%d bytes): ignored",
                handle.spec.name.decode(),
                len(handle.pending),
            )

    async def _dispatch(self, handle: _Handle, buf: bytes) -> None:
        spec = handle.spec
        if spec is _CTL:
            await self.execute(buf)
        elif spec is _RESIDENCY:
            await self._residency(handle, buf)
        elif spec is _PLAN:
            await self._plan_lines(handle, buf)
        elif spec in (_DATASET, _LOSSES, _ORDER):
            handle.pending += buf
            for message in _complete_messages(handle.pending):
                await self._message(handle, message)
        else:
            raise pyfuse3.FUSEError(errno.EBADF)

    async def _message(self, handle: _Handle, message: bytes) -> None:
        if handle.spec is _DATASET:
            paths = wire.decode_dataset(message)
            await self.sampling.register(paths, self._resolve_dataset)
            self.last_result = f"ok: registered {len(paths)} samples"
        elif handle.spec is _LOSSES:
            self.sampling.ingest(message)
        else:
            request = wire.decode_order_request(message)
            self.cache.begin_epoch(request.epoch)
            share = self.sampling.order(request, self._resident)
            handle.data = wire.encode_order_response(request.epoch, share)
            if self.prefetcher is not None:
                # The daemon now knows what this rank reads next: prefetch its misses.
                s = self.sampling
                name = f"order:seed={request.seed}:world={request.world_size}:rank={request.rank}"
                paths = [os.fsencode(s.paths[i]) for i in share.tolist()]
                self.prefetcher.add_plan(Plan(name, s.keys[share], paths, s.sizes[share]))

    async def _resolve_dataset(self, paths: list[str]) -> tuple[np.ndarray, np.ndarray]:
        return await self._resolve_files([os.fsencode(p) for p in paths])

    async def _resolve_files(self, rels: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """(cache keys, sizes) of regular files, or SamplingError naming the first bad one."""
        stats = await self.ns.resolve(rels)
        keys = np.empty(len(rels), dtype=np.uint64)
        sizes = np.empty(len(rels), dtype=np.int64)
        for i, st in enumerate(stats):
            if st is None or not stat.S_ISREG(st.st_mode):
                raise SamplingError(f"{os.fsdecode(rels[i])!r} is not a regular file in the mount")
            keys[i] = self.ns.ino_of(st)
            sizes[i] = st.st_size
        return keys, sizes

    def _resident(self, keys: np.ndarray) -> np.ndarray:
        return np.isin(keys, self.cache.resident_keys())

    async def _plan_lines(self, handle: _Handle, buf: bytes) -> None:
        """A job's own read order, one relative path per line; installed at close."""
        if self.prefetcher is None:
            raise CommandError("prefetching is off (mounted with --no-prefetch)")
        rels = _complete_lines(handle, buf, "plan")
        if not rels:
            return
        keys, sizes = await self._resolve_files(rels)
        handle.plan.append((keys, rels, sizes))

    def _install_plan(self, handle: _Handle) -> None:
        assert self.prefetcher is not None
        keys = np.concatenate([k for k, _, _ in handle.plan])
        sizes = np.concatenate([z for _, _, z in handle.plan])
        rels = [r for _, chunk, _ in handle.plan for r in chunk]
        self.prefetcher.add_plan(Plan(handle.name, keys, rels, sizes))

    async def _residency(self, handle: _Handle, buf: bytes) -> None:
        paths = _complete_lines(handle, buf, "residency")
        if not paths:
            return
        stats = await self.ns.resolve(paths)
        out = handle.data
        assert isinstance(out, bytearray)
        for st in stats:
            if st is None or not stat.S_ISREG(st.st_mode):
                out += b"missing\n"
            else:
                out += _RESIDENCY_STATES[self.cache.tier_of(self.ns.ino_of(st))].encode() + b"\n"

    # --- commands ---------------------------------------------------------------------

    async def execute(self, buf: bytes) -> None:
        """Validate every line of `buf`, then apply them all (or none: CommandError)."""
        try:
            text = buf.decode("utf-8")
        except UnicodeDecodeError:
            raise CommandError("commands must be UTF-8 text") from None
        actions: list[tuple[str, Callable[[], Awaitable[str]]]] = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            actions.append((line, await self._parse(line)))
        if not actions:
            raise CommandError("no command given")
        results = [f"{line}: {await apply()}" for line, apply in actions]
        self.last_result = "ok: " + "; ".join(results)
        log.info("control: %s", self.last_result)

    async def _parse(self, line: str) -> Callable[[], Awaitable[str]]:
        words = line.split()
        cmd, args = words[0], words[1:]
        parser = _PARSERS.get(cmd)
        if parser is None:
            raise CommandError(f"unknown command {cmd!r} (read the ctl file for the list)")
        return await parser(self, args)

    async def _cmd_policy(self, args: list[str]) -> Callable[[], Awaitable[str]]:
        _nargs("policy", args, 1)
        try:
            next_use = self.prefetcher.next_use if self.prefetcher else None
            policy = make_policy(args[0], self.sampling.score_of, next_use)
            ssd_policy = make_policy(args[0], self.sampling.score_of, next_use)
        except ValueError as exc:
            raise CommandError(str(exc)) from None

        async def apply() -> str:
            self.cache.set_policy(policy, ssd_policy)
            return f"policy is {policy.name}"

        return apply

    async def _cmd_ram(self, args: list[str]) -> Callable[[], Awaitable[str]]:
        _nargs("ram", args, 1)
        size = _size(args[0])

        async def apply() -> str:
            self.cache.set_capacity(size)
            return f"ram budget {format_size(size)}"

        return apply

    async def _cmd_ssd(self, args: list[str]) -> Callable[[], Awaitable[str]]:
        _nargs("ssd", args, 1)
        size = _size(args[0])
        ssd = self.cache.ssd
        if ssd is None:
            raise CommandError("no SSD tier: mount with --ssd DIR[:SIZE]")

        async def apply() -> str:
            await ssd.set_capacity(size)
            return f"ssd budget {format_size(size)}"

        return apply

    async def _cmd_drop(self, args: list[str]) -> Callable[[], Awaitable[str]]:
        _nargs("drop", args, 0)

        async def apply() -> str:
            return f"dropped {self.cache.drop()} files"

        return apply

    async def _cmd_evict(self, args: list[str]) -> Callable[[], Awaitable[str]]:
        if not args:
            raise CommandError("evict takes one or more paths")
        rels = [_relpath(a.encode()) for a in args]
        stats = await self.ns.resolve(rels)
        keys = []
        for arg, st in zip(args, stats, strict=True):
            if st is None or not stat.S_ISREG(st.st_mode):
                raise CommandError(f"evict: {arg!r} is not a regular file in the mount")
            keys.append(self.ns.ino_of(st))

        async def apply() -> str:
            evicted = [await self.cache.evict(k) for k in keys]
            return f"evicted {sum(evicted)} of {len(keys)} files"

        return apply

    async def _cmd_prefetch(self, args: list[str]) -> Callable[[], Awaitable[str]]:
        if not args:
            raise CommandError("prefetch takes one or more paths")
        if self.prefetcher is None:
            raise CommandError("prefetching is off (mounted with --no-prefetch)")
        rels = [_relpath(a.encode()) for a in args]
        try:
            keys, sizes = await self._resolve_files(rels)
        except SamplingError as exc:
            raise CommandError(f"prefetch: {exc}") from None
        prefetcher = self.prefetcher

        async def apply() -> str:
            prefetcher.add_plan(Plan(f"ctl:{len(prefetcher.plans)}", keys, rels, sizes))
            return f"prefetching {len(rels)} files"

        return apply

    async def _cmd_plan_drop(self, args: list[str]) -> Callable[[], Awaitable[str]]:
        _nargs("plan-drop", args, 1)
        prefetcher = self.prefetcher
        if prefetcher is None:
            raise CommandError("prefetching is off (mounted with --no-prefetch)")
        names = list(prefetcher.plans) if args[0] == "all" else [args[0]]
        if args[0] != "all" and args[0] not in prefetcher.plans:
            raise CommandError(f"no plan named {args[0]!r}")

        async def apply() -> str:
            return f"dropped {sum(prefetcher.drop_plan(n) for n in names)} plans"

        return apply

    async def _cmd_epoch(self, args: list[str]) -> Callable[[], Awaitable[str]]:
        _nargs("epoch", args, 1)
        epoch = _int(args[0], "epoch")

        async def apply() -> str:
            self.sampling.begin_epoch(epoch)
            self.cache.begin_epoch(epoch)
            return f"epoch {epoch}"

        return apply

    async def _cmd_report(self, args: list[str]) -> Callable[[], Awaitable[str]]:
        values: dict[str, float] = {}
        for arg in args:
            key, sep, value = arg.partition("=")
            if not sep or key not in ("epoch", "train_loss", "val_accuracy") or key in values:
                raise CommandError(f"report: bad argument {arg!r}")
            values[key] = _int(value, key) if key == "epoch" else _float(value, key)
        epoch = values.get("epoch")

        async def apply() -> str:
            if epoch is not None:
                self.cache.begin_epoch(int(epoch))
            return self.sampling.report(
                None if epoch is None else int(epoch),
                values.get("train_loss"),
                values.get("val_accuracy"),
            )

        return apply

    async def _cmd_replay(self, args: list[str]) -> Callable[[], Awaitable[str]]:
        _nargs("replay", args, 1)
        value = None if args[0] == "auto" else _float(args[0], "replay")
        if value is not None and not 1.0 <= value <= 64.0:
            raise CommandError("replay must be between 1 and 64, or auto")

        async def apply() -> str:
            self.sampling.set_replay(value)
            return f"replay {'auto' if value is None else value}"

        return apply

    async def _cmd_log_level(self, args: list[str]) -> Callable[[], Awaitable[str]]:
        _nargs("log-level", args, 1)
        level = args[0].lower()
        if level not in _LOG_LEVELS:
            raise CommandError(f"unknown log level {args[0]!r}")

        async def apply() -> str:
            logging.getLogger("shadefs").setLevel(level.upper())
            return f"log level {level}"

        return apply


_PARSERS = {
    "policy": Control._cmd_policy,
    "ram": Control._cmd_ram,
    "ssd": Control._cmd_ssd,
    "drop": Control._cmd_drop,
    "evict": Control._cmd_evict,
    "prefetch": Control._cmd_prefetch,
    "plan-drop": Control._cmd_plan_drop,
    "epoch": Control._cmd_epoch,
    "report": Control._cmd_report,
    "replay": Control._cmd_replay,
    "log-level": Control._cmd_log_level,
}


def _complete_messages(pending: bytearray) -> list[bytes]:
    """Split the complete wire messages off the front of `pending` (in place)."""
    out = []
    while pending:
        length = wire.message_length(pending)
        if length is None or len(pending) < length:
            break
        out.append(bytes(pending[:length]))
        del pending[:length]
    return out


def _complete_lines(handle: _Handle, buf: bytes, what: str) -> list[bytes]:
    """The complete lines written so far, as checked relative paths; a partial last line
    waits in the handle for the rest of it."""
    handle.pending += buf
    if b"\n" not in handle.pending:
        if len(handle.pending) > _MAX_LINE:
            raise CommandError(f"{what}: line too long")
        return []
    complete, _, rest = bytes(handle.pending).rpartition(b"\n")
    handle.pending = bytearray(rest)
    return [_relpath(p) for p in complete.split(b"\n")]


def _relpath(raw: bytes) -> bytes:
    """A path relative to the mount root, refusing anything that could leave it."""
    parts = raw.split(b"/")
    if (
        not raw
        or b"\0" in raw
        or any(part in (b"", b".", b"..") for part in parts)
        or parts[0] == NAME
    ):
        raise CommandError(f"{raw!r} is not a path relative to the mount root")
    return raw


def _nargs(cmd: str, args: list[str], n: int) -> None:
    if len(args) != n:
        raise CommandError(f"{cmd} takes {n} argument{'s' if n != 1 else ''}, got {len(args)}")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def _int(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise CommandError(f"{what} must be an integer, got {text!r}") from None
    if not 0 <= value < 1 << 62:
        raise CommandError(f"{what} out of range")
    return value


def _float(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise CommandError(f"{what} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise CommandError(f"{what} must be finite")
    return value
