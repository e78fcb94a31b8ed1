"""One SSD entry file: its format, the source signature in it, and how it is read and checked.

One entry file holds one cached source file. The store (`ssd_store`) owns the directory they
live in, their names and their accounting; this module owns the bytes of one file.

Layout (little-endian), format version 2::

    offset  size  field
         0     4  magic b"SHDE"
         4     2  u16 format version (2)
         6     2  u16 length of relpath in bytes
         8     8  u64 data length
        16     8  u64 source size      }
        24     8  i64 source mtime_ns  } the source's Signature when the entry was written;
        32     8  i64 source ctime_ns  } the entry is served only if the caller's current
        40     8  u64 source inode     } Signature is identical
        48     8  u64 xxh3_64(data)
        56     8  u64 xxh3_64(bytes 0..55): lets a scan trust a header without reading data
        64     -  relpath bytes (checked against the requested relpath and the file name)
         -     -  data

The data length always equals the source size (a read torn by a concurrent change is never
written). An entry is valid only if the header checksum matches, the file length is exactly
header + relpath + data, the relpath hashes to the file name (`entry_name`), and, when it is
read, the data checksum matches. Anything else is corrupt.

Versions: version 1 (56-byte header) had no ctime_ns. A file rewritten in place with its
size kept and its mtime put back by utime() looked unchanged to it; ctime cannot be set back
from user space. A version 1 entry (recognised by its own header checksum) is OUTDATED: its
signature cannot prove the source unchanged, so it is never served, and it is not
re-validated either (that would mean reading the source file whole). The store drops it
wherever it meets one (the restore's scan or a lookup), counts it in ``stale_entries`` and
``outdated_entries``, and says so once at INFO, not once per entry (nor as corruption); the
next read refetches the file. Any other version is corrupt.

Disk cost: whole files rounded up to 4 KiB blocks, as ``du`` reports them (`disk_size`).
"""

from __future__ import annotations

import enum
import os
import struct
from dataclasses import dataclass

import xxhash

from shadefs.file_version import Signature

__all__ = [
    "BLOCK",
    "HSIZE",
    "MAGIC",
    "MAX_RELPATH",
    "VERSION",
    "Header",
    "Verdict",
    "decode_header",
    "disk_size",
    "encode_header",
    "entry_name",
    "entry_size",
    "pread_all",
    "read_entry",
    "read_header",
    "write_all",
]

MAGIC = b"SHDE"
VERSION = 2
_HASHED = struct.Struct("<4sHHQQqqQQ")  # the fields covered by the header checksum
_SUM = struct.Struct("<Q")
HSIZE = _HASHED.size + _SUM.size  # 64
# Version 1's header: no ctime_ns, its checksum right after these fields.
_V1_HASHED = struct.Struct("<4sHHQQqQQ")
# How much of a file a header read takes in one go: header plus any realistic relpath.
_SCAN_READ = HSIZE + 4096
BLOCK = 4096  # the allocation unit we charge for, as du does on ext4/xfs
MAX_RELPATH = 0xFFFF


class Verdict(enum.Enum):
    """What a check of an entry found."""

    GOOD = "good"
    STALE = "stale"  # intact, but the source has changed since it was written
    OUTDATED = "outdated"  # written in another format version: never served
    CORRUPT = "corrupt"


@dataclass(frozen=True, slots=True)
class Header:
    """A header whose checksum holds."""

    relpath_len: int
    data_len: int
    sig: Signature
    data_sum: int


def entry_name(relpath: bytes) -> str:
    """The entry file's name: 32 hex digits of xxh3_128(relpath)."""
    return xxhash.xxh3_128_hexdigest(relpath)


def entry_size(relpath_len: int, data_len: int) -> int:
    """The length of an entry file."""
    return HSIZE + relpath_len + data_len


def disk_size(file_size: int) -> int:
    """Bytes a file of this length occupies, rounded up to whole blocks as du reports it."""
    return -(-file_size // BLOCK) * BLOCK


def encode_header(relpath: bytes, data: bytes | memoryview, sig: Signature) -> bytes:
    """The header of the entry for relpath; ValueError if the signature does not fit it."""
    view = memoryview(data).cast("B")
    try:
        hashed = _HASHED.pack(
            MAGIC,
            VERSION,
            len(relpath),
            view.nbytes,
            sig.size,
            sig.mtime_ns,
            sig.ctime_ns,
            sig.ino,
            xxhash.xxh3_64_intdigest(view),
        )
    except struct.error as exc:
        raise ValueError(f"{sig!r} does not fit the entry header: {exc}") from None
    return hashed + _SUM.pack(xxhash.xxh3_64_intdigest(hashed))


def decode_header(head: bytes) -> Header | Verdict:
    """The header at the start of head, or why it cannot be trusted (OUTDATED or CORRUPT)."""
    if len(head) >= HSIZE:
        magic, version, rlen, dlen, size, mtime, ctime, ino, dsum = _HASHED.unpack_from(head)
        (hsum,) = _SUM.unpack_from(head, _HASHED.size)
        if (
            magic == MAGIC
            and version == VERSION
            and xxhash.xxh3_64_intdigest(memoryview(head)[: _HASHED.size]) == hsum
            and dlen == size
        ):
            sig = Signature(size=size, mtime_ns=mtime, ctime_ns=ctime, ino=ino)
            return Header(relpath_len=rlen, data_len=dlen, sig=sig, data_sum=dsum)
    # Only now, off the path of every good entry, is it worth looking for an old one.
    return Verdict.OUTDATED if _is_version_1(head) else Verdict.CORRUPT


def _is_version_1(head: bytes) -> bool:
    """Whether head starts with an intact version 1 header (not a damaged current one)."""
    if len(head) < _V1_HASHED.size + _SUM.size or head[:4] != MAGIC:
        return False
    (version,) = struct.unpack_from("<H", head, 4)
    (hsum,) = _SUM.unpack_from(head, _V1_HASHED.size)
    return version == 1 and bool(xxhash.xxh3_64_intdigest(head[: _V1_HASHED.size]) == hsum)


def read_entry(
    fd: int, relpath: bytes, sig: Signature, whole: memoryview | None = None
) -> tuple[Verdict, bytes | None, int]:
    """Check the entry open as fd against relpath and sig: (verdict, data if GOOD, counted).

    `counted` is the data length the entry was counted with: the header's while its checksum
    holds, so a file truncated behind the store's back is forgotten with the size it was
    counted with; for a file whose header is gone, the length the caller asked for.
    `whole`: the file's bytes, already read from fd (then fd is not read again).
    """
    rlen = len(relpath)
    head = os.pread(fd, HSIZE + rlen, 0) if whole is None else bytes(whole[: HSIZE + rlen])
    h = decode_header(head)
    if isinstance(h, Verdict):
        return h, None, sig.size
    # The relpath is not under the header checksum; comparing it catches both its corruption
    # and (in theory) an xxh3_128 collision.
    if h.relpath_len != rlen or head[HSIZE:] != relpath:
        return Verdict.CORRUPT, None, h.data_len
    if h.sig != sig:
        return Verdict.STALE, None, h.data_len
    # One byte more than expected tells a file with trailing garbage from a good one.
    start = HSIZE + rlen
    if whole is None:
        data = pread_all(fd, h.data_len + 1, start)
    else:
        data = bytes(whole[start : start + h.data_len + 1])
    if len(data) != h.data_len or xxhash.xxh3_64_intdigest(data) != h.data_sum:
        return Verdict.CORRUPT, None, h.data_len
    return Verdict.GOOD, data, h.data_len


def read_version(dir_fd: int, path: str, relpath: bytes) -> tuple[bytes, Signature] | None:
    """The data of relpath's entry file at `path` (below `dir_fd`) and the version it was
    written for, or None where it is absent, unreadable or not good (left for a lookup to
    find and discard). The prefetcher stages these for opens that compare the version."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        h = decode_header(os.pread(fd, HSIZE, 0))
        if isinstance(h, Verdict):
            return None
        # (The data read on its own: one copy of it, not a whole file's read then a slice.)
        _, data, _ = read_entry(fd, relpath, h.sig)
        return None if data is None else (data, h.sig)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_header(fd: int) -> tuple[Header | Verdict, bytes, int]:
    """(header or why not, relpath, file length) of the entry open as fd, without its data.

    The caller still checks that the relpath hashes to the file's name and that the length
    is `entry_size`: this reads no more than the header and the relpath.
    """
    file_size = os.fstat(fd).st_size
    head = os.pread(fd, _SCAN_READ, 0)
    h = decode_header(head)
    if isinstance(h, Verdict):
        return h, b"", file_size
    if h.relpath_len > len(head) - HSIZE:
        head += pread_all(fd, h.relpath_len - (len(head) - HSIZE), len(head))
    return h, head[HSIZE : HSIZE + h.relpath_len], file_size


def pread_all(fd: int, n: int, offset: int) -> bytes:
    """Read up to n bytes at offset; shorter only at end of file.

    One pread nearly always suffices; Linux caps a single read at about 2 GiB, hence the loop.
    """
    data = os.pread(fd, n, offset)
    if len(data) == n or not data:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = os.pread(fd, n - got, offset + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def write_all(fd: int, bufs: list[memoryview]) -> None:
    """writev until everything is written (a short write is legal, e.g. after a signal)."""
    views = [b for b in bufs if b.nbytes]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
