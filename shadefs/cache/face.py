"""The cache as the file system sees it: one call per open, one result, the version decided
here.

S3QL's read makes one call down (`async with cache.get(inode, blockno)`); so does an open
here. `CacheFace.open` decides where a file's bytes come from, and that they are the
version the open looked up, whole:

- a RAM hit, or bytes fetched, staged or read from the SSD tier (`Opened.data`, pinned for
  the handle until `unpin`);
- a miss whose fetch waits for the handle's first read (`Opened.later`, cache/deferred.py);
- a large file's blocks (`Opened.block`, cache/blocks.py), chosen here by size and by what
  open handles hold;
- neither: read it through the source (too large for every tier, or handles hold too
  much).

What a node is stays the file system's: when the source has another version than the one
looked up, `open` raises `Changed` and the file system checks the node and retires it
(`Namespace.fresh_stat`); a path that no longer leads to the file raises the source's ENOENT or
ENOTDIR, which the file system answers with ESTALE.

The hit path (fs/operations.py `_hit_open`) does not await: `reopen` serves a file whose
resident entry an earlier open found to be its node's version (`verify`), until the node's
next check is due. The record goes with the entry (the RAM tier), and with any change of
the node (`unverify`, called by the namespace and by the kernel's forgets). `reopen`,
`unpin` and `take_hits` are the cache's own bound methods: the hit path pays no call of
this face.
"""

from __future__ import annotations

import errno

import pyfuse3

from shadefs.cache.block_handle import BlockHandle
from shadefs.cache.blocks import Blocks
from shadefs.cache.coordinator import Cache
from shadefs.cache.deferred import Deferred
from shadefs.file_version import Changed, Signature, StatLike, serves

__all__ = ["CacheFace", "Opened"]


class Opened:
    """What an open gets (`CacheFace.open`): at most one of `data` (pinned bytes), `later`
    (a deferred fetch) and `block` (a large file's handle); none: read it through. `keep`:
    whether the kernel may keep the file's pages (keep_cache)."""

    __slots__ = ("data", "later", "block", "keep")

    def __init__(
        self,
        data: bytes | None = None,
        later: Deferred | None = None,
        block: BlockHandle | None = None,
        keep: bool = True,
    ) -> None:
        self.data, self.later, self.block, self.keep = data, later, block, keep


# Read through: no pages kept, since the source is read as it is now.
_THROUGH = Opened(keep=False)


class CacheFace:
    """The cache's calls for the file system: the RAM and SSD tiers, deferred opens and
    large files' blocks behind one `open`."""

    def __init__(self, cache: Cache, blocks: Blocks | None = None) -> None:
        self._cache = cache
        self._blocks = blocks
        # (bound once: the hit path calls the cache with no frame of this face between)
        self.reopen = cache.reopen
        self.verified_bytes = cache.verified_bytes
        self.unpin = cache.handles.unpin
        self.take_hits = cache.take_hits
        self.unverify = cache.unverify
        self.verify = cache.verify

    async def open(
        self, key: int, path: bytes, st: StatLike, pid: int, *, lazy: bool, sig: Signature
    ) -> Opened:
        """An open of file `key` at `path`, looked up as `st` (whose signature is `sig`), by
        reader `pid`; `lazy`: a miss that would fetch is deferred to the first read. Raises
        `Changed` when the source has another version, the source's FUSEError otherwise."""
        cache, blocks = self._cache, self._blocks
        for _ in range(2):
            if st.st_size > cache.ram_max and blocks is not None and blocks.takes(key, st.st_size):
                got = await blocks.open(key, path, st)
                if got is None:
                    raise Changed(path)
                return Opened(block=got[0], keep=got[1])
            entry = await cache.open_entry(key, path, st, pid, lazy, sig)
            if entry is None:
                return _THROUGH
            if isinstance(entry, Deferred):
                return Opened(later=entry)
            if entry is cache.entries.get(key) or serves(entry.sig, len(entry.data), sig):
                return Opened(entry.data)  # a hit (checked by open_entry), or the version whole
            cache.unpin(entry.data)
            if entry.sig != sig:
                raise Changed(path)
            # The fetch was shared with an open that looked up a smaller size, and cut
            # there: fetch again.
        raise pyfuse3.FUSEError(errno.EIO)  # cut twice: never serve a version none asked for

    async def read_block(self, handle: BlockHandle, off: int, size: int) -> bytes:
        assert self._blocks is not None
        return await self._blocks.read(handle, off, size)

    async def release_block(self, handle: BlockHandle) -> None:
        assert self._blocks is not None
        await self._blocks.release(handle)

    async def drop(self, key: int, *, stale: bool) -> None:
        """Drop what every tier holds of `key` (whole, or in blocks). `stale`: the node's
        file has a new version (not counted as an eviction)."""
        await self._cache.evict(key, stale=stale)
        if self._blocks is not None:
            await (self._blocks.retire(key) if stale else self._blocks.evict(key))
