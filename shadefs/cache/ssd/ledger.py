"""The SSD store's accounting: what it holds, kept exact while the restore walks the disk.

The counters (entries, data bytes, disk bytes) must agree with the files under data/ even
though a restarted daemon does not know what is there until a walk has passed, and puts
and removes run during that walk. So each bucket has a scan state:

- UNSCANNED: its files are not counted; mutations leave the counters alone and the walk
  counts whatever it finds later.
- SCANNING: the walk has listed the bucket; files still in its pending set are treated as
  UNSCANNED, all others as KNOWN.
- KNOWN: every file is counted; a mutation updates the counters itself.

A cache created just now is empty, so every bucket starts KNOWN. The walk (`scan`) restarts
the counters from zero, reads each file's header only (the data checksum is checked when the
entry is read) and deletes what it cannot trust. `lock` guards all of this, and the store
holds it around each rename or unlink together with the counter update, so the two never
disagree.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Iterator

from shadefs.cache.ssd.format import (
    HSIZE,
    VERSION,
    Verdict,
    disk_size,
    entry_name,
    entry_size,
    read_header,
)
from shadefs.file_version import Signature

log = logging.getLogger(__name__)

__all__ = ["NBUCKETS", "Ledger"]

NBUCKETS = 4096
_BUCKETS = {f"{i:03x}": i for i in range(NBUCKETS)}
_UNSCANNED, _SCANNING, _KNOWN = 0, 1, 2
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class Ledger:
    """Counters of the entries under `data`, and the walk that rebuilds them.

    :dir_fd: the cache directory, held by the store; the names below are relative to it
    :data: the data/ directory (buckets of entries)
    :tmp: the tmp/ directory; the walk sweeps it, except files named with `keep_prefix`
    :fresh: the directory was created just now, so it holds nothing to count
    """

    def __init__(self, dir_fd: int, data: str, tmp: str, keep_prefix: str, *, fresh: bool) -> None:
        self.lock = threading.Lock()
        self._dir = dir_fd
        self.used_bytes = 0
        self.disk_bytes = 0
        self.entries = 0
        self.corrupt_entries = 0
        self.stale_entries = 0
        self.outdated_entries = 0  # of stale_entries, those of another format version
        self._data = data
        self._tmp = tmp
        self._keep_prefix = keep_prefix
        self._state = bytearray([_KNOWN if fresh else _UNSCANNED]) * NBUCKETS
        self._pending: set[str] = set()
        self._scan_lock = threading.Lock()

    # -- counting (call with lock held) --------------------------------------------------

    def counted(self, bucket: int, name: str) -> bool:
        """Whether the file now at bucket/name is in the counters."""
        state = self._state[bucket]
        return state == _KNOWN or (state == _SCANNING and name not in self._pending)

    def add(self, data_len: int, file_size: int) -> None:
        self.used_bytes += data_len
        self.disk_bytes += disk_size(file_size)
        self.entries += 1

    def sub(self, rlen: int, file_size: int) -> int:
        """Forget a counted file; returns its data bytes.

        The size comes from a stat of the file, so it equals what was added unless someone
        truncated the file behind our back; the clamps keep that from going negative.
        """
        data_len = max(file_size - HSIZE - rlen, 0)
        self.used_bytes = max(self.used_bytes - data_len, 0)
        self.disk_bytes = max(self.disk_bytes - disk_size(file_size), 0)
        self.entries = max(self.entries - 1, 0)
        return data_len

    def count_bad(self, verdict: Verdict, path: str) -> None:
        """Count and log an entry that is being dropped."""
        if verdict is Verdict.CORRUPT:
            self.corrupt_entries += 1
            log.warning("dropping corrupt cache entry %s", path)
            return
        self.stale_entries += 1
        if verdict is Verdict.OUTDATED:
            # A cache written by an older version is full of these: say so once, not per file.
            self.outdated_entries += 1
            if self.outdated_entries == 1:
                log.info("dropping cache entries of another format (this one is %d)", VERSION)
        log.debug("dropping %s cache entry %s", verdict.value, path)

    # -- the walk (worker thread) --------------------------------------------------------

    def scan(self) -> Iterator[tuple[bytes, int, Signature]]:
        """Recount from disk: yield (relpath, size, signature) of every valid entry.

        Sweeps stray tmp files, then walks the buckets. Entries with a bad header, or of
        another format version, are deleted and counted. Memory is bounded by one bucket's
        names, whatever the cache size.
        """
        with self._scan_lock:
            with self.lock:
                self.used_bytes = self.disk_bytes = self.entries = 0
                self._pending.clear()
                # A bucket directory that does not exist yet holds nothing, so it is known
                # (and later puts into it count themselves); only existing ones need a walk.
                # Puts make buckets under this lock, so the listing cannot miss one.
                self._state[:] = bytes([_KNOWN]) * NBUCKETS
                for bucket in self._existing_buckets():
                    self._state[bucket] = _UNSCANNED
            self._sweep_tmp()
            for bucket in range(NBUCKETS):
                if self._state[bucket] == _UNSCANNED:
                    yield from self._scan_bucket(bucket)
            log.info(
                "cache scan done: %d entries, %d data bytes, %d corrupt and %d outdated "
                "entries deleted",
                self.entries,
                self.used_bytes,
                self.corrupt_entries,
                self.outdated_entries,
            )

    def _names(self, sub: str) -> list[str]:
        """The names in directory `sub` of the cache directory (not through a symlink)."""
        fd = os.open(sub, _DIR | os.O_NOFOLLOW, dir_fd=self._dir)
        try:
            with os.scandir(fd) as it:
                return [
                    e.name for e in it if not e.is_dir(follow_symlinks=False) or sub == self._data
                ]
        finally:
            os.close(fd)

    def _existing_buckets(self) -> Iterable[int]:
        return [_BUCKETS[name] for name in self._names(self._data) if name in _BUCKETS]

    def _sweep_tmp(self) -> None:
        swept = 0
        for name in self._names(self._tmp):
            if name.startswith(self._keep_prefix):
                continue  # a put() of ours in flight
            path = f"{self._tmp}/{name}"
            try:
                os.unlink(path, dir_fd=self._dir)
                swept += 1
            except OSError as exc:
                log.warning("cannot remove stray %s: %s", path, exc)
        if swept:
            log.info("removed %d stray temporary files from the cache", swept)

    def _scan_bucket(self, bucket: int) -> Iterator[tuple[bytes, int, Signature]]:
        bdir = f"{self._data}/{bucket:03x}"
        with self.lock:
            # Listing under the lock fixes which files this walk will count: a put() of a
            # name outside the listing counts itself, one inside leaves it to the walk.
            try:
                names = self._names(bdir)
            except (FileNotFoundError, NotADirectoryError):
                names = []
            self._pending = set(names)
            self._state[bucket] = _SCANNING
        try:
            for name in names:
                with self.lock:
                    self._pending.discard(name)
                    found = self._scan_entry(f"{bdir}/{name}", name)
                if found is not None:
                    yield found  # never while holding the lock
        finally:
            with self.lock:
                # A walk abandoned mid-bucket leaves it SCANNING with the unvisited names
                # pending (uncounted) and later buckets UNSCANNED; the next scan recounts.
                if not self._pending:
                    self._state[bucket] = _KNOWN

    def _scan_entry(self, path: str, name: str) -> tuple[bytes, int, Signature] | None:
        """Check one file's header, count it if good, delete it if bad. Call with lock held."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=self._dir)
        except FileNotFoundError:
            return None  # removed since the listing
        except OSError as exc:
            log.warning("cannot open cache entry %s: %s", path, exc)
            self._drop(path, Verdict.CORRUPT)
            return None
        try:
            h, relpath, file_size = read_header(fd)
        except OSError as exc:
            log.warning("cannot read cache entry %s: %s", path, exc)
            self._drop(path, Verdict.CORRUPT)
            return None
        finally:
            os.close(fd)
        if isinstance(h, Verdict):
            self._drop(path, h)
            return None
        # The name check stands in for a relpath checksum: a damaged relpath would make the
        # cache believe it holds a file it does not.
        if file_size != entry_size(h.relpath_len, h.data_len) or entry_name(relpath) != name:
            self._drop(path, Verdict.CORRUPT)
            return None
        self.add(h.data_len, file_size)
        return relpath, h.data_len, h.sig

    def _drop(self, path: str, verdict: Verdict) -> None:
        """Delete an uncounted bad file that the walk found."""
        self.count_bad(verdict, path)
        try:
            os.unlink(path, dir_fd=self._dir)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot delete cache entry %s: %s", path, exc)
