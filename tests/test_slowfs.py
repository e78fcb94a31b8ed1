"""Tests for ``shadefs.demo.slowfs``, the slow-remote emulator of the demo and the benchmarks.

Most tests mount it for real. Elapsed times are only checked as lower bounds that follow
from the emulated sleeps (N opens at 20 ms cannot take less than N * 20 ms), never as
speed targets.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

from shadefs.demo import slowfs
from shadefs.demo.slowfs_ops import Link
from tests.conftest import poll

# How the demo, the benchmarks and the README start it.
SLOWFS = [sys.executable, "-m", "shadefs.demo.slowfs"]
# A safety net for hung mounts only: no test asserts against it.
DEADLINE = 30.0


def _require_fuse() -> None:
    missing = []
    if not os.path.exists("/dev/fuse"):
        missing.append("/dev/fuse")
    if shutil.which("fusermount3") is None:
        missing.append("fusermount3")
    if missing:
        reason = "FUSE unavailable: missing " + ", ".join(missing)
        # CI must not go green by skipping every mount test.
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


def _wait_for(
    condition: Callable[[], object], what: str, proc: subprocess.Popen[bytes] | None = None
) -> None:
    poll(condition, what, DEADLINE, interval=0.02, alive=proc)


def _force_unmount(mnt: Path) -> None:
    if os.path.ismount(mnt):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)


@contextmanager
def mounted(src: Path, mnt: Path, *options: str) -> Iterator[subprocess.Popen[bytes]]:
    """Run slowfs in the foreground on *mnt* for the duration of the block."""
    _require_fuse()
    mnt.mkdir(exist_ok=True)
    proc = subprocess.Popen([*SLOWFS, str(src), str(mnt), *options])
    try:
        _wait_for(lambda: os.path.ismount(mnt), "the mount", proc)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(DEADLINE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        _force_unmount(mnt)


def stats(mnt: Path) -> dict[str, int]:
    return json.loads(os.getxattr(mnt, "user.slowfs.stats"))


def _make_files(root: Path, count: int, size: int) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        path = root / f"sample_{index:03d}.bin"
        path.write_bytes(os.urandom(size))
        paths.append(path)
    return paths


# -- without mounting ----------------------------------------------------------------


async def test_link_is_shared_by_concurrent_transfers(autojump_clock: object) -> None:
    link = Link(rate=1e6)
    finished: list[float] = []

    async def transfer() -> None:
        await link.transfer(1_000_000)
        finished.append(trio.current_time())

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(transfer)
    # Three 1 MB replies on one 1 MB/s link finish one after another, not together.
    assert [round(t - start, 6) for t in finished] == [1.0, 2.0, 3.0]


async def test_idle_link_banks_no_credit(autojump_clock: object) -> None:
    link = Link(rate=1e6)
    await trio.sleep(10)
    start = trio.current_time()
    await link.transfer(500_000)
    assert trio.current_time() - start == pytest.approx(0.5)


async def test_unlimited_link_does_not_wait(autojump_clock: object) -> None:
    link = Link(rate=0)
    start = trio.current_time()
    await link.transfer(10**9)
    assert trio.current_time() == start


@pytest.mark.parametrize(
    "options", [["--jitter", "1.5"], ["--open-latency", "-1"], ["--daemon", "-f"]]
)
def test_bad_options_are_rejected(tmp_path: Path, options: list[str]) -> None:
    with pytest.raises(SystemExit):
        slowfs.parse_args([str(tmp_path), str(tmp_path), *options])


# -- mounted -------------------------------------------------------------------------


@pytest.mark.mount
def test_mirrors_tree_read_only(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "train" / "n01440764").mkdir(parents=True)
    (src / "val").mkdir()
    (src / "empty").write_bytes(b"")
    (src / ".hidden").write_bytes(b"x")
    (src / "train" / "n01440764" / "a.JPEG").write_bytes(os.urandom(200_001))
    (src / "train" / "n01440764" / "b.JPEG").write_bytes(os.urandom(4096))
    (src / "val" / "caf\u00e9 label.txt").write_text("caf\u00e9\n")
    (src / "latest").symlink_to("train/n01440764/a.JPEG")
    mnt = tmp_path / "mnt"
    with mounted(src, mnt):
        result = subprocess.run(
            ["diff", "-r", "--no-dereference", str(src), str(mnt)],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert os.readlink(mnt / "latest") == "train/n01440764/a.JPEG"

        served = stats(mnt)
        assert served["opens"] >= 4
        assert served["bytes"] >= 200_001 + 4096 + 1 + len("caf\u00e9\n".encode())

        with pytest.raises(OSError) as exc_info:
            (mnt / "new").write_bytes(b"x")
        assert exc_info.value.errno == errno.EROFS
        with pytest.raises(OSError) as exc_info:
            open(mnt / "empty", "r+b").close()
        assert exc_info.value.errno == errno.EROFS
        with pytest.raises(OSError) as exc_info:
            (mnt / "newdir").mkdir()
        assert exc_info.value.errno == errno.EROFS
    assert not (src / "new").exists()


@pytest.mark.mount
def test_every_open_pays_the_open_latency(tmp_path: Path) -> None:
    count = 8
    files = _make_files(tmp_path / "src", count, 1000)
    mnt = tmp_path / "mnt"
    options = ["--open-latency", "20", "--meta-latency", "0", "--bandwidth", "0"]
    with mounted(tmp_path / "src", mnt, *options):
        before = stats(mnt)
        start = time.monotonic()
        for path in files:
            assert (mnt / path.name).read_bytes() == path.read_bytes()
        elapsed = time.monotonic() - start
        after = stats(mnt)
        # One reader, so the 20 ms sleeps cannot overlap.
        assert elapsed >= count * 0.020
        assert after["opens"] - before["opens"] == count
        assert after["bytes"] - before["bytes"] == count * 1000

        # The kernel must not cache data across opens: a second pass reaches slowfs.
        for path in files:
            (mnt / path.name).read_bytes()
        assert stats(mnt)["bytes"] - after["bytes"] == count * 1000


@pytest.mark.mount
def test_overlapping_requests_are_served_concurrently(tmp_path: Path) -> None:
    files = _make_files(tmp_path / "src", 4, 1000)
    mnt = tmp_path / "mnt"
    options = ["--open-latency", "1000", "--meta-latency", "0", "--bandwidth", "0"]
    with mounted(tmp_path / "src", mnt, *options):
        threads = [threading.Thread(target=(mnt / path.name).read_bytes) for path in files]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - start
        # Four opens of 1 s each: one at a time would take 4 s; overlapped, about 1 s.
        assert 1.0 <= elapsed < 3.0
        doc = stats(mnt)
        assert doc["opens"] == 4
        assert doc["cpu_share"] >= 0 and 0 <= doc["cpu_share_recent"] <= 1.5
        assert doc["cpu_seconds"] > 0


@pytest.mark.mount
def test_bandwidth_is_one_link_shared_by_all_readers(tmp_path: Path) -> None:
    src = tmp_path / "src"
    big = _make_files(src / "big", 1, 4 << 20)[0]
    parts = _make_files(src / "parts", 4, 1 << 20)
    mnt = tmp_path / "mnt"
    options = ["--bandwidth", "10", "--open-latency", "0", "--meta-latency", "0"]
    with mounted(src, mnt, *options):
        start = time.monotonic()
        assert (mnt / "big" / big.name).read_bytes() == big.read_bytes()
        # 4 MiB over 10 MB/s is 0.42 s.
        assert time.monotonic() - start >= 0.35

        # Four readers together still get 10 MB/s, not 10 MB/s each (which would take
        # about 0.1 s).
        contents: dict[str, bytes] = {}

        def read(path: Path) -> None:
            contents[path.name] = (mnt / "parts" / path.name).read_bytes()

        threads = [threading.Thread(target=read, args=(path,)) for path in parts]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert time.monotonic() - start >= 0.35
        assert contents == {path.name: path.read_bytes() for path in parts}
        assert stats(mnt)["bytes"] == 8 << 20


@pytest.mark.mount
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_unmounts_cleanly(tmp_path: Path, signum: int) -> None:
    _make_files(tmp_path / "src", 1, 10)
    mnt = tmp_path / "mnt"
    with mounted(tmp_path / "src", mnt) as proc:
        proc.send_signal(signum)
        assert proc.wait(DEADLINE) == 0
        assert not os.path.ismount(mnt)


@pytest.mark.mount
def test_external_unmount_ends_the_daemon(tmp_path: Path) -> None:
    _make_files(tmp_path / "src", 1, 10)
    mnt = tmp_path / "mnt"
    with mounted(tmp_path / "src", mnt) as proc:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=True)
        assert proc.wait(DEADLINE) == 0
        assert not os.path.ismount(mnt)


@pytest.mark.mount
def test_daemon_returns_once_mounted(tmp_path: Path) -> None:
    _require_fuse()
    src = tmp_path / "src"
    files = _make_files(src, 2, 100)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        # capture_output also proves that the daemon let go of our pipes; relative paths
        # must survive its change of directory.
        result = subprocess.run(
            [*SLOWFS, "src", "mnt", "--daemon"],
            capture_output=True,
            timeout=DEADLINE,
            cwd=tmp_path,
        )
        assert (result.returncode, result.stdout, result.stderr) == (0, b"", b"")
        assert os.path.ismount(mnt)
        assert (mnt / files[0].name).read_bytes() == files[0].read_bytes()
        pid = stats(mnt)["pid"]
        assert pid != os.getpid()
        os.kill(pid, signal.SIGTERM)
        _wait_for(lambda: not os.path.ismount(mnt), "the unmount")
    finally:
        _force_unmount(mnt)


def test_daemon_reports_mount_failure(tmp_path: Path) -> None:
    # Make pyfuse3.init fail inside the forked child: the parent waiting for "ready"
    # must exit non-zero, and the child's error must reach the caller's stderr.
    script = (
        "import runpy, sys, pyfuse3\n"
        "def fail(*args):\n"
        "    raise RuntimeError('mount refused')\n"
        "pyfuse3.init = fail\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_module('shadefs.demo.slowfs', run_name='__main__')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, "slowfs", str(tmp_path), str(tmp_path), "--daemon"],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert result.returncode == 1
    assert "mount refused" in result.stderr
