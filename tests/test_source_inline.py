"""Small files the source has cached are read on the event loop, and nothing else is.

`InlineReads` (shadefs/source/inline.py) must give exactly what a worker thread's fetch
gives, one version of one regular file beneath the root, or leave the file to that fetch:
a symlink, an escape, a FIFO, a large or grown file and pages that are not in memory all
go to the thread, whose answers the other tests check.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pyfuse3
import pytest

from shadefs.source import inline as source_inline
from shadefs.source.inline import LOCAL, MAX_INLINE, InlineReads, fstype_of
from shadefs.source.part import Source

SMALL = os.urandom(4096)


def _local(path: Path) -> bool:
    return fstype_of(os.stat(path).st_dev) in LOCAL


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """src/a/small.bin and src/a/big.bin, beside a secret directory outside src."""
    if not _local(tmp_path):  # e.g. tmpfs (no RWF_NOWAIT reads): everything goes to threads
        pytest.skip(f"{tmp_path} is on {fstype_of(os.stat(tmp_path).st_dev)}, not {LOCAL}")
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "s.bin").write_bytes(b"SECRET" * 100)
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "small.bin").write_bytes(SMALL)
    (tmp_path / "src" / "a" / "big.bin").write_bytes(os.urandom(MAX_INLINE + 1))
    return tmp_path / "src"


def _no_threads(s: Source) -> None:
    async def run(*args: Any) -> Any:
        raise AssertionError(f"a worker thread was asked for {args}")

    s.run = run  # type: ignore[method-assign]


async def test_a_cached_small_file_is_read_without_a_thread(src: Path) -> None:
    s = Source(os.fsencode(src))
    assert s.inline.enabled
    _no_threads(s)
    data, st = await s.read_file(b"a/small.bin", len(SMALL))
    assert data == SMALL and type(data) is bytes
    assert (st.st_ino, st.st_size) == ((src / "a" / "small.bin").stat().st_ino, len(SMALL))
    got = [s.read_now(b"a/small.bin") for _ in range(3)]  # (a prefetch batch's first try)
    assert got == [(SMALL, got[0][1])] * 3  # type: ignore[index]
    assert s.inline.reads == 4 and s.inline.passed == 0
    assert s.bytes_read == 4 * len(SMALL) and s.describe().inline_reads == 4


async def test_what_it_cannot_answer_goes_to_the_thread(src: Path) -> None:
    (src / "out").symlink_to(src.parent / "secret" / "s.bin")
    (src / "dirlink").symlink_to(src.parent / "secret")
    os.mkfifo(src / "fifo")
    s = Source(os.fsencode(src))
    refused = {
        b"out": errno.ELOOP,
        b"dirlink/s.bin": errno.ELOOP,
        b"../secret/s.bin": errno.EXDEV,
        b"fifo": errno.EISDIR,
        b"nothing": errno.ENOENT,
    }
    for rel, code in refused.items():
        with pytest.raises(pyfuse3.FUSEError) as e:
            await s.read_file(rel)
        assert e.value.errno == code, rel
    # Larger than MAX_INLINE, or larger than the size looked up: the thread's bounded fetch.
    big, _ = await s.read_file(b"a/big.bin")
    assert big == (src / "a" / "big.bin").read_bytes()
    grown, st = await s.read_file(b"a/small.bin", 1000)
    assert grown == SMALL and st.st_size == len(SMALL)
    assert s.inline.reads == 0 and s.inline.passed == len(refused) + 2
    assert s.inline.enabled  # answers about files, not about the kernel
    assert s.bytes_read == len(big) + len(grown)  # never a byte of the secret


async def test_pages_not_in_memory_are_left_to_the_thread(
    src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Source(os.fsencode(src))
    real = os.preadv

    def preadv(fd: int, bufs: list[bytearray], off: int, flags: int = 0) -> int:
        assert flags & os.RWF_NOWAIT  # never a read that would wait for the disk
        raise BlockingIOError(errno.EAGAIN, "not cached")  # what the kernel says then

    monkeypatch.setattr(source_inline.os, "preadv", preadv)
    assert (await s.read_file(b"a/small.bin"))[0] == SMALL  # from the thread
    assert (s.inline.reads, s.inline.passed) == (0, 1)
    # Part of the file: fewer bytes than the fstat's size is never taken for the file.
    monkeypatch.setattr(source_inline.os, "preadv", lambda fd, bufs, off, flags: 100)
    assert (await s.read_file(b"a/small.bin"))[0] == SMALL
    assert (s.inline.reads, s.inline.passed) == (0, 2)
    monkeypatch.setattr(source_inline.os, "preadv", real)
    assert (await s.read_file(b"a/small.bin"))[0] == SMALL  # on the loop
    assert (s.inline.reads, s.inline.passed) == (1, 2)
    assert s.inline.enabled


async def test_a_filesystem_without_nowait_reads_switches_it_off(
    src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Source(os.fsencode(src))

    def preadv(fd: int, bufs: list[bytearray], off: int, flags: int = 0) -> int:
        raise OSError(errno.EOPNOTSUPP, "no RWF_NOWAIT")

    monkeypatch.setattr(source_inline.os, "preadv", preadv)
    assert (await s.read_file(b"a/small.bin"))[0] == SMALL
    assert not s.inline.enabled


async def test_a_version_that_changes_during_the_read_is_left_to_the_thread(
    src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Source(os.fsencode(src))
    real = os.fstat
    calls = []

    def fstat(fd: int) -> os.stat_result:
        st = real(fd)
        calls.append(fd)
        if len(calls) == 2:  # the inline read's second fstat: another version
            return os.stat_result((*st[:6], st.st_size + 1, *st[7:]))
        return st

    monkeypatch.setattr(source_inline.os, "fstat", fstat)
    data, st = await s.read_file(b"a/small.bin")
    assert data == SMALL and st.st_size == len(SMALL)  # the thread's fetch
    assert (s.inline.reads, s.inline.passed) == (0, 1)


def test_only_local_filesystems_are_read_on_the_loop(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
        "80 27 0:52 / /mnt/nfs rw,relatime shared:1 - nfs4 server:/data rw,vers=4.2\n"
        "81 27 0:53 / /mnt/src rw - fuse.slowfs slowfs rw\n"
    )
    assert fstype_of(os.makedev(254, 0), str(info)) == "ext4"
    assert fstype_of(os.makedev(0, 52), str(info)) == "nfs4"
    assert fstype_of(os.makedev(0, 53), str(info)) == "fuse.slowfs"
    assert fstype_of(os.makedev(9, 9), str(info)) is None
    assert not LOCAL & {"nfs", "nfs4", "fuse", "fuse.slowfs", "tmpfs", "cifs", "overlay"}


def test_it_can_be_switched_off(src: Path) -> None:
    s = Source(os.fsencode(src), inline=False)
    assert not s.inline.enabled
    walk = Source(os.fsencode(src), use_openat2=False)  # no openat2: no cached-only open
    assert not walk.inline.enabled
    assert isinstance(walk.inline, InlineReads)


def test_noatime_is_dropped_only_where_the_kernel_refuses_it(
    src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """O_NOATIME is the file owner's or CAP_FOWNER's (EPERM for others): then files are
    opened without it; an unreadable file (EACCES) keeps it for the others."""
    s = Source(os.fsencode(src))
    real = s.paths.open_cached
    refused = {"code": errno.EACCES}

    def open_cached(rel: bytes, flags: int) -> int:
        if flags & os.O_NOATIME:
            raise PermissionError(refused["code"], os.strerror(refused["code"]))
        return real(rel, flags)

    monkeypatch.setattr(s.paths, "open_cached", open_cached)
    assert s.inline.read(s.paths, b"a/small.bin", None) is None  # EACCES: left to the thread
    assert s.inline.flags & os.O_NOATIME
    refused["code"] = errno.EPERM
    got = s.inline.read(s.paths, b"a/small.bin", None)
    assert got is not None and got[0] == SMALL
    assert not s.inline.flags & os.O_NOATIME
