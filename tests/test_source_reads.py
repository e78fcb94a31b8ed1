"""A random reader's large source reads travel in pieces at once (shadefs/source/reads.py).

The mounted tests read over the slow-remote emulator, which counts how many reads wait
there at once (`reads_in_flight_max`) and how many bytes it sent: a large read of a
descriptor fadvised random must keep several requests in flight, and fetch exactly the
range asked for.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from shadefs.cache.extents import pread_stat
from shadefs.source import reads as source_reads
from shadefs.source.part import Source
from shadefs.source.reads import DEFAULT_PIECE, advise, readahead_bytes, spread
from tests.conftest import require_fuse

MiB = 1 << 20


def _fadvised(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(
        source_reads.os, "posix_fadvise", lambda fd, off, n, advice: calls.append((off, n, advice))
    )
    return calls


def test_a_large_read_is_announced_piece_by_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fadvised(monkeypatch)
    spread(3, 300 << 10, 4096, 128 << 10)
    assert calls == [
        (4096, 128 << 10, os.POSIX_FADV_WILLNEED),
        (4096 + (128 << 10), 128 << 10, os.POSIX_FADV_WILLNEED),
        (4096 + (256 << 10), 44 << 10, os.POSIX_FADV_WILLNEED),  # not past the range
    ]


def test_a_read_within_one_piece_or_without_pieces_is_not_announced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _fadvised(monkeypatch)
    spread(3, 128 << 10, 0, 128 << 10)  # one request anyway
    spread(3, MiB, 0, 0)  # a sequential reader's: the source's own read-ahead serves it
    assert calls == []


def test_failed_advice_still_reads(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(bytes(range(256)) * 4096)
    fd = os.open(f, os.O_RDONLY)
    try:
        assert source_reads.pread_spread(fd, 5000, 300, 1024) == f.read_bytes()[300:5300]
        data, st = pread_stat(fd, 5000, 300, True, 1024)
        assert data == f.read_bytes()[300:5300] and st is not None
    finally:
        os.close(fd)
    r, w = os.pipe()  # fadvise on a pipe fails (ESPIPE): spread swallows it
    try:
        spread(r, 4096, 0, 1024)
    finally:
        os.close(r)
        os.close(w)


def test_the_piece_is_the_devices_read_ahead(tmp_path: Path) -> None:
    assert readahead_bytes(os.makedev(4095, 1 << 19)) == DEFAULT_PIECE  # no such bdi
    dev = os.stat(tmp_path).st_dev
    path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    if os.path.exists(path):
        with open(path) as f:
            assert readahead_bytes(dev) == int(f.read()) << 10


# --- over the slow-remote emulator -------------------------------------------------------


@pytest.fixture
def remote(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A 4 MiB file behind slowfs: 30 ms per read, no bandwidth cap (so that only the
    requests' overlap decides how long a read takes, and none is merged by a queue)."""
    require_fuse()
    real = tmp_path / "real"
    real.mkdir()
    (real / "f.bin").write_bytes(os.urandom(4 * MiB))
    mnt = tmp_path / "remote"
    mnt.mkdir()
    cmd = [sys.executable, "-m", "shadefs.demo.slowfs", str(real), str(mnt), "--daemon"]
    subprocess.run(
        [*cmd, "--read-latency", "30", "--bandwidth", "0", "--no-direct-io"],
        check=True,
        timeout=60,
    )
    try:
        yield real, mnt
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)


def _slow_stats(mnt: Path) -> dict[str, int]:
    stats: dict[str, int] = json.loads(os.getxattr(mnt, "user.slowfs.stats"))
    return stats


@pytest.mark.mount
def test_a_random_readers_large_read_keeps_several_requests_in_flight(
    remote: tuple[Path, Path],
) -> None:
    real, mnt = remote

    async def main() -> bytes:
        source = Source(mnt)
        assert source.piece > 0
        fd = await source.open_fd(b"f.bin")
        try:
            advise(fd, True)  # as the FUSE read path marks a random reader's descriptor
            return await source.pread(fd, 4 * source.piece, MiB, random=True)
        finally:
            await source.close_fd(fd)

    before = _slow_stats(mnt)
    data = trio.run(main)
    after = _slow_stats(mnt)
    piece = Source(mnt).piece
    assert data == (real / "f.bin").read_bytes()[MiB : MiB + 4 * piece]
    assert after["reads_in_flight_max"] >= 2
    assert after["bytes"] - before["bytes"] == 4 * piece  # the range asked, not a byte more


@pytest.mark.mount
def test_a_read_through_files_random_reader_reaches_the_remote_in_pieces_at_once(
    remote: tuple[Path, Path], mounter
) -> None:
    """lmdb's case: a file read through (above --passthrough-above), and its mmap faults
    arrive at random offsets, 1 MiB each (read_ahead_kb). O_DIRECT sends the daemon the
    reads as they are asked, whatever this kernel's read-ahead of the mount is."""
    real, mnt = remote
    m = mounter(mnt, "--ram", "1M", "--passthrough-above", "2M")  # 4 MiB: read through
    want = (real / "f.bin").read_bytes()
    buf = mmap.mmap(-1, MiB)  # page-aligned, as O_DIRECT wants
    fd = os.open(m.mnt / "f.bin", os.O_RDONLY | os.O_DIRECT)
    try:
        before = _slow_stats(mnt)
        for off, n in ((3 * MiB, 4096), (8192, 4096), (MiB, MiB)):  # random: jumps
            assert os.preadv(fd, [memoryview(buf)[:n]], off) == n
            assert buf[:n] == want[off : off + n]
    finally:
        os.close(fd)
        buf.close()
    after = _slow_stats(mnt)
    assert m.stats()["passthrough_opens"] == 1
    assert after["reads_in_flight_max"] >= 2
    assert after["bytes"] - before["bytes"] == MiB + 2 * 4096  # what was read, no more
