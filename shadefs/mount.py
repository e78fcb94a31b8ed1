"""The daemon: build the filesystem objects, mount, serve, and unmount cleanly.

`shadefs mount` without `-f` re-executes itself in the foreground in a new session and
waits on a pipe until the child reports that the mount answers (or why it failed), so the
command returns only once the mount is usable, like other mount tools. With `--systemd`
the same readiness is sent as READY=1 to systemd instead.

Readiness means the mount answers: after pyfuse3.init the daemon stats its own mount point
from a worker thread while the request loop runs, and only then reports ready.
"""

from __future__ import annotations

import errno
import logging
import logging.handlers
import os
import signal
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pyfuse3
import trio

from shadefs.cache import Cache
from shadefs.common import (
    EXIT_MOUNT_FAILED,
    EXIT_MOUNTPOINT,
    EXIT_NOFUSE,
    EXIT_SOURCE,
    QuietError,
)
from shadefs.control import Control
from shadefs.fs import Operations
from shadefs.metrics import Metrics, snapshot
from shadefs.namespace import Namespace
from shadefs.policy import make_policy
from shadefs.sampling import Sampling
from shadefs.source import Source

log = logging.getLogger(__name__)


@dataclass
class MountOptions:
    """Everything `shadefs mount` accepts (see cli.py for the flags and -o names)."""

    source: str
    mountpoint: str
    ram: int
    policy: str = "epoch"
    max_entry: int | None = None
    allow_other: bool = False
    foreground: bool = False
    systemd: bool = False
    log_level: str = "info"
    log: str | None = None
    source_timeout: float = 30.0
    source_threads: int = 32
    attr_timeout: float = 3600.0
    extra_fuse: list[str] = field(default_factory=list)


def default_ram() -> int:
    """A quarter of the memory available now: the page cache and the job need the rest."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 4
    except OSError:
        pass
    return 1 << 30


def check_environment(opts: MountOptions) -> None:
    """Fail early, with one clear line, on what would make the mount fail."""
    src = Path(opts.source)
    if not src.exists():
        raise QuietError(f"source {opts.source} does not exist", EXIT_SOURCE)
    if not src.is_dir():
        raise QuietError(f"source {opts.source} is not a directory", EXIT_SOURCE)
    if not os.access(src, os.R_OK | os.X_OK):
        raise QuietError(f"source {opts.source} is not readable", EXIT_SOURCE)
    mnt = Path(opts.mountpoint)
    try:
        st = mnt.stat()
    except FileNotFoundError:
        raise QuietError(f"mount point {opts.mountpoint} does not exist", EXIT_MOUNTPOINT) from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise QuietError(
                f"mount point {opts.mountpoint} is a dead mount: run `shadefs umount "
                f"{opts.mountpoint}` first",
                EXIT_MOUNTPOINT,
            ) from None
        raise QuietError(
            f"mount point {opts.mountpoint}: {exc.strerror}", EXIT_MOUNTPOINT
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise QuietError(f"mount point {opts.mountpoint} is not a directory", EXIT_MOUNTPOINT)
    if os.path.ismount(mnt):
        raise QuietError(f"{opts.mountpoint} is already a mount point", EXIT_MOUNTPOINT)
    if os.path.realpath(src) == os.path.realpath(mnt) or str(
        Path(os.path.realpath(mnt))
    ).startswith(os.path.realpath(src) + "/"):
        raise QuietError("the mount point must not be inside the source", EXIT_MOUNTPOINT)
    if not os.path.exists("/dev/fuse"):
        raise QuietError("FUSE is not available: /dev/fuse is missing", EXIT_NOFUSE)
    if os.getuid() != 0 and not _which("fusermount3"):
        raise QuietError("FUSE is not available: fusermount3 is not installed", EXIT_NOFUSE)


def _which(cmd: str) -> str | None:
    for d in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep):
        p = os.path.join(d, cmd)
        if os.access(p, os.X_OK):
            return p
    return None


def setup_logging(opts: MountOptions) -> None:
    root = logging.getLogger()
    root.handlers.clear()
    if opts.systemd:
        # journald adds its own timestamps; <N> prefixes carry the priority.
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_JournalFormatter())
    elif opts.log in (None, "-", "stderr"):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    elif opts.log == "none":
        handler = logging.NullHandler()
    elif opts.log == "syslog":
        handler = logging.handlers.SysLogHandler(address="/dev/log")
        handler.setFormatter(logging.Formatter("shadefs[%(process)d]: %(name)s: %(message)s"))
    else:
        Path(opts.log).parent.mkdir(parents=True, exist_ok=True)
        handler = logging.handlers.WatchedFileHandler(opts.log)
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
        )
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("shadefs").setLevel(opts.log_level.upper())


class _JournalFormatter(logging.Formatter):
    _PRIO = {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}

    def format(self, record: logging.LogRecord) -> str:
        return f"<{self._PRIO.get(record.levelname, 6)}>{record.name}: {record.getMessage()}"


def default_log_path(mountpoint: str) -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    name = os.path.realpath(mountpoint).strip("/").replace("/", "-") or "root"
    return os.path.join(base, "shadefs", f"{name}.log")


# --- background mode ------------------------------------------------------------------


def spawn_background(argv: list[str], opts: MountOptions) -> int:
    """Run the daemon detached and return once it reports ready (0) or failed (its code)."""
    rfd, wfd = os.pipe()
    log_path = opts.log or default_log_path(opts.mountpoint)
    cmd = [sys.executable, "-m", "shadefs", *argv, "--foreground", "--ready-fd", str(wfd)]
    if opts.log is None:
        cmd += ["--log", log_path]
    proc = subprocess.Popen(
        cmd,
        pass_fds=(wfd,),
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(wfd)
    with os.fdopen(rfd, "rb") as r:
        msg = r.read().decode(errors="replace").strip()
    if msg == "ready":
        return 0
    code = proc.wait()
    raise QuietError(
        msg or f"the daemon exited with status {code} before the mount was ready (see {log_path})",
        code or EXIT_MOUNT_FAILED,
    )


# --- the daemon -------------------------------------------------------------------------


def run_daemon(opts: MountOptions, ready_fd: int | None = None) -> int:
    """Mount and serve until unmounted or signalled. Returns the exit code."""
    setup_logging(opts)
    try:
        return _run(opts, ready_fd)
    except QuietError as exc:
        _report(ready_fd, str(exc))
        raise
    except BaseException:
        log.exception("the daemon failed")
        _report(ready_fd, "the daemon failed unexpectedly (see its log)")
        raise


def _report(ready_fd: int | None, msg: str) -> None:
    if ready_fd is None:
        return
    try:
        os.write(ready_fd, msg.encode())
        os.close(ready_fd)
    except OSError:
        pass


def build(opts: MountOptions) -> tuple[Operations, dict[str, object]]:
    """The filesystem objects for `opts` (also used by tests that drive handlers directly)."""
    source = Source(opts.source, max_threads=opts.source_threads, timeout=opts.source_timeout)
    ns = Namespace(source, timeout=opts.attr_timeout)
    metrics = Metrics()
    cache = Cache(
        source, make_policy("epoch"), metrics, capacity=opts.ram, max_entry=opts.max_entry
    )
    sampling = Sampling()
    cache.set_policy(make_policy(opts.policy, sampling.score_of))
    mnt = os.path.abspath(opts.mountpoint)

    def stats() -> dict[str, object]:
        s = snapshot(metrics, cache, ns, source, mnt)
        s["sampler"] = sampling.describe()
        return s

    control = Control(cache, metrics, ns, sampling, stats)
    ops = Operations(ns, cache, control, metrics, source)
    parts = {"source": source, "ns": ns, "cache": cache, "metrics": metrics}
    parts["sampling"] = sampling
    parts["control"] = control
    return ops, parts


def fuse_options(opts: MountOptions) -> set[str]:
    fsname = os.path.abspath(opts.source)
    # libfuse splits options on commas; keep the source out of fsname if it has one.
    if "," in fsname or "\\" in fsname:
        fsname = "shadefs"
    options = set(pyfuse3.default_options)
    options |= {f"fsname={fsname}", "subtype=shadefs", "noatime"}
    if opts.allow_other:
        options.add("allow_other")
    options.update(opts.extra_fuse)
    return options


def _run(opts: MountOptions, ready_fd: int | None) -> int:
    check_environment(opts)
    ops, _ = build(opts)
    mnt = os.path.abspath(opts.mountpoint)
    try:
        pyfuse3.init(ops, mnt, fuse_options(opts))
    except RuntimeError as exc:
        raise QuietError(f"mounting {mnt} failed: {exc}", EXIT_MOUNT_FAILED) from None
    log.info("mounted %s on %s (ram %d bytes, policy %s)", opts.source, mnt, opts.ram, opts.policy)
    clean = False
    try:
        trio.run(_serve, opts, mnt, ready_fd)
        clean = True
    finally:
        pyfuse3.close(unmount=clean)
        log.info("unmounted %s", mnt)
    return 0


async def _serve(opts: MountOptions, mnt: str, ready_fd: int | None) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_signals)
        nursery.start_soon(_announce_ready, opts, mnt, ready_fd)
        await pyfuse3.main(**_main_args())
        nursery.cancel_scope.cancel()


async def _signals() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            if signum == signal.SIGHUP:
                log.info("SIGHUP: nothing to reload")
                continue
            log.info("got %s, unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()


async def _announce_ready(opts: MountOptions, mnt: str, ready_fd: int | None) -> None:
    # The stat goes through the kernel to our own request loop: when it returns, the
    # mount answers. It must run in a thread, or it would wait for the loop it blocks.
    await trio.to_thread.run_sync(os.stat, mnt)
    log.info("mount %s is ready", mnt)
    if opts.systemd:
        from shadefs import sdnotify

        sdnotify.ready(f"serving {opts.source} on {mnt}")
    _report(ready_fd, "ready")


def _main_args() -> dict[str, int]:
    env = os.environ.get("SHADEFS_TASKS", "")
    if not env:
        return {}
    lo, hi = env.split(",")
    return {"min_tasks": int(lo), "max_tasks": int(hi)}
