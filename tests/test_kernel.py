"""The kernel-side settings the daemon writes through sysfs (read-ahead, FUSE queue depth),
and the pages it hands the kernel with a small file's first open."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from shadefs.kernel import tuning
from shadefs.kernel.notify import PUSH_MAX
from tests.conftest import Mount, make_tree

# A device no bdi has: its read_ahead_kb write fails, which must not stop the others.
_NO_BDI = os.makedev(0, (1 << 20) - 1)


def test_the_connection_is_named_by_the_kernels_device_number() -> None:
    assert tuning.connection_id(os.makedev(0, 45)) == 45  # FUSE: an anonymous device
    assert tuning.connection_id(os.makedev(8, 1)) == (8 << 20) | 1


def test_tune_writes_the_queue_depth_of_the_mounts_connection(tmp_path: Path) -> None:
    conn = tmp_path / str(tuning.connection_id(_NO_BDI))
    conn.mkdir()
    other = tmp_path / "46"
    other.mkdir()
    for d in (conn, other):
        (d / "max_background").write_text("12\n")
        (d / "congestion_threshold").write_text("9\n")
    tuning.tune(_NO_BDI, fusectl=str(tmp_path))
    assert (conn / "max_background").read_text() == str(tuning.MAX_BACKGROUND)
    assert (conn / "congestion_threshold").read_text() == str(tuning.CONGESTION_THRESHOLD)
    assert (other / "max_background").read_text() == "12\n"  # another mount's: untouched


def test_tune_without_a_connection_directory_is_quiet(tmp_path: Path) -> None:
    (tmp_path / "something").mkdir()  # not empty: fusectl is not mounted over it
    tuning.tune(_NO_BDI, fusectl=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["something"]


@pytest.mark.mount
def test_a_mount_as_root_has_the_daemons_settings(tmp_path: Path, mounter) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root may write the mount's sysfs settings")
    m = mounter(make_tree(tmp_path / "src", {"f": b"x"}))
    dev = os.stat(m.mnt).st_dev
    conn = Path(tuning.FUSECTL) / str(tuning.connection_id(dev))
    if not conn.is_dir():
        pytest.skip("no fusectl here, and the daemon could not mount it (read-only /sys?)")
    assert int((conn / "max_background").read_text()) == tuning.MAX_BACKGROUND
    assert int((conn / "congestion_threshold").read_text()) == tuning.CONGESTION_THRESHOLD
    bdi = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    assert int(bdi.read_text()) == tuning.READ_AHEAD_KB


def _reads(m: Mount) -> int:
    return int(m.stats()["requests"].get("read", 0))


def test_a_small_files_first_open_brings_its_bytes_without_a_read(
    tmp_path: Path, mounter: Callable[..., Mount]
) -> None:
    """kernel/notify.py `push_pages`: the open of a small file the kernel holds no pages of
    stores them, so that reading it sends no READ; a large file is read as before."""
    small, most, big = os.urandom(5000), os.urandom(PUSH_MAX), os.urandom(PUSH_MAX + 5000)
    tree = {"s.bin": small, "t.bin": small[::-1], "m.bin": most, "b.bin": big}
    src = make_tree(tmp_path / "src", tree)
    m = mounter(src)
    r0 = _reads(m)
    stats_read = _reads(m) - r0  # what reading stats.json itself costs
    before = _reads(m)
    assert (m.mnt / "s.bin").read_bytes() == small
    assert _reads(m) - before == stats_read
    # Two handles of one file at once (the second open finds the kernel's pages).
    with open(m.mnt / "t.bin", "rb") as f1, open(m.mnt / "t.bin", "rb") as f2:
        assert f2.read() == small[::-1] and f1.read(100) == small[::-1][:100]
    assert _reads(m) - before == 2 * stats_read
    assert (m.mnt / "m.bin").read_bytes() == most  # as large as a push may be
    assert _reads(m) - before == 3 * stats_read
    assert (m.mnt / "b.bin").read_bytes() == big
    assert _reads(m) - before > 4 * stats_read  # the large file's READs
    assert m.stats()["bytes_served"] >= 2 * len(small) + len(most) + len(big)


def _drop_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_reopens_bring_their_bytes_again_once_the_kernel_drops_pages(
    tmp_path: Path, mounter: Callable[..., Mount]
) -> None:
    """A reopen (a hit) answers with the kernel's pages trusted; once two reopens close
    together had to be read (the kernel dropped pages in bulk: a page-cache drop between
    epochs), the reopens after them push their bytes with the open (kernel/pages.py
    `BulkDrops`). One file's pages dropped on their own push nothing."""
    files = {f"f{i}.bin": os.urandom(5000) for i in range(7)}
    big = os.urandom(PUSH_MAX + 5000)
    src = make_tree(tmp_path / "src", {**files, "big.bin": big})
    m = mounter(src)
    for name, data in files.items():  # first opens: pushed, no READ
        assert (m.mnt / name).read_bytes() == data
    assert (m.mnt / "big.bin").read_bytes() == big  # read, as any file past the push's size
    r0 = _reads(m)
    stats_read = _reads(m) - r0  # what reading stats.json itself costs
    first, *rest = files
    _drop_pages(m.mnt / first)
    before, served = _reads(m), m.stats()["bytes_served"]
    assert (m.mnt / first).read_bytes() == files[first]  # its READs, on its own
    for name in rest:  # reopens, the kernel's pages kept: no READ, no push
        assert (m.mnt / name).read_bytes() == files[name]
    assert _reads(m) - before > 2 * stats_read
    assert m.stats()["bytes_served"] - served < 2 * len(files[first])  # (stats.json's own)
    for name in files:
        _drop_pages(m.mnt / name)
    before = _reads(m)
    assert (m.mnt / first).read_bytes() == files[first]  # READs: the kernel had no pages
    assert _reads(m) - before > stats_read
    before = _reads(m)
    for name in rest:  # a second read close behind the first: pushed with their opens
        assert (m.mnt / name).read_bytes() == files[name]
    assert _reads(m) - before == stats_read
