"""The kernel-side settings of a mount that the daemon owns: read-ahead and FUSE queue depth.

pyfuse3 negotiates none of them at INIT, and the INIT reply could only lower read-ahead, so
they are written through sysfs once the mount answers. Only root may write them; any other
user keeps the kernel's defaults, and a failure is logged at debug level, never fatal.

- `read_ahead_kb` of the mount's backing device info (bdi): the kernel starts a FUSE mount
  at 128 KiB, so a reader's 1 MiB reads arrive as eight 128 KiB requests. At 1024, they
  arrive as 1 MiB requests (libfuse 3.14 negotiates max_pages = 256): an eighth of the
  requests for a sequential reader (docs/benchmarks.md, "Sharded datasets").
- `max_background` and `congestion_threshold` of the FUSE connection
  (/sys/fs/fuse/connections/<id>/, the fusectl filesystem): how many asynchronous requests
  (read-ahead READs) the kernel keeps in flight for the whole mount, default 12 and 9. They
  bound reads that wait on the source: readers of pass-through files behind a slow source
  move about twice the bytes at 144 as at 12 (docs/developer-notes.md, "Kernel-side
  levers"); cached reads answered inline do not change.
  fusectl is mounted here when the directory is empty (as systemd does at boot).
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

READ_AHEAD_KB = 1024
MAX_BACKGROUND = 144  # NVIDIA MSFS's choice; measured below
CONGESTION_THRESHOLD = 108  # three quarters of MAX_BACKGROUND, as the kernel's defaults are
FUSECTL = "/sys/fs/fuse/connections"


def connection_id(dev: int) -> int:
    """The fusectl directory name of the mount whose st_dev is `dev`: the kernel's dev_t
    (major << 20 | minor), which for FUSE's anonymous devices is the minor number."""
    return (os.major(dev) << 20) | os.minor(dev)


def tune(dev: int, fusectl: str = FUSECTL) -> None:
    """Apply every setting to the mount whose st_dev is `dev` (blocking: call from a thread)."""
    _write(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb", READ_AHEAD_KB)
    conn = os.path.join(fusectl, str(connection_id(dev)))
    if not os.path.isdir(conn) and _mount_fusectl(fusectl):
        log.info("mounted fusectl on %s", fusectl)
    _write(os.path.join(conn, "max_background"), MAX_BACKGROUND)
    _write(os.path.join(conn, "congestion_threshold"), CONGESTION_THRESHOLD)


def _write(path: str, value: int) -> None:
    try:
        with open(path, "w") as f:
            f.write(str(value))
    except OSError as exc:
        log.debug("cannot set %s (%s)", path, exc)


def _mount_fusectl(where: str) -> bool:
    """Mount fusectl on `where` if that is an empty directory and we may (root)."""
    try:
        if os.geteuid() != 0 or os.listdir(where):
            return False
    except OSError:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"fusectl", os.fsencode(where), b"fusectl", 0, None) != 0:
        log.debug("cannot mount fusectl on %s: %s", where, os.strerror(ctypes.get_errno()))
        return False
    return True
