"""The source's answers that say a node's path no longer leads to what was looked up.

The namespace's version check (`Namespace.fresh_stat`) and the opens read an errno from the
source through these two sets: one leaves the node to ESTALE (the kernel's one retry looks
the names up again), the other answers the path missing.
"""

from __future__ import annotations

import errno

# Errors saying that a path no longer leads to what was looked up (ELOOP: a component on it
# is now a symlink, which the source refuses to follow).
GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)
# A node's path that no longer leads to it (the open answers ESTALE; ELOOP stays ELOOP).
MOVED = (errno.ENOENT, errno.ENOTDIR)
