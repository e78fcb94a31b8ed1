"""The SSD tier's on-disk entry store: every byte of file I/O under the cache directory.

The store keeps one file per cached source file. It does not choose what to cache or what to
evict (the cache and its policy do); it guarantees that nothing wrong is ever served and it
reports how many bytes it holds.

Layout of the cache directory (created with mode 0700)::

    lock                    flock(LOCK_EX) held by the daemon; contains its pid
    tmp/<pid>-<token>-<n>.tmp   entries being written (swept by scan() after a crash)
    data/<3 hex>/<32 hex>   entries; the name is xxh3_128(relpath), the bucket its first
                            3 hex digits (4096 buckets: ~2,500 files each at 10 M entries)

Entry file format (little-endian)::

    offset  size  field
         0     4  magic b"SHDE"
         4     2  u16 format version (1)
         6     2  u16 length of relpath in bytes
         8     8  u64 data length
        16     8  u64 source size      } the source's Signature when the entry was written;
        24     8  i64 source mtime_ns  } get() serves the entry only if the caller's
        32     8  u64 source inode     } current Signature is identical
        40     8  u64 xxh3_64(data)
        48     8  u64 xxh3_64(bytes 0..47): lets scan() trust a header without reading data
        56     -  relpath bytes (checked against the requested relpath and the file name)
         -     -  data

Data length always equals the source size: put() refuses data whose length disagrees with the
signature (a source read torn by a concurrent change). An entry is valid only if the header
checksum matches, the file length is exactly header + relpath + data, the relpath hashes to the
file name, and (on get) the data checksum matches. Anything else is deleted and counted.

Writes go to tmp/ and are renamed into place with os.replace, without fsync by default: after a
crash an entry is the old file, the new file, or (on some filesystems) a torn file that the
checksums reject. That is enough for a cache whose source of truth is elsewhere.

Accounting: ``used_bytes`` counts data bytes only; ``disk_bytes`` counts what ``du`` would see
(whole file rounded up to 4 KiB blocks) and is what the watermarks compare with ``capacity``.
Both are exact for buckets the store knows: all of them in a freshly created cache, and in a
reopened one each bucket once scan() has passed it. scan() restarts the count from zero.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import secrets
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

__all__ = ["BLOCK", "HEADER", "MAGIC", "VERSION", "CacheLocked", "Signature", "SsdStore"]

MAGIC = b"SHDE"
VERSION = 1
HEADER = struct.Struct("<4sHHQQqQQQ")
_HASHED = struct.Struct("<4sHHQQqQQ")  # the header fields covered by the header checksum
HSIZE = HEADER.size  # 56
BLOCK = 4096  # the allocation unit we charge for, as du does on ext4/xfs
NBUCKETS = 4096
MAX_RELPATH = 0xFFFF

HIGH_WATERMARK = 0.95
LOW_WATERMARK = 0.85

# Scan state of a bucket. UNSCANNED: its files are not counted, mutations leave the counters
# alone and the scan counts whatever it finds later. SCANNING: files still in the scan's
# pending set are treated as UNSCANNED, all others as KNOWN. KNOWN: every file is counted.
_UNSCANNED, _SCANNING, _KNOWN = 0, 1, 2

_BUCKETS = {f"{i:03x}": i for i in range(NBUCKETS)}

# How much of a file scan() reads in one go: header plus any realistic relpath.
_SCAN_READ = HSIZE + 4096


@dataclass(frozen=True, slots=True)
class Signature:
    """The source file's identity when it was cached; any change makes the entry stale."""

    size: int
    mtime_ns: int
    ino: int

    @classmethod
    def of(cls, st: os.stat_result) -> Signature:
        return cls(size=st.st_size, mtime_ns=st.st_mtime_ns, ino=st.st_ino)


class CacheLocked(Exception):
    """Another daemon holds the cache directory."""


def _disk_size(file_size: int) -> int:
    """Bytes a file of this length occupies, rounded up to whole blocks as du reports it."""
    return -(-file_size // BLOCK) * BLOCK


def _pread_all(fd: int, n: int, offset: int) -> bytes:
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


def _write_all(fd: int, bufs: list[memoryview]) -> None:
    """writev until everything is written (a short write is legal, e.g. after a signal)."""
    views = [b for b in bufs if b.nbytes]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


class SsdStore:
    """Entries on a local disk, keyed by relpath, validated on every read.

    ``get``/``contains`` run on the trio event loop (one open, two preads, no scans);
    ``put``/``remove``/``scan`` run in worker threads. ``_lock`` guards the counters and makes
    each namespace change (rename, unlink) atomic with its accounting; it is held only around
    short metadata syscalls and single header reads, never around a data write, so the event
    loop never waits on it for long.
    """

    def __init__(
        self, root: Path, capacity: int, *, min_free: int = 1 << 30, fsync: bool = False
    ) -> None:
        self.root = Path(root)
        self.capacity = capacity
        self.min_free = min_free
        self.fsync = fsync
        self.used_bytes = 0
        self.disk_bytes = 0
        self.entries = 0
        self.corrupt_entries = 0
        self.stale_entries = 0
        self._lock = threading.Lock()
        self._scan_lock = threading.Lock()
        self._lock_fd: int | None = None
        self._put_failing = False

        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._take_lock()
        self._data = str(self.root / "data")
        self._tmp = str(self.root / "tmp")
        fresh = not os.path.isdir(self._data)
        try:
            os.makedirs(self._data, mode=0o700, exist_ok=True)
            os.makedirs(self._tmp, mode=0o700, exist_ok=True)
        except BaseException:
            self.close()
            raise
        # A cache created just now is empty, so every bucket is known and puts are counted at
        # once. A reopened one holds files from the last run that only scan() can count.
        self._state = bytearray([_KNOWN if fresh else _UNSCANNED]) * NBUCKETS
        self._pending: set[str] = set()
        # Our own tmp files carry this prefix so a concurrent scan() never sweeps them.
        self._tmp_prefix = f"{os.getpid()}-{secrets.token_hex(4)}-"
        self._seq = itertools.count()

    # -- lifetime ----------------------------------------------------------------------------

    def _take_lock(self) -> None:
        path = self.root / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise CacheLocked(
                f"cache directory {self.root} is in use by another shadefs daemon (pid {holder})"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        # flock, not fcntl locks: it belongs to the open file description, so the kernel drops
        # it when a crashed daemon's last descriptor closes, and a second store in this same
        # process is refused too.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def close(self) -> None:
        """Release the cache directory. Idempotent."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor releases the flock

    def __enter__(self) -> SsdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- keys --------------------------------------------------------------------------------

    def _key(self, relpath: bytes) -> tuple[int, str, str]:
        """(bucket index, file name, path) of relpath's entry, as plain strings for speed."""
        name = xxhash.xxh3_128_hexdigest(relpath)
        return int(name[:3], 16), name, f"{self._data}/{name[:3]}/{name}"

    def key_path(self, relpath: bytes) -> Path:
        """Where relpath's entry lives; a pure function of relpath."""
        return Path(self._key(relpath)[2])

    def _counted(self, bucket: int, name: str) -> bool:
        """Whether the file now at bucket/name is in the counters. Call with _lock held."""
        state = self._state[bucket]
        return state == _KNOWN or (state == _SCANNING and name not in self._pending)

    def _add(self, data_len: int, file_size: int) -> None:
        self.used_bytes += data_len
        self.disk_bytes += _disk_size(file_size)
        self.entries += 1

    def _sub(self, rlen: int, file_size: int) -> int:
        """Forget a counted file; returns its data bytes. Call with _lock held.

        The size comes from a stat of the file, so it equals what was added unless someone
        truncated the file behind our back; the clamps keep that from going negative.
        """
        data_len = max(file_size - HSIZE - rlen, 0)
        self.used_bytes = max(self.used_bytes - data_len, 0)
        self.disk_bytes = max(self.disk_bytes - _disk_size(file_size), 0)
        self.entries = max(self.entries - 1, 0)
        return data_len

    # -- reads (event loop) ------------------------------------------------------------------

    def contains(self, relpath: bytes) -> bool:
        """Whether an entry file exists for relpath (cheap: one stat; not validated)."""
        try:
            os.stat(self._key(relpath)[2])
        except OSError:
            return False
        return True

    def get(self, relpath: bytes, sig: Signature) -> bytes | None:
        """The cached bytes of relpath if its entry is present, intact and not stale.

        A concurrent put() cannot make this return a mix of two versions: it writes a new
        inode and renames it over the path, and a file is never modified after the rename, so
        the descriptor opened here reads one complete version from start to end.
        """
        bucket, name, path = self._key(relpath)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot open cache entry %s: %s", path, exc)
            return None
        try:
            try:
                data, stale, data_len = self._read_entry(fd, relpath, sig)
            except OSError as exc:
                # An unreadable entry (EIO on a failing disk) is as useless as a corrupt one;
                # dropping it lets the cache refetch from the source.
                log.warning("cannot read cache entry %s: %s", path, exc)
                data, stale, data_len = None, False, sig.size
            if data is None:
                size = HSIZE + len(relpath) + data_len
                self._discard(fd, bucket, name, path, len(relpath), size, stale=stale)
            return data
        finally:
            os.close(fd)

    def in_page_cache(self, relpath: bytes) -> bool | None:
        """Whether the whole entry is in the page cache (None: no such entry).

        One read with RWF_NOWAIT, which the kernel refuses (or cuts short) instead of
        waiting for the disk. It lets a caller serve a warm entry inline and send a cold
        one to a thread. Where RWF_NOWAIT is unsupported, everything counts as cold.
        """
        _, _, path = self._key(relpath)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError:
            return False
        try:
            size = os.fstat(fd).st_size
            buf = bytearray(max(size, 1))
            return os.preadv(fd, [buf], 0, os.RWF_NOWAIT) == size
        except (OSError, AttributeError):  # EAGAIN, EOPNOTSUPP, no RWF_NOWAIT at all
            return False
        finally:
            os.close(fd)

    def _read_entry(
        self, fd: int, relpath: bytes, sig: Signature
    ) -> tuple[bytes | None, bool, int]:
        """(data, stale, data length the entry was counted with); data is None if unusable.

        The counted length comes from the header while its checksum holds, so a file truncated
        behind our back is forgotten with the size it was counted with; a file whose header is
        gone is assumed to have been the version the caller asked for.
        """
        rlen = len(relpath)
        head = os.pread(fd, HSIZE + rlen, 0)
        if len(head) < HSIZE:
            return None, False, sig.size
        magic, version, hrlen, data_len, size, mtime_ns, ino, dsum, hsum = HEADER.unpack_from(head)
        if (
            magic != MAGIC
            or version != VERSION
            or xxhash.xxh3_64_intdigest(memoryview(head)[: _HASHED.size]) != hsum
        ):
            return None, False, sig.size
        # The relpath is not under the header checksum; comparing it catches both its
        # corruption and (in theory) an xxh3_128 collision.
        if hrlen != rlen or head[HSIZE:] != relpath or data_len != size:
            return None, False, data_len
        if (size, mtime_ns, ino) != (sig.size, sig.mtime_ns, sig.ino):
            return None, True, data_len
        # One byte more than expected tells a file with trailing garbage from a good one.
        data = _pread_all(fd, data_len + 1, HSIZE + rlen)
        if len(data) != data_len or xxhash.xxh3_64_intdigest(data) != dsum:
            return None, False, data_len
        return data, False, data_len

    def _discard(
        self, fd: int, bucket: int, name: str, path: str, rlen: int, size: int, *, stale: bool
    ) -> None:
        """Delete the bad file open as fd (counted as size bytes), unless already replaced."""
        if stale:
            log.debug("dropping stale cache entry %s", path)
        else:
            log.warning("dropping corrupt cache entry %s", path)
        with self._lock:
            if stale:
                self.stale_entries += 1
            else:
                self.corrupt_entries += 1
            try:
                mine = os.fstat(fd)
                st = os.stat(path)
            except OSError:
                return
            if (st.st_ino, st.st_dev) != (mine.st_ino, mine.st_dev):
                return  # replaced by a fresh put() since we opened it: that one is fine
            try:
                os.unlink(path)
            except OSError as exc:
                log.warning("cannot delete cache entry %s: %s", path, exc)
                return
            if self._counted(bucket, name):
                self._sub(rlen, size)

    # -- writes (worker threads) -------------------------------------------------------------

    def put(self, relpath: bytes, data: bytes | memoryview, sig: Signature) -> bool:
        """Store data as relpath's entry, replacing any old one atomically.

        Returns False, without raising, if the entry cannot be written (disk full, quota, I/O
        error, read-only disk, ...) or would push free space below min_free or disk_bytes past
        capacity: the caller then serves from RAM and the source.
        """
        view = memoryview(data).cast("B")
        if view.nbytes != sig.size or len(relpath) > MAX_RELPATH:
            # A length that disagrees with the signature means the source changed while it
            # was read; caching it would serve bytes that match neither version.
            log.debug("not caching %r: %d bytes for size %d", relpath, view.nbytes, sig.size)
            return False
        bucket, name, path = self._key(relpath)
        file_size = HSIZE + len(relpath) + view.nbytes
        try:
            fields = (MAGIC, VERSION, len(relpath), view.nbytes, sig.size, sig.mtime_ns, sig.ino)
            hashed = _HASHED.pack(*fields, xxhash.xxh3_64_intdigest(view))
            header = hashed + struct.pack("<Q", xxhash.xxh3_64_intdigest(hashed))
        except struct.error as exc:
            log.warning("not caching %r: signature %r does not fit: %s", relpath, sig, exc)
            return False
        need = _disk_size(file_size)
        try:
            if self.disk_free() - need < self.min_free:
                log.debug("not caching %r: would leave less than %d bytes", relpath, self.min_free)
                return False
        except OSError as exc:
            return self._put_failed(relpath, exc)
        if self.disk_bytes + need > self.capacity:
            log.debug("not caching %r: cache is at capacity", relpath)
            return False

        tmp = f"{self._tmp}/{self._tmp_prefix}{next(self._seq)}.tmp"
        try:
            self._write_tmp(tmp, [memoryview(header), memoryview(relpath), view])
            self._commit(tmp, bucket, name, path, len(relpath), view.nbytes, file_size)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return self._put_failed(relpath, exc)
        if self._put_failing:
            self._put_failing = False
            log.info("cache disk writable again")
        return True

    def _write_tmp(self, tmp: str, bufs: list[memoryview]) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, bufs)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _commit(
        self, tmp: str, bucket: int, name: str, path: str, rlen: int, data_len: int, size: int
    ) -> None:
        """Rename tmp into place and account for it, atomically w.r.t. other mutations."""
        with self._lock:
            try:
                old: os.stat_result | None = os.stat(path)
            except FileNotFoundError:
                old = None
            try:
                os.replace(tmp, path)
            except FileNotFoundError:
                # Buckets are made on first use so a fresh cache costs no 4096 mkdirs.
                os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                os.replace(tmp, path)
            if self._counted(bucket, name):
                if old is not None:
                    self._sub(rlen, old.st_size)
                self._add(data_len, size)

    def _put_failed(self, relpath: bytes, exc: OSError) -> bool:
        # A full disk fails every put; say so once, not once per file.
        if not self._put_failing:
            self._put_failing = True
            code = errno.errorcode.get(exc.errno or 0, "?")
            log.warning("cache disk write failed (%s: %s); serving from RAM and source", code, exc)
        else:
            log.debug("cannot cache %r: %s", relpath, exc)
        return False

    def remove(self, relpath: bytes) -> int:
        """Delete relpath's entry; returns the data bytes freed (0 if there was none)."""
        bucket, name, path = self._key(relpath)
        with self._lock:
            try:
                st = os.stat(path)
                os.unlink(path)
            except FileNotFoundError:
                return 0
            except OSError as exc:
                log.warning("cannot delete cache entry %s: %s", path, exc)
                return 0
            if self._counted(bucket, name):
                return self._sub(len(relpath), st.st_size)
            return max(st.st_size - HSIZE - len(relpath), 0)

    # -- restore (worker thread) -------------------------------------------------------------

    def scan(self) -> Iterator[tuple[bytes, int, Signature]]:
        """Restore after a restart or crash: yield (relpath, size, signature) of valid entries.

        Sweeps stray tmp files, then walks the buckets reading headers only (data checksums
        are checked lazily by get). Entries with a bad header are deleted and counted. The
        counters restart from zero and grow as the walk proceeds; puts and removes may run
        concurrently. Memory is bounded by one bucket's names, whatever the cache size.
        """
        with self._scan_lock:
            with self._lock:
                self.used_bytes = self.disk_bytes = self.entries = 0
                self._pending.clear()
                # A bucket directory that does not exist yet holds nothing, so it is known
                # (and later puts into it count themselves); only existing ones need a walk.
                # Puts make buckets under this lock, so the listing cannot miss one.
                self._state[:] = bytes([_KNOWN]) * NBUCKETS
                with os.scandir(self._data) as it:
                    for entry in it:
                        bucket = _BUCKETS.get(entry.name)
                        if bucket is not None:
                            self._state[bucket] = _UNSCANNED
            self._sweep_tmp()
            for bucket in range(NBUCKETS):
                if self._state[bucket] == _UNSCANNED:
                    yield from self._scan_bucket(bucket)
            log.info(
                "cache scan done: %d entries, %d data bytes, %d corrupt entries deleted",
                self.entries,
                self.used_bytes,
                self.corrupt_entries,
            )

    def _sweep_tmp(self) -> None:
        swept = 0
        with os.scandir(self._tmp) as it:
            for entry in it:
                if entry.name.startswith(self._tmp_prefix):
                    continue  # a put() of ours in flight
                try:
                    os.unlink(entry.path)
                    swept += 1
                except OSError as exc:
                    log.warning("cannot remove stray %s: %s", entry.path, exc)
        if swept:
            log.info("removed %d stray temporary files from the cache", swept)

    def _scan_bucket(self, bucket: int) -> Iterator[tuple[bytes, int, Signature]]:
        prefix = f"{bucket:03x}"
        bdir = f"{self._data}/{prefix}"
        with self._lock:
            # Listing under the lock fixes which files this walk will count: a put() of a
            # name outside the listing counts itself, one inside leaves it to the walk.
            try:
                with os.scandir(bdir) as it:
                    names = [e.name for e in it if not e.is_dir(follow_symlinks=False)]
            except FileNotFoundError:
                names = []
            self._pending = set(names)
            self._state[bucket] = _SCANNING
        try:
            for name in names:
                with self._lock:
                    self._pending.discard(name)
                    found = self._scan_entry(bucket, prefix, name)
                if found is not None:
                    yield found  # never while holding the lock
        finally:
            with self._lock:
                # A walk abandoned mid-bucket leaves it SCANNING with the unvisited names
                # pending (uncounted) and later buckets UNSCANNED; the next scan recounts.
                if not self._pending:
                    self._state[bucket] = _KNOWN

    def _scan_entry(
        self, bucket: int, prefix: str, name: str
    ) -> tuple[bytes, int, Signature] | None:
        """Check one file's header, count it if good, delete it if bad. Call with _lock held."""
        path = f"{self._data}/{prefix}/{name}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None  # removed since the listing
        except OSError as exc:
            log.warning("cannot open cache entry %s: %s", path, exc)
            return self._scan_reject(path)
        try:
            file_size = os.fstat(fd).st_size
            head = os.pread(fd, _SCAN_READ, 0)
            if len(head) >= HSIZE:
                fields = HEADER.unpack_from(head)
                if fields[2] > len(head) - HSIZE:
                    head += _pread_all(fd, fields[2] - (len(head) - HSIZE), len(head))
        except OSError as exc:
            log.warning("cannot read cache entry %s: %s", path, exc)
            return self._scan_reject(path)
        finally:
            os.close(fd)
        if len(head) < HSIZE:
            return self._scan_reject(path)
        magic, version, rlen, data_len, size, mtime_ns, ino, _dsum, hsum = HEADER.unpack_from(head)
        relpath = head[HSIZE : HSIZE + rlen]
        if (
            magic != MAGIC
            or version != VERSION
            or xxhash.xxh3_64_intdigest(memoryview(head)[: _HASHED.size]) != hsum
            or data_len != size
            or file_size != HSIZE + rlen + data_len
            # The name check stands in for a relpath checksum: a damaged relpath would make
            # the cache believe it holds a file it does not.
            or xxhash.xxh3_128_hexdigest(relpath) != name
        ):
            return self._scan_reject(path)
        self._add(data_len, file_size)
        return relpath, data_len, Signature(size, mtime_ns, ino)

    def _scan_reject(self, path: str) -> None:
        self.corrupt_entries += 1
        log.warning("deleting damaged cache entry %s", path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot delete cache entry %s: %s", path, exc)
        return None

    # -- space -------------------------------------------------------------------------------

    def disk_free(self) -> int:
        """Bytes available to us on the cache disk."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def over_high_watermark(self) -> bool:
        """Time to evict: disk_bytes above 95% of capacity, or the disk below its free floor."""
        return self.disk_bytes > HIGH_WATERMARK * self.capacity or self.disk_free() < self.min_free

    def below_low_watermark(self) -> bool:
        """Eviction may stop: disk_bytes at most 85% of capacity and the free floor restored.

        The free floor also depends on other users of the disk, so this can stay False with
        nothing cached; the evicter must stop when it runs out of entries.
        """
        return (
            self.disk_bytes <= LOW_WATERMARK * self.capacity and self.disk_free() >= self.min_free
        )
