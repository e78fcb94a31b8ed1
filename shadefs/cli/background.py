"""`shadefs mount` without `-f`: going to the background once the mount answers.

This module stays light (no numpy, trio or pyfuse3 imports), so that the short-lived parent
of a background mount starts fast. `shadefs mount` without `-f` re-executes itself in the
foreground in a new session and waits on a pipe until the child reports that the mount
answers (or why it failed). So the command returns only once the mount is usable, like other
mount tools. The options are in options.py, the checks before mounting in checks.py, the daemon
itself is daemon.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from shadefs.common import EXIT_MOUNT_FAILED, QuietError
from shadefs.options import MountOptions

log = logging.getLogger(__name__)


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
