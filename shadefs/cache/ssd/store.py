"""The SSD tier's entry store: every byte of file I/O under the cache directory.

The store keeps one file per cached source file, in the format of `ssd_format`. It does not
choose what to cache or what to evict (the cache and its policy do); it guarantees that
nothing wrong is ever served and it reports how many bytes it holds.

Layout of the cache directory (created with mode 0700)::

    lock                    flock(LOCK_EX) held by the daemon on a descriptor kept open for
                            its life; contains its pid
    tmp/<pid>-<token>-<n>.tmp   entries being written (swept by scan() after a crash)
    data/<3 hex>/<32 hex>   entries; the name is xxh3_128(relpath), the bucket its first
                            3 hex digits (4096 buckets: ~2,500 files each at 10 M entries)

A corrupt entry is deleted and counted in ``corrupt_entries``; a stale one (the source
changed) or an outdated one (another format version) in ``stale_entries``.

Writes go to tmp/ and are renamed into place with os.replace, without fsync: after a crash
an entry is the old file, the new file, or (on some filesystems) a torn file that the
checksums reject. That is enough for a cache whose source of truth is elsewhere.

Every access goes through a descriptor of the cache directory opened once, never through its
path: if someone deletes or replaces the directory while the daemon runs, the daemon keeps
working in the directory it opened (an entry that is gone is a miss, a write that fails is
refused) and never touches the new one, which another daemon may then take. `lost()` says
when the directory was deleted; the tier then runs on RAM and the source (ssd/tier.py).
The directory must belong to the daemon's user and be writable by no one else
(`check_owner`): an entry forged by another user is never served.

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
import stat
from collections.abc import Iterator
from pathlib import Path

from shadefs.cache.ssd.format import (
    HSIZE,
    MAX_RELPATH,
    Verdict,
    disk_size,
    encode_header,
    entry_name,
    entry_size,
    read_entry,
    read_version,
    write_all,
)
from shadefs.cache.ssd.ledger import Ledger
from shadefs.cache.ssd.owner import check_owner
from shadefs.file_version import Signature
from shadefs.source.paths import open_cached_at

log = logging.getLogger(__name__)

# Entries are files the store wrote: a symlink in their place is refused, never followed.
_READ = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
_CACHED_OPEN = [True]  # False where openat2 cannot open from the dentry cache only

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
        self._warned: set[str] = set()

        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        # The directory as it is now, held for the daemon's life: every path below is
        # relative to this descriptor (module docstring).
        self._dir = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            check_owner(os.fstat(self._dir), f"cache directory {self.root}")
            self._take_lock()
            self._data = "data"
            self._tmp = "tmp"
            fresh = not self._isdir(self._data)
            for sub in (self._data, self._tmp):
                try:
                    os.mkdir(sub, 0o700, dir_fd=self._dir)
                except FileExistsError:
                    pass
                check_owner(
                    os.stat(sub, dir_fd=self._dir, follow_symlinks=False),
                    f"cache directory {self.root / sub}",
                )
        except BaseException:
            self.close()
            raise
        # Our own tmp files carry this prefix so a concurrent scan() never sweeps them.
        self._tmp_prefix = f"{os.getpid()}-{secrets.token_hex(4)}-"
        self._seq = itertools.count()
        self.ledger = Ledger(self._dir, self._data, self._tmp, self._tmp_prefix, fresh=fresh)

    def _isdir(self, name: str) -> bool:
        try:
            st = os.stat(name, dir_fd=self._dir, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return stat.S_ISDIR(st.st_mode)

    def lost(self) -> bool:
        """Whether the cache directory was deleted under the daemon (it holds no entry)."""
        try:
            return os.fstat(self._dir).st_nlink == 0
        except OSError:
            return True

    def warn_once(self, what: str, msg: str, *args: object) -> None:
        """Log a failure of the cache disk once per kind, not once per request."""
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)

    # -- lifetime ----------------------------------------------------------------------------

    def _take_lock(self) -> None:
        fd = os.open(
            "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600, dir_fd=self._dir
        )
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
        # process is refused too. The descriptor stays open until close().
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def close(self) -> None:
        """Release the cache directory. Idempotent."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor releases the flock
        dfd, self._dir = self._dir, -1
        if dfd >= 0:
            os.close(dfd)

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
        return self.root / self._key(relpath)[2]

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
            if nowait and _CACHED_OPEN[0]:
                fd = self._open_cached(path)
            else:
                fd = os.open(path, _READ, dir_fd=self._dir)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if nowait:
                raise BlockingIOError(exc.errno, "the thread will tell") from None
            self.warn_once("open", "cannot open cache entry %s: %s", path, exc)
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

    def get_any(self, relpath: bytes) -> tuple[bytes, Signature] | None:
        """relpath's entry and the version it was written for, or None (absent or not good,
        left for `get` to discard): staged for opens that compare the version (a thread's)."""
        return read_version(self._dir, self._key(relpath)[2], relpath)

    def _open_cached(self, path: str) -> int:
        """The entry's descriptor if its directory entries are cached: an open on the event
        loop must not wait for the disk to read a directory (after the kernel dropped its
        dentries, a cold SSD hit did); EAGAIN sends the read to a thread."""
        try:
            return open_cached_at(self._dir, os.fsencode(path), _READ)
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EINVAL):
                raise
            _CACHED_OPEN[0] = False  # a kernel before 5.12: open as before
            return os.open(path, _READ, dir_fd=self._dir)

    def _discard(
        self, fd: int, bucket: int, name: str, path: str, rlen: int, size: int, verdict: Verdict
    ) -> None:
        """Delete the bad file open as fd (counted as size bytes), unless already replaced."""
        with self.ledger.lock:
            self.ledger.count_bad(verdict, path)
            try:
                mine = os.fstat(fd)
                st = os.stat(path, dir_fd=self._dir, follow_symlinks=False)
            except OSError:
                return
            if (st.st_ino, st.st_dev) != (mine.st_ino, mine.st_dev):
                return  # replaced by a fresh put() since we opened it: that one is fine
            try:
                os.unlink(path, dir_fd=self._dir)
            except OSError as exc:
                self.warn_once("delete", "cannot delete cache entry %s: %s", path, exc)
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
        if self.disk_free() - need < self.min_free:
            log.debug("not caching %r: would leave less than %d bytes", relpath, self.min_free)
            return False
        if self.disk_bytes + need > self.capacity:
            log.debug("not caching %r: cache is at capacity", relpath)
            return False

        tmp = f"{self._tmp}/{self._tmp_prefix}{next(self._seq)}.tmp"
        try:
            self._write_tmp(tmp, [memoryview(header), memoryview(relpath), view])
            self._commit(tmp, bucket, name, path, len(relpath), view.nbytes, file_size)
        except OSError as exc:
            try:
                os.unlink(tmp, dir_fd=self._dir)
            except OSError:
                pass
            return self._put_failed(relpath, exc)
        if self._put_failing:
            self._put_failing = False
            log.info("cache disk writable again")
        return True

    def _write_tmp(self, tmp: str, bufs: list[memoryview]) -> None:
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600, dir_fd=self._dir
        )
        try:
            write_all(fd, bufs)
        finally:
            os.close(fd)

    def _commit(
        self, tmp: str, bucket: int, name: str, path: str, rlen: int, data_len: int, size: int
    ) -> None:
        """Rename tmp into place and account for it, atomically w.r.t. other mutations."""
        with self.ledger.lock:
            d = self._dir
            try:
                old: os.stat_result | None = os.stat(path, dir_fd=d, follow_symlinks=False)
            except FileNotFoundError:
                old = None
            try:
                os.replace(tmp, path, src_dir_fd=d, dst_dir_fd=d)
            except FileNotFoundError:
                # Buckets are made on first use so a fresh cache costs no 4096 mkdirs.
                try:
                    os.mkdir(os.path.dirname(path), 0o700, dir_fd=d)
                except FileExistsError:
                    pass
                os.replace(tmp, path, src_dir_fd=d, dst_dir_fd=d)
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
                st = os.stat(path, dir_fd=self._dir, follow_symlinks=False)
                os.unlink(path, dir_fd=self._dir)
            except FileNotFoundError:
                return 0
            except OSError as exc:
                self.warn_once("delete", "cannot delete cache entry %s: %s", path, exc)
                return 0
            if self.ledger.counted(bucket, name):
                return self.ledger.sub(len(relpath), st.st_size)
            return max(st.st_size - HSIZE - len(relpath), 0)

    # -- restore (worker thread) -------------------------------------------------------------

    def scan(self) -> Iterator[tuple[bytes, int, Signature]]:
        """(relpath, size, signature) of the valid entries, from their headers (`Ledger.scan`;
        puts and removes may run concurrently): the restore after a restart or crash."""
        return self.ledger.scan()

    # -- space -------------------------------------------------------------------------------

    def disk_free(self) -> int:
        """Bytes available to us on the cache disk (0 when the disk does not say)."""
        try:
            st = os.statvfs(self._dir)
        except OSError as exc:
            self.warn_once("statvfs", "cannot read the free space of %s: %s", self.root, exc)
            return 0
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
