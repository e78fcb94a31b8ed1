"""The SSD tier's entry store: every byte of file I/O under the cache directory.

The store keeps one file per cached source file, in the format of `ssd_format`. It does not
choose what to cache or what to evict (the cache and its policy do); it guarantees that
nothing wrong is ever served and it reports how many bytes it holds.

Layout of the cache directory (created with mode 0700)::

    lock                    flock(LOCK_EX) held by the daemon; contains its pid
    tmp/<pid>-<token>-<n>.tmp   entries being written (swept by scan() after a crash)
    data/<3 hex>/<32 hex>   entries; the name is xxh3_128(relpath), the bucket its first
                            3 hex digits (4096 buckets: ~2,500 files each at 10 M entries)

A corrupt entry is deleted and counted in ``corrupt_entries``; a stale one (the source
changed) or an outdated one (another format version) in ``stale_entries``.

Writes go to tmp/ and are renamed into place with os.replace, without fsync: after a crash
an entry is the old file, the new file, or (on some filesystems) a torn file that the
checksums reject. That is enough for a cache whose source of truth is elsewhere.

Accounting (`ssd_ledger`): ``used_bytes`` counts data bytes only; ``disk_bytes`` counts what
``du`` would see (whole files rounded up to 4 KiB blocks) and is what the watermarks compare
with ``capacity``. Both are exact for buckets the ledger knows: all of them in a freshly
created cache, and in a reopened one each bucket once scan() has passed it.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from shadefs.cache.ssd_format import (
    HSIZE,
    MAX_RELPATH,
    Signature,
    Verdict,
    disk_size,
    encode_header,
    entry_name,
    entry_size,
    read_entry,
    write_all,
)
from shadefs.cache.ssd_ledger import Ledger

log = logging.getLogger(__name__)

__all__ = ["CacheLocked", "SsdStore"]

HIGH_WATERMARK = 0.95
LOW_WATERMARK = 0.85


class CacheLocked(Exception):
    """Another daemon holds the cache directory."""


class SsdStore:
    """Entries on a local disk, keyed by relpath, validated on every read.

    ``get(nowait=True)`` runs on the trio event loop (one open, one read, no scans);
    ``put``/``remove``/``scan`` run in worker threads. The ledger's lock guards the counters
    and makes each namespace change (rename, unlink) atomic with its accounting; it is held
    only around short metadata syscalls and single header reads, never around a data write,
    so the event loop never waits on it for long.
    """

    def __init__(self, root: Path, capacity: int, *, min_free: int = 1 << 30) -> None:
        self.root = Path(root)
        self.capacity = capacity
        self.min_free = min_free
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
        # Our own tmp files carry this prefix so a concurrent scan() never sweeps them.
        self._tmp_prefix = f"{os.getpid()}-{secrets.token_hex(4)}-"
        self._seq = itertools.count()
        self.ledger = Ledger(self._data, self._tmp, self._tmp_prefix, fresh=fresh)

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

    # -- keys and counters -------------------------------------------------------------------

    def _key(self, relpath: bytes) -> tuple[int, str, str]:
        """(bucket index, file name, path) of relpath's entry, as plain strings for speed."""
        name = entry_name(relpath)
        return int(name[:3], 16), name, f"{self._data}/{name[:3]}/{name}"

    def key_path(self, relpath: bytes) -> Path:
        """Where relpath's entry lives; a pure function of relpath."""
        return Path(self._key(relpath)[2])

    # The ledger's counters, read by the tier and the stats.

    @property
    def used_bytes(self) -> int:
        """Data bytes of the counted entries."""
        return self.ledger.used_bytes

    @property
    def disk_bytes(self) -> int:
        """What the counted entries take on disk, as du reports it: the budget's measure."""
        return self.ledger.disk_bytes

    @property
    def entries(self) -> int:
        return self.ledger.entries

    @property
    def corrupt_entries(self) -> int:
        return self.ledger.corrupt_entries

    @property
    def stale_entries(self) -> int:
        return self.ledger.stale_entries

    # -- reads (event loop) ------------------------------------------------------------------

    def get(self, relpath: bytes, sig: Signature, nowait: bool = False) -> bytes | None:
        """The cached bytes of relpath if its entry is present, intact and not stale.

        A concurrent put() cannot make this return a mix of two versions: it writes a new
        inode and renames it over the path, and a file is never modified after the rename, so
        the descriptor opened here reads one complete version from start to end.

        `nowait`: raise BlockingIOError rather than wait for the disk. The entry is then
        read whole with RWF_NOWAIT, which the kernel refuses (or cuts short) unless every
        page is cached, and checked from that one read: a warm entry costs one open and one
        read inline, and a cold one goes to a thread (where RWF_NOWAIT is unsupported,
        every entry counts as cold).
        """
        bucket, name, path = self._key(relpath)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if nowait:
                raise BlockingIOError(exc.errno, "the thread will tell") from None
            log.warning("cannot open cache entry %s: %s", path, exc)
            return None
        try:
            whole = _read_nowait(fd) if nowait else None
            try:
                verdict, data, data_len = read_entry(fd, relpath, sig, whole)
            except OSError as exc:
                # An unreadable entry (EIO on a failing disk) is as useless as a corrupt one;
                # dropping it lets the cache refetch from the source.
                log.warning("cannot read cache entry %s: %s", path, exc)
                verdict, data, data_len = Verdict.CORRUPT, None, sig.size
            if data is None:
                size = entry_size(len(relpath), data_len)
                self._discard(fd, bucket, name, path, len(relpath), size, verdict)
            return data
        finally:
            os.close(fd)

    def _discard(
        self, fd: int, bucket: int, name: str, path: str, rlen: int, size: int, verdict: Verdict
    ) -> None:
        """Delete the bad file open as fd (counted as size bytes), unless already replaced."""
        with self.ledger.lock:
            self.ledger.count_bad(verdict, path)
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
            if self.ledger.counted(bucket, name):
                self.ledger.sub(rlen, size)

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
        file_size = entry_size(len(relpath), view.nbytes)
        try:
            header = encode_header(relpath, view, sig)
        except ValueError as exc:
            log.warning("not caching %r: %s", relpath, exc)
            return False
        need = disk_size(file_size)
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
            write_all(fd, bufs)
        finally:
            os.close(fd)

    def _commit(
        self, tmp: str, bucket: int, name: str, path: str, rlen: int, data_len: int, size: int
    ) -> None:
        """Rename tmp into place and account for it, atomically w.r.t. other mutations."""
        with self.ledger.lock:
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
            if self.ledger.counted(bucket, name):
                if old is not None:
                    self.ledger.sub(rlen, old.st_size)
                self.ledger.add(data_len, size)

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
        with self.ledger.lock:
            try:
                st = os.stat(path)
                os.unlink(path)
            except FileNotFoundError:
                return 0
            except OSError as exc:
                log.warning("cannot delete cache entry %s: %s", path, exc)
                return 0
            if self.ledger.counted(bucket, name):
                return self.ledger.sub(len(relpath), st.st_size)
            return max(st.st_size - HSIZE - len(relpath), 0)

    # -- restore (worker thread) -------------------------------------------------------------

    def scan(self) -> Iterator[tuple[bytes, int, Signature]]:
        """Restore after a restart or crash: yield (relpath, size, signature) of valid entries.

        Reads headers only (`Ledger.scan`); puts and removes may run concurrently.
        """
        return self.ledger.scan()

    # -- space -------------------------------------------------------------------------------

    def disk_free(self) -> int:
        """Bytes available to us on the cache disk."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def over_high_watermark(self) -> bool:
        """Time to evict: disk_bytes above 95% of capacity, or the disk below its free floor."""
        return self.disk_bytes > HIGH_WATERMARK * self.capacity or self.disk_free() < self.min_free

    def bytes_to_free(self) -> int:
        """What eviction must free to reach 85% of capacity with the free floor restored.

        The free floor also depends on other users of the disk, so this can stay above 0
        with nothing cached; the evicter must stop when it runs out of entries.
        """
        return max(
            self.disk_bytes - int(LOW_WATERMARK * self.capacity),
            self.min_free - self.disk_free(),
            0,
        )


def _read_nowait(fd: int) -> memoryview:
    """The whole file open as fd if every page of it is cached; else BlockingIOError."""
    try:
        size = os.fstat(fd).st_size
        buf = bytearray(max(size, 1))
        got = os.preadv(fd, [buf], 0, os.RWF_NOWAIT)
    except (OSError, AttributeError):  # EAGAIN, EOPNOTSUPP, no RWF_NOWAIT at all
        raise BlockingIOError(errno.EAGAIN, "not in the page cache") from None
    if got != size:
        raise BlockingIOError(errno.EAGAIN, "not wholly in the page cache")
    return memoryview(buf)[:size]
