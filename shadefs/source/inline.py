"""Small files that the source holds in memory, read on the event loop: no thread hop.

A source call runs in a worker thread (source/part.py) because it may block on the remote. But
a 4 KiB file that a local filesystem has in its page cache costs about 9 us of system calls
to read, and the hop around them far more: the worker's wake-up, and a GIL hand-off at each
of the read's six system calls while the loop runs Python beside it (futex waits that were
a third of the daemon's CPU on a cold pass of `tools/bench/bench_cpu.py`). So a file is
first tried here, on the loop, and goes to a thread only when this cannot answer at once:

- only where nothing can block: the source's root is on a local disk filesystem
  (`LOCAL`, from /proc/self/mountinfo), and the open neither crosses into another mount
  (RESOLVE_NO_XDEV: an NFS mount under a local tree goes to the thread) nor leaves the
  kernel's dentry cache (RESOLVE_CACHED); the same beneath-the-root, no-symlink resolution
  as every other open (source/paths.py);
- the read is one `preadv2(RWF_NOWAIT)` of the whole file and one byte more: EAGAIN, or
  fewer bytes than the fstat's size, when a page is not cached (no disk read on the loop);
- the same guarantee as a thread's fetch: one version of one regular file, its fstat taken
  before and after the read; anything else (changed, grown past the size looked up, larger
  than `MAX_INLINE`, not a regular file, any error) is left to the thread's fetch, which
  retries, bounds and reports it as it always did.

A kernel without openat2's RESOLVE_CACHED (before 5.12; probed on the root) or a filesystem
without RWF_NOWAIT reads switch this off for the daemon's life, logged once.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

from shadefs.source.paths import DIR_PATH, FILE_READ, Resolver, version

log = logging.getLogger(__name__)

__all__ = ["LOCAL", "MAX_INLINE", "InlineReads", "fstype_of"]

#: Filesystems whose open of a cached dentry and whose RWF_NOWAIT read never wait on a
#: device or a server. Network and FUSE filesystems (whose open is a round trip) are not
#: here, nor tmpfs (no RWF_NOWAIT reads as of 6.18: EOPNOTSUPP).
LOCAL = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs"})
#: Larger files are copied in threads: the copy would hold the loop for long.
MAX_INLINE = 256 << 10


def fstype_of(dev: int, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The filesystem type of the mount whose device is `dev` (a stat's st_dev); None when
    /proc does not say (then nothing is read inline)."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open(mountinfo) as f:
            for line in f:
                fields = line.split()
                if len(fields) > 3 and fields[2] == want and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except OSError:
        pass
    return None


class InlineReads:
    """Reads of small files that the source answers from memory, on the calling thread.

    :enabled: whether reads are tried here at all
    :reads: files read here
    :passed: files tried here and left to a thread
    """

    def __init__(self, paths: Resolver, *, enabled: bool = True) -> None:
        fstype = fstype_of(os.fstat(paths.root_fd).st_dev)
        self.enabled = enabled and fstype in LOCAL and self._probe(paths)
        self.flags = FILE_READ | os.O_NOATIME  # no atime write (a journal entry) per read
        self.reads = 0
        self.passed = 0
        log.debug("inline reads of cached small files: %s (%s)", self.enabled, fstype)

    @staticmethod
    def _probe(paths: Resolver) -> bool:
        """Whether this kernel has a cached-only openat2 (the root's dentry is cached)."""
        try:
            os.close(paths.open_cached(b"", DIR_PATH))
        except OSError as exc:
            log.info("no source reads on the event loop: %s", exc.strerror)
            return False
        return True

    def read(
        self, paths: Resolver, rel: bytes, size: int | None
    ) -> tuple[bytes, os.stat_result] | None:
        """The file's bytes and fstat if it could be read at once in full; else None."""
        try:
            fd = self._open(paths, rel)
        except OSError as exc:
            self._failed(exc)
            return None
        try:
            st = os.fstat(fd)
            n = st.st_size
            if not stat.S_ISREG(st.st_mode) or n > MAX_INLINE or (size is not None and n > size):
                self.passed += 1
                return None
            buf = bytearray(n + 1)  # one byte more: a read of n bytes is the end
            if os.preadv(fd, [buf], 0, os.RWF_NOWAIT) != n or version(os.fstat(fd)) != version(st):
                self.passed += 1  # not all cached, grew, or changed: the thread's fetch
                return None
        except OSError as exc:
            self._failed(exc)
            return None
        finally:
            os.close(fd)
        del buf[n]
        self.reads += 1
        return bytes(buf), st

    def _open(self, paths: Resolver, rel: bytes) -> int:
        try:
            return paths.open_cached(rel, self.flags)
        except PermissionError as exc:
            if exc.errno != errno.EPERM or not self.flags & os.O_NOATIME:
                raise  # (EACCES: the file is not readable, O_NOATIME or not)
            # O_NOATIME is the file owner's or CAP_FOWNER's: without it, atime is written.
            self.flags &= ~os.O_NOATIME
            return paths.open_cached(rel, self.flags)

    def _failed(self, exc: OSError) -> None:
        self.passed += 1
        if exc.errno == errno.EOPNOTSUPP:
            # The filesystem has no RWF_NOWAIT reads: never again.
            self.enabled = False
            log.info("no source reads on the event loop: %s", exc.strerror)
