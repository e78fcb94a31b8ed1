"""`shadefs mount`: the options, the checks before mounting, and going to the background.

This module stays light (no numpy, trio or pyfuse3 imports), so that the short-lived parent
of a background mount starts fast. `shadefs mount` without `-f` re-executes itself in the
foreground in a new session and waits on a pipe until the child reports that the mount
answers (or why it failed). So the command returns only once the mount is usable, like other
mount tools. The daemon itself is daemon.py.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from shadefs.common import (
    EXIT_MOUNT_FAILED,
    EXIT_MOUNTPOINT,
    EXIT_NOFUSE,
    EXIT_SOURCE,
    QuietError,
)

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
    revalidate: float = 3600.0
    ssd: str | None = None
    ssd_size: int | None = None
    ssd_min_free: int | None = None
    metrics: str | None = None
    prefetch: bool = True
    prefetch_window: int | None = None
    prefetch_workers: int = 16
    prefetch_abandon: float = 60.0
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
