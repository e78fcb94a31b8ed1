"""Opening paths beneath the source root without ever following a symlink.

Whoever can write into the source (anyone with write access to a shared NFS dataset) can
replace a file or a directory by a symlink at any moment, also between the daemon's lookup
and its open. So no path string is ever resolved from `/` or through a symlink: every access
starts at a descriptor of the source root, held for the daemon's life, and refuses a symlink
on every component, the last one included.

- `openat2(2)` with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS (Linux
  5.6+): one system call per open; the kernel itself refuses any symlink and any escape.
  Python has no binding for it, so it is called through ctypes.
- Elsewhere (an older kernel, or a seccomp filter that hides openat2): a walk that opens each
  directory component with O_NOFOLLOW | O_DIRECTORY relative to the one before it, and the
  last component with O_NOFOLLOW.

Which one is used is probed once, when the root is opened. Metadata takes the same road: the
parent directory is opened as above and the last component is looked at relative to it
(fstatat, readlinkat), never followed.

Errors, the same for both resolvers: a symlink anywhere on the path is ELOOP (the walk's
ENOTDIR for a symlinked directory is turned into ELOOP), a component that is not a directory
ENOTDIR, a missing one ENOENT, and a `..` that would leave the root EXDEV. Files are opened
with O_NONBLOCK, so a file swapped for a FIFO cannot hang a worker thread until the timeout;
a regular file gets blocking mode back before it is read.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import stat
import weakref
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

# <linux/openat2.h>. The system call number is the same on every architecture that has the
# unified table (all but alpha and ia64), which is every one that runs this daemon.
_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
# For `open_cached` also: no mount crossed (another filesystem may block where this one
# does not), and EAGAIN rather than a lookup that leaves the kernel's dentry cache (5.12+).
_RESOLVE_NO_XDEV = 0x01
_RESOLVE_CACHED = 0x20
_RESOLVE_NOWAIT = _RESOLVE | _RESOLVE_NO_XDEV | _RESOLVE_CACHED

T = TypeVar("T")

# How directories on the way are opened: O_PATH needs no read permission and does not call
# the filesystem's open (no round trip on NFS); it is enough for openat/fstatat/readlinkat.
DIR_PATH = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
# A directory to list.
DIR_READ = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# A file to read: O_NONBLOCK so that a FIFO cannot block the open, O_NOCTTY so that a
# terminal cannot become the daemon's controlling terminal.
FILE_READ = os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


def _load_syscall(lib: type[ctypes.CDLL] = ctypes.CDLL) -> Callable[..., int] | None:
    try:
        fn = lib(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_syscall = _load_syscall()
# The same call holding the GIL (a PyDLL function does not release it): for `open_cached`,
# which cannot block, on the event loop, where handing the GIL to a worker thread and
# taking it back would cost more than the call.
_syscall_held = _load_syscall(ctypes.PyDLL)
_HOW_CACHED: dict[int, tuple[_OpenHow, int]] = {}  # open_how per flags, kept with its address


class Resolver:
    """Opens and inspects paths relative to the source root, never following a symlink.

    :root: the path the root was opened by
    :root_fd: the source root, opened once (following the operator's own path to it)
    :kind: "openat2" or "walk", the resolver in use
    """

    def __init__(self, root: bytes, *, use_openat2: bool | None = None) -> None:
        self.root = root
        self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._finalizer = weakref.finalize(self, os.close, self.root_fd)
        # One open_how per flag set, built on first use and kept alive with its address.
        self._how: dict[int, tuple[_OpenHow, int]] = {}
        if use_openat2 is None:
            use_openat2 = self._probe()
        self.kind = "openat2" if use_openat2 else "walk"
        # A flag rather than a bound method kept on self: that would be a reference cycle,
        # and the root descriptor would stay open until the cycle collector ran.
        self._use_openat2 = use_openat2

    def _probe(self) -> bool:
        if _syscall is None:
            log.info("no libc syscall(): opening source paths by a no-follow walk")
            return False
        try:
            os.close(self._openat2(b"", DIR_PATH))
        except OSError as exc:
            log.info(
                "openat2 is not available (%s): opening source paths by a no-follow walk",
                exc.strerror,
            )
            return False
        return True

    def close(self) -> None:
        """Close the root descriptor now (else it is closed when the resolver is collected)."""
        self._finalizer()

    # --- opening ----------------------------------------------------------------------

    def open(self, rel: bytes, flags: int) -> int:
        """A descriptor of `rel` (b"" is the root), opened with `flags` (never O_CREAT)."""
        if self._use_openat2:
            return self._openat2(rel, flags)
        return self._walk(rel, flags)

    def open_cached(self, rel: bytes, flags: int) -> int:
        """`open`, but only from the kernel's caches and within the root's own filesystem,
        and without releasing the GIL (`open_cached_at`); ENOSYS with the walk."""
        if not self._use_openat2:
            raise OSError(errno.ENOSYS, "no openat2", rel)
        return open_cached_at(self.root_fd, rel, flags)

    def _openat2(self, rel: bytes, flags: int) -> int:
        if b"\0" in rel:  # ctypes would cut the path there
            raise OSError(errno.EINVAL, "embedded NUL in path", rel)
        how = self._how.get(flags)
        if how is None:
            st = _OpenHow(flags, 0, _RESOLVE)
            how = self._how[flags] = (st, ctypes.addressof(st))
        path = rel or b"."
        assert _syscall is not None
        for _ in range(8):
            fd = _syscall(_SYS_OPENAT2, self.root_fd, path, how[1], ctypes.sizeof(_OpenHow))
            if fd >= 0:
                return fd
            code = ctypes.get_errno()
            # EAGAIN: a concurrent rename raced the kernel's `..` check; EINTR: a signal.
            if code not in (errno.EAGAIN, errno.EINTR):
                break
        raise OSError(code, os.strerror(code), rel)

    def _walk(self, rel: bytes, flags: int) -> int:
        *dirs, last = rel.split(b"/")
        fd = self.root_fd
        try:
            for part in dirs:
                if part in (b"", b"."):
                    continue
                nfd = self._step(fd, part, DIR_PATH | os.O_NOFOLLOW)
                if fd != self.root_fd:
                    os.close(fd)
                fd = nfd
            return self._step(fd, last or b".", flags | os.O_NOFOLLOW)
        finally:
            if fd != self.root_fd:
                os.close(fd)

    @staticmethod
    def _step(dir_fd: int, name: bytes, flags: int) -> int:
        if name == b"..":
            raise OSError(errno.EXDEV, "'..' in a source path", name)
        try:
            return os.open(name, flags, dir_fd=dir_fd)
        except NotADirectoryError:
            # O_DIRECTORY | O_NOFOLLOW on a symlink says ENOTDIR; openat2 says ELOOP.
            if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), name) from None
            raise

    def _at(self, rel: bytes, fn: Callable[[bytes, int], T]) -> T:
        """fn(name, parent_fd) for the last component of `rel`, its parent opened no-follow."""
        head, _, name = rel.rpartition(b"/")
        if name in (b"", b".", b".."):
            raise OSError(errno.EINVAL, "not a name in the source", rel)
        if not head:
            return fn(name, self.root_fd)
        fd = self.open(head, DIR_PATH)
        try:
            return fn(name, fd)
        finally:
            os.close(fd)

    # --- metadata ---------------------------------------------------------------------

    def lstat(self, rel: bytes) -> os.stat_result:
        if not rel:
            return os.fstat(self.root_fd)
        return self._at(rel, _lstat_at)

    def lstat_in(self, rel: bytes) -> tuple[os.stat_result, os.stat_result]:
        """(fstat of the directory the entry was found in, the entry's lstat)."""
        return self._at(rel, _lstat_with_parent)

    def readlink(self, rel: bytes) -> bytes:
        return self._at(rel, _readlink_at)

    def scandir(self, rel: bytes) -> list[tuple[bytes, os.stat_result]]:
        """The directory's entries with their lstat, sorted by name."""
        return self.scandir_with_stat(rel)[1]

    def scandir_with_stat(
        self, rel: bytes
    ) -> tuple[os.stat_result, list[tuple[bytes, os.stat_result]]]:
        """The directory's own fstat (which directory was listed) and its entries."""
        fd = self.open(rel, DIR_READ)
        out = []
        try:
            st = os.fstat(fd)
            # scandir works on its own duplicate of fd; its entries' stat() is an fstatat
            # relative to that directory, without following. Names come back as str from
            # a descriptor; fsencode gives back the exact bytes.
            with os.scandir(fd) as it:
                for entry in it:
                    try:
                        out.append((os.fsencode(entry.name), entry.stat(follow_symlinks=False)))
                    except FileNotFoundError:
                        continue  # removed between readdir and lstat
        finally:
            os.close(fd)
        out.sort(key=lambda item: item[0])
        return st, out

    def statvfs(self) -> os.statvfs_result:
        return os.statvfs(self.root_fd)

    def getxattr(self, rel: bytes, name: bytes) -> bytes:
        fd = self._xattr_fd(rel)
        if fd is None:
            raise OSError(errno.ENODATA, os.strerror(errno.ENODATA), rel)
        try:
            return os.getxattr(fd, name)
        finally:
            os.close(fd)

    def listxattr(self, rel: bytes) -> list[bytes]:
        fd = self._xattr_fd(rel)
        if fd is None:
            return []
        try:
            return [os.fsencode(n) for n in os.listxattr(fd)]
        finally:
            os.close(fd)

    def xattr_presence(self, rel: bytes, names: list[bytes]) -> list[int]:
        """For each entry of directory `rel`: 0 when it has no extended attributes, 1 when
        it has some, -1 when that could not be told (ask again one by one).

        One descriptor of the directory (opened beneath the root like every other); each
        entry is named through /proc/self/fd/N/NAME with llistxattr, which follows the
        magic link to that directory and no symlink after it, so nothing outside the
        directory is read whatever the entry has become since the listing.
        """
        fd = self.open(rel, DIR_READ)
        out = []
        try:
            for name in names:
                if not name or b"/" in name or name in (b".", b".."):
                    out.append(-1)
                    continue
                try:
                    out.append(
                        1
                        if os.listxattr(b"/proc/self/fd/%d/%s" % (fd, name), follow_symlinks=False)
                        else 0
                    )
                except OSError:
                    out.append(-1)
        finally:
            os.close(fd)
        return out

    def _xattr_fd(self, rel: bytes) -> int | None:
        """A read descriptor of a regular file or directory, None for anything else.

        Extended attributes are read through a descriptor, so they are the opened file's
        own. Only regular files and directories are opened: opening a device can have side
        effects, and a symlink cannot be opened without following it, so those (and FIFOs
        and sockets) report no attributes.
        """
        if not rel:
            return self.open(b"", DIR_READ)
        st = self.lstat(rel)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            return None
        fd = self.open(rel, FILE_READ)
        check = os.fstat(fd)
        if (check.st_dev, check.st_ino) != (st.st_dev, st.st_ino):
            os.close(fd)  # swapped between the lstat and the open: say nothing about it
            return None
        return fd

    # --- data -------------------------------------------------------------------------

    def open_regular(self, rel: bytes) -> tuple[int, os.stat_result]:
        """A blocking read descriptor of a regular file, and its fstat."""
        fd = self.open(rel, FILE_READ)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EISDIR, "not a regular file", rel)
            fcntl.fcntl(fd, fcntl.F_SETFL, 0)  # clears O_NONBLOCK: it was for the open only
        except BaseException:
            os.close(fd)
            raise
        return fd, st


def open_cached_at(dir_fd: int, rel: bytes, flags: int) -> int:
    """A descriptor of `rel` beneath `dir_fd` that no disk or server was asked for: openat2
    with the resolver's no-symlink, no-escape flags plus RESOLVE_NO_XDEV (no other mount) and
    RESOLVE_CACHED (EAGAIN, a BlockingIOError, when a component is not in the dentry cache;
    EINVAL before Linux 5.12, ENOSYS without openat2), called without releasing the GIL:
    for the event loop, where handing the GIL to a worker thread and taking it back would
    cost more than the call (source/inline.py, the SSD tier's warm reads)."""
    if _syscall_held is None:
        raise OSError(errno.ENOSYS, "no syscall()", rel)
    if b"\0" in rel:  # ctypes would cut the path there
        raise OSError(errno.EINVAL, "embedded NUL in path", rel)
    how = _HOW_CACHED.get(flags)
    if how is None:
        st = _OpenHow(flags, 0, _RESOLVE_NOWAIT)
        how = _HOW_CACHED[flags] = (st, ctypes.addressof(st))
    fd = _syscall_held(_SYS_OPENAT2, dir_fd, rel or b".", how[1], ctypes.sizeof(_OpenHow))
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), rel)
    return fd


def version(st: os.stat_result) -> tuple[int, int, int]:
    """What tells two versions of a file apart: ctime moves with every write, also one that
    puts size and mtime back."""
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _lstat_at(name: bytes, dir_fd: int) -> os.stat_result:
    return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)


def _lstat_with_parent(name: bytes, dir_fd: int) -> tuple[os.stat_result, os.stat_result]:
    return os.fstat(dir_fd), os.stat(name, dir_fd=dir_fd, follow_symlinks=False)


def _readlink_at(name: bytes, dir_fd: int) -> bytes:
    return os.readlink(name, dir_fd=dir_fd)
