"""The write-type handlers of the read-only mirror: each fails with EROFS.

`fs/operations.py`'s `Operations` inherits them (and counts them in stats.json `requests`
as its own handlers); only the control files take writes, in `Operations.write` and
`Operations.setattr`.
"""

from __future__ import annotations

import errno

import pyfuse3
from pyfuse3 import FileNameT, FlagT, InodeT, ModeT, XAttrNameT

__all__ = ["ReadOnly", "erofs"]


def erofs() -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(errno.EROFS)


class ReadOnly(pyfuse3.Operations):
    """Every handler that would change the tree."""

    async def mknod(
        self,
        parent_inode: InodeT,
        name: FileNameT,
        mode: ModeT,
        rdev: int,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        raise erofs()

    async def mkdir(
        self, parent_inode: InodeT, name: FileNameT, mode: ModeT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        raise erofs()

    async def unlink(
        self, parent_inode: InodeT, name: FileNameT, ctx: pyfuse3.RequestContext
    ) -> None:
        raise erofs()

    async def rmdir(
        self, parent_inode: InodeT, name: FileNameT, ctx: pyfuse3.RequestContext
    ) -> None:
        raise erofs()

    async def symlink(
        self,
        parent_inode: InodeT,
        name: FileNameT,
        target: FileNameT,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        raise erofs()

    async def rename(
        self,
        parent_inode_old: InodeT,
        name_old: FileNameT,
        parent_inode_new: InodeT,
        name_new: FileNameT,
        flags: FlagT,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        raise erofs()

    async def link(
        self,
        inode: InodeT,
        new_parent_inode: InodeT,
        new_name: FileNameT,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        raise erofs()

    async def create(
        self,
        parent_inode: InodeT,
        name: FileNameT,
        mode: ModeT,
        flags: FlagT,
        ctx: pyfuse3.RequestContext,
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        raise erofs()

    async def setxattr(
        self, inode: InodeT, name: XAttrNameT, value: bytes, ctx: pyfuse3.RequestContext
    ) -> None:
        raise erofs()

    async def removexattr(
        self, inode: InodeT, name: XAttrNameT, ctx: pyfuse3.RequestContext
    ) -> None:
        raise erofs()
