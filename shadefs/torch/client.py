"""The one client of a mount's control directory, ``MNT/.shadefs``.

Everything outside the daemon that talks to a mount goes through ``ControlClient``: the
sampler's binary channel (``dataset``, ``losses``, ``order``), ``shadefs warmup --check``
(``residency``), ``shadefs stat`` (``stats``, ``stats.json``) and ``shadefs ctl`` (``ctl``).
The protocol itself is in ``docs/control-protocol.md``.

It imports neither torch nor anything of the daemon, so the command line uses it without
torch installed (``shadefs.torch`` loads the sampler lazily for that reason).

Errors: every failure is a ``ControlError``, which is at once a ``QuietError`` (the command
line prints its one line and exits with its ``exitcode``: 7 when MNT is not a live shadefs
mount, 8 when the daemon rejected a write) and a ``RuntimeError`` (what the sampler has
always raised). A rejected write is a ``RejectedError`` carrying the daemon's account of it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from shadefs.common import CONTROL_NAME, EXIT_NOT_SHADEFS, EXIT_REJECTED, QuietError

log = logging.getLogger(__name__)

CONTROL_DIR = CONTROL_NAME
# The residency file takes whole lines, at most this many bytes per write().
MAX_RESIDENCY_WRITE = 64 << 10
_CHUNK = 1 << 20
_LAST_WRITE = "# last write: "
# What a control file that does not exist says about the daemon (an older one lacks it).
_FEATURE = {
    "dataset": "sampler channel",
    "losses": "sampler channel",
    "order": "sampler channel",
    "residency": "residency file (warmup --check)",
}


class ControlError(QuietError, RuntimeError):
    """A control file could not be used: not a mount, daemon gone, file missing, I/O error."""

    def __init__(self, msg: str, exitcode: int = EXIT_NOT_SHADEFS) -> None:
        super().__init__(msg, exitcode)


class RejectedError(ControlError):
    """The daemon refused a write with EINVAL; ``result`` is its account (``error: ...``)."""

    def __init__(self, path: str, result: str) -> None:
        super().__init__(f"shadefs rejected a write to {path}: {result}", EXIT_REJECTED)
        self.path = path
        self.result = result


class ResidencyChannel(Protocol):
    """One open descriptor of ``residency`` (or a stand-in for tests)."""

    def write(self, data: bytes) -> int: ...

    def read_all(self) -> bytes: ...


class ControlClient:
    """The control files of the shadefs mount at ``mountpoint``.

    Constructing one does no I/O; each call opens the file it needs and closes it again.
    """

    def __init__(self, mountpoint: str | os.PathLike[str]) -> None:
        self.mountpoint = os.path.abspath(os.fspath(mountpoint))
        self.dir = os.path.join(self.mountpoint, CONTROL_DIR)

    # -- text files --------------------------------------------------------------------------

    def check(self) -> Path:
        """The control directory, or ControlError (exit code 7) saying why it is not one."""
        mnt = self.mountpoint
        try:
            st = os.stat(self.dir)
        except (FileNotFoundError, NotADirectoryError):
            raise ControlError(f"{mnt} is not a shadefs mount") from None
        except OSError as exc:
            raise self._error(mnt, exc) from None
        if not stat.S_ISDIR(st.st_mode):
            raise ControlError(f"{mnt} is not a shadefs mount")
        return Path(self.dir)

    def read(self, name: str) -> bytes:
        """The whole content of one control file (they read as size 0: read to EOF)."""
        path = os.path.join(self.dir, name)
        fd = self._open(name, os.O_RDONLY)
        try:
            return self._read_to_end(fd, path)
        finally:
            os.close(fd)

    def text(self, name: str) -> str:
        """``read(name)`` decoded (``stats``, ``stats.json``, ``ctl``, ``metrics``)."""
        return self.read(name).decode(errors="replace")

    def stats(self) -> dict[str, Any]:
        """``stats.json`` as a dict."""
        try:
            stats = json.loads(self.read("stats.json"))
        except ValueError:
            raise ControlError(f"{self.mountpoint}: stats.json is not JSON") from None
        if not isinstance(stats, dict):
            raise ControlError(f"{self.mountpoint}: stats.json is not an object")
        return stats

    def ctl(self, lines: str | Iterable[str]) -> str:
        """Send ``ctl`` commands in one write (all are applied or none); the daemon's result.

        RejectedError (exit code 8) when the daemon refused them.
        """
        text = lines if isinstance(lines, str) else "\n".join(lines)
        data = (text if text.endswith("\n") else text + "\n").encode()
        path = os.path.join(self.dir, "ctl")
        fd = self._open("ctl", os.O_WRONLY)
        try:
            # One write() is one transaction for the daemon: never split it into several.
            try:
                done = os.write(fd, data)
            except OSError as exc:
                raise self._error(path, exc) from None
        finally:
            os.close(fd)
        if done != len(data):
            raise ControlError(f"{path}: only {done} of {len(data)} bytes were taken")
        return self.last_result()

    def last_result(self) -> str:
        """The daemon's account of the last ``ctl`` write (``ok: ...`` or ``error: ...``)."""
        for line in self.text("ctl").splitlines():
            if line.startswith(_LAST_WRITE):
                return line[len(_LAST_WRITE) :]
        return "unknown"

    # -- residency ---------------------------------------------------------------------------

    def residency(self, rel_paths: Iterable[bytes]) -> list[str]:
        """Where each path (relative to the mount root) is: ``ram``, ``ssd``, ``none`` or
        ``missing``, in order. Reads nothing through the mount."""
        path = os.path.join(self.dir, "residency")
        fd = self._open("residency", os.O_RDWR)
        try:
            return query_residency(_FdChannel(self, fd, path), rel_paths)
        finally:
            os.close(fd)

    # -- the sampler's binary channel ----------------------------------------------------------

    def register(self, message: bytes) -> None:
        """Write an SHDS message (the dataset's file list) to ``dataset``."""
        self._write_message("dataset", message)

    def send_losses(self, message: bytes) -> None:
        """Write an SHDL message (per-sample losses) to ``losses``."""
        self._write_message("losses", message)

    def order(self, request: bytes) -> bytes:
        """Write an SHDQ order request and read the SHDR response on the same descriptor."""
        path = os.path.join(self.dir, "order")
        fd = self._open("order", os.O_RDWR)
        try:
            self._write_all(fd, path, request)
            # The response is served from offset 0 and the write moved the file offset past
            # the request, so rewind before reading (reading on would skip its first bytes).
            os.lseek(fd, 0, os.SEEK_SET)
            return self._read_to_end(fd, path)
        finally:
            os.close(fd)

    # -- helpers -------------------------------------------------------------------------------

    def _write_message(self, name: str, data: bytes) -> None:
        path = os.path.join(self.dir, name)
        fd = self._open(name, os.O_WRONLY)
        try:
            self._write_all(fd, path, data)
        finally:
            os.close(fd)

    def _open(self, name: str, flags: int) -> int:
        path = os.path.join(self.dir, name)
        try:
            return os.open(path, flags | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:
                self.check()  # not a mount at all: say that rather than name the file
            if isinstance(exc, FileNotFoundError):
                what = _FEATURE.get(name, "such control file")
                raise ControlError(
                    f"{path} does not exist: this shadefs daemon has no {what} (upgrade shadefs)"
                ) from None
            raise self._error(path, exc) from None

    def _write_all(self, fd: int, path: str, data: bytes) -> None:
        # A binary stream may arrive in several writes (the daemon buffers it), and the
        # kernel may split a large write and return short: loop.
        view = memoryview(data)
        while view:
            try:
                done = os.write(fd, view)
            except OSError as exc:
                raise self._error(path, exc) from None
            view = view[done:]

    def _read_to_end(self, fd: int, path: str) -> bytes:
        chunks: list[bytes] = []
        while True:
            try:
                chunk = os.read(fd, _CHUNK)
            except OSError as exc:
                raise self._error(path, exc) from None
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)

    def _error(self, path: str, exc: OSError) -> ControlError:
        mnt = self.mountpoint
        if exc.errno == errno.ENOTCONN:
            return ControlError(f"the shadefs daemon of {mnt} is gone: run `shadefs umount {mnt}`")
        if exc.errno == errno.EINVAL:
            return RejectedError(path, self._explain())
        return ControlError(f"{path}: {exc.strerror or exc}")

    def _explain(self) -> str:
        """last_result() for an error message, which must not fail in turn."""
        try:
            return self.last_result()
        except ControlError as exc:
            return f"(no reason given: {exc})"


class _FdChannel:
    """The residency file opened read-write: write the queries, then read the answers."""

    def __init__(self, client: ControlClient, fd: int, path: str) -> None:
        self.client, self.fd, self.path = client, fd, path

    def write(self, data: bytes) -> int:
        try:
            return os.write(self.fd, data)
        except OSError as exc:
            raise self.client._error(self.path, exc) from None

    def read_all(self) -> bytes:
        # pread from offset 0: the writes moved the descriptor's offset past the answers.
        parts = []
        off = 0
        try:
            while chunk := os.pread(self.fd, _CHUNK, off):
                parts.append(chunk)
                off += len(chunk)
        except OSError as exc:
            raise self.client._error(self.path, exc) from None
        return b"".join(parts)


def query_residency(channel: ResidencyChannel, rel_paths: Iterable[bytes]) -> list[str]:
    """The residency protocol over ``channel``: one status per path, in order.

    Writes whole newline-terminated lines, at most MAX_RESIDENCY_WRITE bytes per write(),
    then reads the accumulated answers. ValueError for a path the protocol cannot carry.
    """
    sent = 0
    batch: list[bytes] = []
    size = 0
    for rel in rel_paths:
        if b"\n" in rel:
            raise ValueError(f"a path with a newline cannot be asked about: {rel[:80]!r}")
        line = rel + b"\n"
        if len(line) > MAX_RESIDENCY_WRITE:
            raise ValueError(f"path too long for the residency file: {rel[:80]!r}...")
        if size + len(line) > MAX_RESIDENCY_WRITE:
            _send(channel, b"".join(batch))
            batch, size = [], 0
        batch.append(line)
        size += len(line)
        sent += 1
    if batch:
        _send(channel, b"".join(batch))
    answers = channel.read_all().decode("utf-8", "replace").splitlines()
    if len(answers) != sent:
        raise ControlError(f"the daemon answered {len(answers)} residency lines for {sent} paths")
    return answers


def _send(channel: ResidencyChannel, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[channel.write(bytes(view)) :]


def find_mount(path: str | os.PathLike[str]) -> str | None:
    """The shadefs mount root above ``path`` (the first directory with ``.shadefs/ctl``)."""
    d = os.path.abspath(os.fspath(path))
    if not os.path.isdir(d):
        d = os.path.dirname(d)
    while True:
        # The control directory is hidden from listings but found by lookup.
        if os.path.exists(os.path.join(d, CONTROL_DIR, "ctl")):
            return d
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def read_stats(mountpoint: str | os.PathLike[str]) -> dict[str, Any]:
    """``ControlClient(mountpoint).stats()``: stats.json of a mount, or ControlError."""
    return ControlClient(mountpoint).stats()
