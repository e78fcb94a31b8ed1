"""Large positional reads of a source descriptor that a random reader set off: in flight together.

A random reader's descriptor is marked `POSIX_FADV_RANDOM` (`advise`) so
that its small reads do not set off the source filesystem's own read-ahead. But the kernel
then reads a large pread of such a descriptor as a chain of synchronous requests, each at
most the source's read-ahead size (`read_ahead_kb` of its backing device info, 128 KiB by
default): a 1 MiB mmap fault of an LMDB file read through the mount became eight 128 KiB
round trips to the remote, one after the other. Over the slow-remote emulator (100 MB/s),
40 random 1 MiB preads took 0.82 s against 0.42 s of transfer.

`POSIX_FADV_WILLNEED` starts the reads of a range without waiting for them, and the kernel
clamps each call to the same read-ahead size. So a large read is announced piece by piece,
each piece one read-ahead's worth, and then read: the pieces travel together, and the
pread waits for the last of them (the same 40 preads: 0.47 s, the same bytes). Exactly the
bytes asked are fetched, so "fetch what is read" holds. The piece is the source's
read-ahead size, read once from sysfs: on NFS (read-ahead of 15 rsize) a 1 MiB read fits
in one piece and goes as it did, one request.

These functions run in the source's worker threads (source/part.py, cache/blocks.py).
"""

from __future__ import annotations

import os

__all__ = ["DEFAULT_PIECE", "advise", "pread_spread", "readahead_bytes", "spread"]

DEFAULT_PIECE = 128 << 10  # the kernel's default read_ahead_kb


def readahead_bytes(dev: int) -> int:
    """The read-ahead size of the device `dev` (a stat's st_dev): its bdi's read_ahead_kb;
    the kernel's default when sysfs does not say (a partition, no sysfs); 0 when read-ahead
    is off there (WILLNEED then reads one page a call: no use)."""
    try:
        with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb") as f:
            return int(f.read()) << 10
    except (OSError, ValueError):
        return DEFAULT_PIECE


def spread(fd: int, size: int, off: int, piece: int) -> None:
    """Start the reads of [off, off + size) in pieces of `piece` bytes, all at once (a no-op
    when the range fits in one piece: the pread sends it as one request anyway)."""
    if piece <= 0 or size <= piece:
        return
    end = off + size
    try:
        for start in range(off, end, piece):
            os.posix_fadvise(fd, start, min(piece, end - start), os.POSIX_FADV_WILLNEED)
    except OSError:  # only advice: the pread reads the range all the same
        pass


def pread_spread(fd: int, size: int, off: int, piece: int) -> bytes:
    """os.pread, its pieces started together first (`spread`)."""
    spread(fd, size, off, piece)
    return os.pread(fd, size, off)


def advise(fd: int, random: bool) -> None:
    """Tell the kernel how a source descriptor is read. The reads that reach the daemon
    were already sized by the mount's own read-ahead; a random reader's would otherwise
    set off the source filesystem's read-ahead as well, which fetches pages nobody reads
    (an LMDB reader through the mount would pull about twice what it pulls direct).
    Inline: fadvise only sets a flag on the open file, it does no I/O."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM if random else os.POSIX_FADV_NORMAL)
    except OSError:
        pass
