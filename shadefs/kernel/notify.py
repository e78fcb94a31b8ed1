"""Calls from the daemon into the kernel's caches (FUSE notifications).

A notification can wait on locks that a request in flight holds (the kernel holds a
directory's lock while it waits for our answer to a lookup in it), so each runs in a worker
thread, and the ones made while answering a request are not even awaited: the request is
answered, then the kernel takes the notification. The exceptions: `push_pages`, made in
the trio thread where it is known that no request holds what it needs, and a no-open READ
that answers ESTALE, which waits for its dentry to go (`entries_forgotten`).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Mapping

import pyfuse3
import trio

log = logging.getLogger(__name__)

#: Files up to this size are stored in the kernel's pages as their first open is answered.
PUSH_MAX = 1 << 20
# `push_pages` looks through at most this many open handles for another of the same file.
_PUSH_SCAN = 64
_push = [True]  # False once the kernel said it cannot (ENOSYS)
_forgetting: set[trio.Event] = set()  # the dentry invalidations under way (`forget_entry`)


def push_pages(inode: int, fh: int, data: bytes, handles: Mapping[int, int]) -> bool:
    """Store a small file's bytes in the kernel's page cache of `inode` as its open `fh`
    is answered, when the kernel holds none of its pages: the reads that follow find them
    there and send the daemon no READ (a cold 4 KiB file costs three requests, not four).

    Synchronous (a thread hop would cost more than the READ it saves), so only where no
    request can hold a lock it needs: the kernel holds no lock of the inode or its directory
    while it waits for a read-only open, and no other handle of the inode may be open
    (`handles`: fh -> inode, scanned up to _PUSH_SCAN of them), so that no read of it, which
    would hold its pages locked until this thread answered, can be in flight. Whether the
    store was made."""
    if not _push[0] or len(data) > PUSH_MAX or len(handles) > _PUSH_SCAN:
        return False
    if any(i == inode and f != fh for f, i in handles.items()):
        return False
    try:
        pyfuse3.notify_store(inode, 0, data)
    except OSError as exc:
        if exc.errno == errno.ENOSYS:
            _push[0] = False
        log.debug("notify_store(%d) failed: %s", inode, exc)
        return False
    return True


def forget_entry(parent: int, name: bytes) -> None:
    """Make the kernel drop its dentry `name` in `parent` (it leads to a gone inode), so
    that the next walk through it asks us; not awaited (see the module's docstring)."""
    done = trio.Event()
    _forgetting.add(done)
    trio.lowlevel.spawn_system_task(_forget_entry, parent, name, done)


async def entries_forgotten(timeout: float) -> None:
    """Wait, up to `timeout` seconds, for the dentries asked so far to be dropped. Under
    no-open a READ that answers ESTALE gets no retry from the kernel (an open does: it looks
    the name up again), so the reader's next open would walk the same dentry to the retired
    node unless it is gone first. A READ holds no directory lock, so it may wait for it."""
    with trio.move_on_after(timeout):
        for done in list(_forgetting):
            await done.wait()


async def _forget_entry(parent: int, name: bytes, done: trio.Event) -> None:
    try:
        await trio.to_thread.run_sync(pyfuse3.invalidate_entry, parent, name)
    except Exception as exc:  # no FUSE session, or the kernel holds no such dentry
        log.debug("invalidate_entry(%d, %r) failed: %s", parent, name, exc)
    finally:
        _forgetting.discard(done)
        done.set()
