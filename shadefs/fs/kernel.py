"""Calls from the daemon into the kernel's caches (FUSE notifications).

A notification can wait on locks that a request in flight holds (the kernel holds a
directory's lock while it waits for our answer to a lookup in it), so each runs in a worker
thread, and the ones made while answering a request are not even awaited: the request is
answered, then the kernel takes the notification.
"""

from __future__ import annotations

import logging

import pyfuse3
import trio

log = logging.getLogger(__name__)


async def invalidate_attrs(inode: int) -> None:
    """Make the kernel forget a changed file's attributes (size, mtime).

    Attribute-only invalidation takes no page locks, and it runs in a thread, so it cannot
    wait on a request that this thread would have to answer.
    """
    try:
        await trio.to_thread.run_sync(pyfuse3.invalidate_inode, inode, True)
    except Exception as exc:  # no FUSE session (handler tests) or the inode is gone
        log.debug("invalidate_inode(%d) failed: %s", inode, exc)


def forget_entry(parent: int, name: bytes) -> None:
    """Make the kernel drop its dentry `name` in `parent` (it leads to a gone inode), so
    that the next walk through it asks us; not awaited (see the module's docstring)."""
    trio.lowlevel.spawn_system_task(_forget_entry, parent, name)


async def _forget_entry(parent: int, name: bytes) -> None:
    try:
        await trio.to_thread.run_sync(pyfuse3.invalidate_entry, parent, name)
    except Exception as exc:  # no FUSE session, or the kernel holds no such dentry
        log.debug("invalidate_entry(%d, %r) failed: %s", parent, name, exc)
