"""Kernel hits: FUSE no-open mode, in which a warm open never reaches the daemon.

When `open` answers ENOSYS, the kernel (fs/fuse/file.c, `fuse_file_open`) sets `no_open`
on the connection and from then on opens every regular file itself: no OPEN, no RELEASE,
and the file's pages are kept (FOPEN_KEEP_CACHE). A READ reaches the daemon only for pages
the kernel lacks, with file handle 0. pyfuse3 3.5 hands `read` and `write` only that handle,
so the daemon could not tell which file is read; the project's patch
(`patches/pyfuse3-no-open.patch`, built by `make pyfuse3`) passes the inode instead and marks the
build with `pyfuse3.NO_OPEN_FH_IS_INODE`.

The switch is one-way for the life of the connection, so it is decided once, at start-up
(`resolve`): `on` and `auto` turn it on where pyfuse3 passes the inode, and otherwise log
once why it is off and serve with opens as before. What the mode gives up is in
docs/developer-notes.md ("Kernel hits").
"""

from __future__ import annotations

import logging

import pyfuse3

log = logging.getLogger(__name__)

# A no-open READ carries no request context through pyfuse3: the daemon reads for a reader it
# cannot name. pid 0 is no process: its reads form one job of their own (readers/jobs.py).
KERNEL_PID = 0


def supported() -> bool:
    """Whether this pyfuse3 passes the inode to `read` and `write` under no-open."""
    return bool(getattr(pyfuse3, "NO_OPEN_FH_IS_INODE", False))


def resolve(mode: str) -> bool:
    """Whether the mount serves kernel hits, for `--kernel-hits MODE` (on, off, auto)."""
    if mode == "off":
        return False
    if supported():
        log.info("kernel hits on: the kernel opens files itself and serves the pages it holds")
        return True
    log.log(
        logging.WARNING if mode == "on" else logging.INFO,
        "kernel hits are off: this pyfuse3 (%s) does not pass the inode to reads in FUSE "
        "no-open mode (install the patched build: `make pyfuse3`, or "
        "`tools/install-pyfuse3.sh PYTHON`); serving with opens",
        getattr(pyfuse3, "__version__", "unknown"),
    )
    return False
