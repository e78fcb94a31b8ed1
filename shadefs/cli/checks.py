"""The checks `shadefs mount` makes before it mounts: each failure is one clear line.

A source that is missing or unreadable, a mount point that is missing, dead, already
mounted or inside the source, a cache directory that cannot be one, and a machine without
FUSE all fail here with their documented exit code, before any daemon starts.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from shadefs.cache.ssd.owner import CacheUntrusted, check_owner
from shadefs.common import EXIT_MOUNTPOINT, EXIT_NOFUSE, EXIT_SOURCE, EXIT_USAGE, QuietError
from shadefs.options import MountOptions


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
    if opts.ssd:
        check_cache_dir(opts.ssd, os.path.realpath(src), os.path.realpath(mnt))
    if not os.path.exists("/dev/fuse"):
        raise QuietError("FUSE is not available: /dev/fuse is missing", EXIT_NOFUSE)
    if os.getuid() != 0 and not _which("fusermount3"):
        raise QuietError("FUSE is not available: fusermount3 is not installed", EXIT_NOFUSE)


def _inside(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def check_cache_dir(path: str, src: str, mnt: str) -> None:
    """The --ssd directory: not inside the mount or the source, a directory (made if
    missing), owned by this user and writable by no one else. QuietError (exit 2) if not."""
    real = os.path.realpath(path)
    if _inside(real, mnt):
        # The daemon would scan its cache through its own mount, and wait on itself.
        raise QuietError(f"cache directory {path} is inside the mount point", EXIT_USAGE)
    if _inside(real, src):
        # It would show up in the mount, and readers could watch the cache.
        raise QuietError(f"cache directory {path} is inside the source", EXIT_USAGE)
    try:
        os.makedirs(real, mode=0o700, exist_ok=True)
        st = os.stat(real)
    except FileExistsError:
        raise QuietError(f"cache directory {path} is not a directory", EXIT_USAGE) from None
    except OSError as exc:
        raise QuietError(f"cache directory {path}: {exc.strerror}", EXIT_USAGE) from None
    try:
        check_owner(st, f"cache directory {path}")
    except CacheUntrusted as exc:
        raise QuietError(str(exc), EXIT_USAGE) from None
    if not os.access(real, os.W_OK | os.X_OK):
        raise QuietError(f"cache directory {path} is not writable", EXIT_USAGE)


def _which(cmd: str) -> str | None:
    for d in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep):
        p = os.path.join(d, cmd)
        if os.access(p, os.X_OK):
            return p
    return None
