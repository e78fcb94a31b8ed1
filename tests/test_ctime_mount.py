"""A source file rewritten in place, same size, with its mtime put back: seen through ctime.

The cache's signature of a source file was (size, mtime, inode); a rewrite that keeps the
size and restores the mtime with utime() fooled it for good, even with --revalidate. ctime
cannot be set back from user space, so it is in the signature now, for the RAM tier and for
the entries on the SSD, which outlive the mount.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from tests.conftest import drop_kernel_pages
from tests.test_ssd_mount import wait_for_writes

pytestmark = pytest.mark.mount


class Versions:
    """Two contents of one size, and which of them a read returned.

    Comparing names keeps a failure readable ("old" != "new") instead of a diff of
    hundreds of kilobytes of random bytes, which pytest can take minutes to compute.
    """

    def __init__(self, size: int) -> None:
        rng = random.Random(size)
        self.old, self.new = rng.randbytes(size), rng.randbytes(size)

    def read(self, path: Path) -> str:
        data = path.read_bytes()
        if data == self.old:
            return "old"
        if data == self.new:
            return "new"
        return f"neither ({len(data)} bytes)"


def rewrite_in_place(f: Path, data: bytes) -> None:
    """Overwrite f with data of the same size and put its mtime back, as rsync -t might."""
    before = f.stat()
    assert len(data) == before.st_size
    with open(f, "r+b") as fh:
        fh.write(data)
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = f.stat()
    # The premise of the test: only ctime tells the two versions apart.
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_ino,
    )
    assert after.st_ctime_ns != before.st_ctime_ns


def test_rewrite_with_mtime_put_back_is_seen_in_ram(tmp_path: Path, mounter) -> None:
    v = Versions(50_000)
    f = tmp_path / "src" / "d" / "sample.bin"
    f.parent.mkdir(parents=True)
    f.write_bytes(v.old)
    m = mounter(tmp_path / "src", "--ram", "64M", "--revalidate", "1")
    path = m.mnt / "d" / "sample.bin"
    assert v.read(path) == "old"
    drop_kernel_pages()  # (or, with kernel hits, the kernel serves the second read)
    assert v.read(path) == "old"
    assert m.stats()["hits"] == 1  # the second read came from RAM
    rewrite_in_place(f, v.new)
    time.sleep(1.3)  # past --revalidate
    assert v.read(path) == "new"
    s = m.stats()
    assert s["changed_files"] == 1 and s["bytes_from_source"] == 2 * len(v.old)


def test_rewrite_with_mtime_put_back_is_seen_on_the_ssd(tmp_path: Path, mounter) -> None:
    # Larger than the RAM tier's largest entry (1M / 8), so only the SSD tier keeps it.
    v = Versions(200_000)
    src = tmp_path / "src"
    f = src / "d" / "sample.bin"
    f.parent.mkdir(parents=True)
    f.write_bytes(v.old)
    args = ("--ram", "1M", "--ssd", f"{tmp_path / 'cache'}:1G", "--revalidate", "1")
    m = mounter(src, *args)
    assert v.read(m.mnt / "d" / "sample.bin") == "old"
    wait_for_writes(m)
    m.unmount()

    # A new daemon: the bytes come from the entry on disk.
    m2 = mounter(src, *args, name="mnt2")
    path = m2.mnt / "d" / "sample.bin"
    assert v.read(path) == "old"
    s = m2.stats()
    assert (s["ssd_hits"], s["bytes_from_source"]) == (1, 0)
    rewrite_in_place(f, v.new)
    time.sleep(1.3)  # past --revalidate
    assert v.read(path) == "new"
    s = wait_for_writes(m2)
    assert s["changed_files"] == 1 and s["tiers"]["ssd"]["stale_entries"] == 1
    assert s["bytes_from_source"] == len(v.new)
    m2.unmount()

    # Changed while no daemon was watching: the entry on disk (now the new version) is stale.
    rewrite_in_place(f, v.old)
    m3 = mounter(src, *args, name="mnt3")
    assert v.read(m3.mnt / "d" / "sample.bin") == "old"
    s = m3.stats()
    assert (s["ssd_hits"], s["bytes_from_source"]) == (0, len(v.old))
