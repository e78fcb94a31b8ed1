"""Kernel hits (`--kernel-hits`, FUSE no-open mode) through a real mount.

The kernel opens files itself and serves the pages it holds; the daemon sees a READ only
for pages the kernel lacks, named by the inode (the project's patched pyfuse3). These tests
check what that mode promises: warm reads never reach the daemon, a page the kernel lost is
a hit in the daemon's tiers, the control directory keeps working (a node per open), a
change in SRC is seen within --revalidate, and a stock pyfuse3 falls back to opens with one
log line.
"""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import make_tree, poll, require_fuse

pytestmark = pytest.mark.mount

FILES = {f"d{i % 4}/f{i:03d}.bin": os.urandom(5000 + 37 * i) for i in range(40)}


def _drop_pages(paths: list[Path]) -> None:
    """Make the kernel forget the pages it holds of `paths` (as memory pressure would)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_all(root: Path) -> dict[str, bytes]:
    return {rel: (root / rel).read_bytes() for rel in FILES}


def test_warm_reads_never_reach_the_daemon(tmp_path: Path, mounter) -> None:
    src = make_tree(tmp_path / "src", FILES)
    m = mounter(src, "--ram", "64M", "--kernel-hits", "on")
    assert _read_all(m.mnt) == FILES  # cold: every file read through the daemon once
    before = m.stats()
    assert before["no_open"] and before["requests"].get("open", 0) <= 1
    for _ in range(2):
        assert _read_all(m.mnt) == FILES
    after = m.stats()
    # The kernel answered the opens and the reads: not one READ (but `before`'s own read of
    # stats.json), no hit and no miss more.
    assert after["requests"].get("read", 0) == before["requests"].get("read", 0) + 1
    assert after["requests"].get("open", 0) == before["requests"].get("open", 0)
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])
    assert (
        after["bytes_from_source"] == before["bytes_from_source"] == sum(map(len, FILES.values()))
    )


def test_pages_the_kernel_lost_are_hits_not_fetches(tmp_path: Path, mounter) -> None:
    src = make_tree(tmp_path / "src", FILES)
    m = mounter(src, "--ram", "64M", "--kernel-hits", "on", "--no-prefetch")
    assert _read_all(m.mnt) == FILES
    before = m.stats()
    _drop_pages([m.mnt / rel for rel in FILES])
    assert _read_all(m.mnt) == FILES
    after = m.stats()
    assert after["hits"] - before["hits"] == len(FILES)  # one per file read from its start
    assert after["misses"] == before["misses"]
    assert after["bytes_from_source"] == before["bytes_from_source"]


def test_the_control_directory_opens_a_node_per_open(tmp_path: Path, mounter) -> None:
    src = make_tree(tmp_path / "src", FILES)
    m = mounter(src, "--ram", "64M", "--kernel-hits", "on")
    ctl = m.mnt / ".shadefs"
    first = (ctl / "stats").read_text()
    assert _read_all(m.mnt) == FILES
    second = (ctl / "stats").read_text()
    assert "opens         0 " in first and "misses 40" in second  # rendered at each open
    assert "kernel hits on" in second
    m.ctl("ram 32M\n")
    assert m.stats()["ram_capacity"] == 32 << 20
    assert "# last write: ok: ram 32M" in (ctl / "ctl").read_text()
    fd = os.open(ctl / "ctl", os.O_WRONLY)
    try:
        with pytest.raises(OSError) as exc:
            os.write(fd, b"ram lots\n")
        assert exc.value.errno == 22  # EINVAL on the write, as with opens
    finally:
        os.close(fd)
    assert "error:" in (ctl / "ctl").read_text().splitlines()[-1]
    assert ".shadefs" not in os.listdir(m.mnt)


def test_a_source_change_is_seen_within_revalidate(tmp_path: Path, mounter) -> None:
    src = make_tree(tmp_path / "src", {"a.bin": b"old" * 1000})
    m = mounter(src, "--ram", "64M", "--kernel-hits", "on", "--revalidate", "1")
    assert (m.mnt / "a.bin").read_bytes() == b"old" * 1000
    (src / "tmp").write_bytes(b"new!" * 2000)
    os.replace(src / "tmp", src / "a.bin")
    time.sleep(1.3)  # (the kernel's entry timeout is --revalidate: a real clock's)
    assert (m.mnt / "a.bin").read_bytes() == b"new!" * 2000
    assert (m.mnt / "a.bin").stat().st_size == 8000


def test_a_data_file_is_never_written(tmp_path: Path, mounter) -> None:
    src = make_tree(tmp_path / "src", {"a.bin": b"x" * 100})
    m = mounter(src, "--ram", "64M", "--kernel-hits", "on")
    fd = os.open(m.mnt / "a.bin", os.O_WRONLY | os.O_APPEND)  # the kernel opens it itself
    try:
        with pytest.raises(OSError) as exc:
            os.write(fd, b"more")
        assert exc.value.errno == 30  # EROFS
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    assert (src / "a.bin").read_bytes() == b"x" * 100
    assert (m.mnt / "a.bin").read_bytes() == b"x" * 100


# A stock pyfuse3 3.5 has no NO_OPEN_FH_IS_INODE: the daemon run with the mark removed.
_STOCK = """
import runpy, sys, pyfuse3
del pyfuse3.NO_OPEN_FH_IS_INODE
sys.argv = ["shadefs", *sys.argv[1:]]
runpy.run_module("shadefs", run_name="__main__", alter_sys=True)
"""


def test_a_stock_pyfuse3_serves_with_opens_and_says_so_once(tmp_path: Path) -> None:
    require_fuse()
    import pyfuse3

    if not getattr(pyfuse3, "NO_OPEN_FH_IS_INODE", False):
        pytest.fail("the test environment lacks the patched pyfuse3 (make pyfuse3)")
    src = make_tree(tmp_path / "src", FILES)
    mnt, log = tmp_path / "mnt", tmp_path / "daemon.log"
    mnt.mkdir()
    cmd = [sys.executable, "-c", _STOCK, "mount", str(src), str(mnt), "-f", "--log", str(log)]
    proc = subprocess.Popen([*cmd, "--kernel-hits", "on"])
    try:
        poll(lambda: os.path.ismount(mnt), log.read_text, alive=proc)
        for _ in range(2):
            assert _read_all(mnt) == FILES
        stats = (mnt / ".shadefs" / "stats.json").read_text()
        assert '"no_open": false' in stats
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
        proc.wait(30)
    lines = [ln for ln in log.read_text().splitlines() if "kernel hits" in ln]
    assert len(lines) == 1 and "WARNING" in lines[0] and "kernel hits are off" in lines[0]


def test_a_file_renamed_over_before_its_first_read_is_never_served(tmp_path: Path, mounter) -> None:
    """The kernel opens the node it looked up; the daemon meets the file at the first read,
    and a file renamed over it since is another file: ESTALE, for whole files and blocks."""
    rng = random.Random(7)
    small, big = rng.randbytes(50_000), rng.randbytes(200_000)  # (RAM entries up to 64K)
    files = {"w.bin": small, "n1": small[::-1], "b.bin": big, "n2": big[::-1]}
    src = make_tree(tmp_path / "src", files)
    m = mounter(src, "--ram", "4M", "--max-entry", "64K", "--block-size", "32K",
                "--no-prefetch", "--no-speculate", "--kernel-hits", "on")  # fmt: skip
    for name, other in (("w.bin", "n1"), ("b.bin", "n2")):
        with open(m.mnt / name, "rb") as f:
            os.rename(src / other, src / name)
            with pytest.raises(OSError) as exc:
                f.read()
            assert exc.value.errno == errno.ESTALE
        assert (m.mnt / name).read_bytes() == files[other]  # the next open: the new node


def test_a_file_read_in_several_reads_is_fetched_once(tmp_path: Path, mounter) -> None:
    """The kernel reads a large file in several READs, some at once, each naming only the
    inode: the daemon keeps the handle the first one opened while they last, so the file is
    fetched once, and no handle outlives the reads."""
    data = random.Random(3).randbytes(4 << 20)  # (a READ carries at most 1 MiB)
    src = make_tree(tmp_path / "src", {"big.bin": data})
    m = mounter(src, "--ram", "64M", "--max-entry", "8M", "--kernel-hits", "on")
    before = m.stats()
    assert (m.mnt / "big.bin").read_bytes() == data
    after = m.stats()
    assert after["requests"].get("read", 0) - before["requests"].get("read", 0) - 1 > 1
    assert after["source_fetches"] - before["source_fetches"] == 1
    assert after["bytes_from_source"] - before["bytes_from_source"] == len(data)
    assert after["handles"]["open"] == 0
