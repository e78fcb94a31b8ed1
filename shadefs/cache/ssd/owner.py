"""Whom a cache directory belongs to: the daemon's user, and no one else may write it.

Whoever can write the cache directory can put an entry there that the daemon would serve as
a file of the source (the checksums prove integrity, not origin). So the directory, and its
data/ and tmp/ below, must belong to the daemon's user and be writable by neither group nor
others; otherwise the mount is refused (exit code 2). Kept apart from the store so that the
command line checks it before mounting without loading the store.
"""

from __future__ import annotations

import os
import stat

__all__ = ["CacheUntrusted", "check_owner"]


class CacheUntrusted(Exception):
    """The cache directory belongs to another user or others may write it."""


def check_owner(st: os.stat_result, what: str) -> None:
    """CacheUntrusted unless `st` is a directory of this user that no one else may write."""
    if not stat.S_ISDIR(st.st_mode):
        raise CacheUntrusted(f"{what} is not a directory")
    if st.st_uid != os.geteuid():
        raise CacheUntrusted(
            f"{what} belongs to uid {st.st_uid}, not to the daemon's user ({os.geteuid()})"
        )
    if st.st_mode & 0o022:
        raise CacheUntrusted(
            f"{what} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): "
            "use chmod go-w, or another directory"
        )
