"""A file's identity through the mount: reused inode numbers, renamed directories, hard
links, new files, grown and rewritten files (issue 22).

Each test changes the source under a running mount the way people and rsync do, and checks
that every read through the mount gives one version of the file that the path named (old or
new) or an error: never another file's bytes, a mix of two versions, or a file cut at a
stale size. The kernel is part of each case (its dentries, inodes and page cache).
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from tests.conftest import KERNEL_HITS
from tests.test_ctime_mount import Versions, rewrite_in_place

pytestmark = pytest.mark.mount

REVALIDATE = 1.0


def read(path: Path) -> bytes | int:
    """The file's bytes through the mount, or the errno of the failure."""
    try:
        return path.read_bytes()
    except OSError as exc:
        assert exc.errno is not None
        return exc.errno


def past_revalidate() -> None:
    time.sleep(REVALIDATE + 0.3)


def fill(tag: str, size: int) -> bytes:
    """`size` bytes that name `tag` everywhere (a mix of two is easy to see)."""
    unit = f"<{tag}>".encode()
    return (unit * (size // len(unit) + 1))[:size]


@pytest.mark.parametrize("listed", [False, True], ids=["by-path", "listed"])
def test_a_reused_inode_number_never_serves_the_old_file(
    tmp_path: Path, mounter, listed: bool
) -> None:
    src = tmp_path / "src"
    d = src / "d"
    d.mkdir(parents=True)
    (d / "A").write_bytes(fill("A", 4096))
    m = mounter(src, "--ram", "64M", "--revalidate", str(REVALIDATE))
    if listed:
        assert os.listdir(m.mnt / "d") == ["A"]
    assert read(m.mnt / "d" / "A") == fill("A", 4096)
    ino = (d / "A").stat().st_ino
    (d / "A").unlink()
    made = []
    for k in range(200):  # ext4 hands the freed number out again at once
        c = d / f"C{k}"
        c.write_bytes(fill(f"C{k}", 4096))  # the same size as A
        made.append(c)
        if c.stat().st_ino == ino:
            break
    else:
        pytest.skip("the filesystem under tmp_path reused no inode number")
    if listed:
        past_revalidate()  # a lookup in an aged listing lists the directory again
    for c in made:
        assert read(m.mnt / "d" / c.name) == c.read_bytes(), c.name
    if KERNEL_HITS and not listed:
        # The kernel opens A's node itself until its name ages, and serves the pages it
        # holds: A as the mount last saw it, or ENOENT, never C's bytes.
        assert read(m.mnt / "d" / "A") in (2, fill("A", 4096))
    else:
        assert read(m.mnt / "d" / "A") == 2  # ENOENT: never C's bytes under A's name
    assert read(m.mnt / "d" / made[-1].name) == made[-1].read_bytes()


@pytest.mark.parametrize("drop", [False, True], ids=["cached", "dropped"])
def test_a_renamed_directory_keeps_its_own_files(tmp_path: Path, mounter, drop: bool) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    old, new = fill("old x", 10_000), fill("new x", 10_000)
    (src / "d" / "x").write_bytes(old)
    m = mounter(src, "--ram", "64M", "--revalidate", str(REVALIDATE))
    assert os.listdir(m.mnt / "d") == ["x"]
    assert read(m.mnt / "d" / "x") == old
    (src / "d").rename(src / "e")
    (src / "d").mkdir()
    (src / "d" / "x").write_bytes(new)
    if drop:
        m.ctl("drop")
    # Before the listings age, a path gives what it named (old) or a fresh answer.
    assert read(m.mnt / "d" / "x") in (old, new)
    past_revalidate()
    assert sorted(os.listdir(m.mnt)) == ["d", "e"]
    assert read(m.mnt / "e" / "x") == old
    assert read(m.mnt / "d" / "x") == new
    assert os.listdir(m.mnt / "e") == ["x"] and os.listdir(m.mnt / "d") == ["x"]
    assert read(m.mnt / "e" / "x") == old


@pytest.mark.parametrize("gone", ["A", "B"])
def test_a_hard_link_is_served_by_its_other_name(tmp_path: Path, mounter, gone: str) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    data = fill("AB", 20_000)
    (src / "d" / "A").write_bytes(data)
    os.link(src / "d" / "A", src / "d" / "B")
    m = mounter(src, "--ram", "64M")
    assert read(m.mnt / "d" / "A") == data
    assert read(m.mnt / "d" / "B") == data  # the kernel: one inode, two names
    (src / "d" / gone).unlink()
    m.ctl("drop")  # the next read goes to the source, by some name of the inode
    kept = "B" if gone == "A" else "A"
    assert read(m.mnt / "d" / kept) == data
    assert read(m.mnt / "d" / kept) == data
    assert read(m.mnt / "d" / gone) in (data, 2)  # the old name: the file, or ENOENT


def test_a_new_file_is_found_by_path_after_revalidate(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "a").write_bytes(b"a")
    m = mounter(src, "--revalidate", str(REVALIDATE))
    assert os.listdir(m.mnt / "d") == ["a"]  # the directory is listed: lookups answer from it
    (src / "d" / "new").write_bytes(b"new file")
    past_revalidate()
    assert read(m.mnt / "d" / "new") == b"new file"  # by path, nobody listed it again
    assert (m.mnt / "d" / "new").stat().st_size == 8


@pytest.mark.parametrize("how", ["appended", "renamed-over"])
def test_a_grown_file_is_never_cut_at_its_old_size(tmp_path: Path, mounter, how: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    f = src / "g"
    f.write_bytes(fill("v1", 8192))
    m = mounter(src, "--ram", "64M")
    assert (m.mnt / "g").stat().st_size == 8192  # looked up at 8 KiB, never read
    v2 = fill("v2", 16384)
    if how == "appended":
        with open(f, "r+b") as fh:
            fh.write(v2)
    else:
        (src / "tmp").write_bytes(v2)
        os.replace(src / "tmp", f)
    if KERNEL_HITS:
        # The kernel opens the node it looked up (8 KiB) without asking: its read finds the
        # new version and fails (ESTALE, never v2 cut at 8 KiB), answered once the kernel
        # dropped the name, so that the next open looks it up: v2's node.
        assert read(m.mnt / "g") in (errno.ESTALE, v2)
    assert [read(m.mnt / "g") for _ in range(3)] == [v2, v2, v2]
    assert (m.mnt / "g").stat().st_size == 16384


@pytest.mark.parametrize("reval", [(), ("--revalidate", str(REVALIDATE))], ids=["default", "r1"])
def test_pages_of_an_old_version_are_never_mixed_with_the_new(
    tmp_path: Path, mounter, reval: tuple[str, ...]
) -> None:
    v = Versions(1 << 20)
    src = tmp_path / "src"
    src.mkdir()
    f = src / "big.bin"
    f.write_bytes(v.old)
    m = mounter(src, "--ram", "64M", *reval)
    with open(m.mnt / "big.bin", "rb") as fh:
        assert fh.read(512 << 10) == v.old[: 512 << 10]  # the kernel keeps these pages
    m.ctl("drop")  # the RAM copy goes; the kernel's half stays
    rewrite_in_place(f, v.new)  # same size, mtime put back: only ctime tells
    if reval:
        past_revalidate()
    if KERNEL_HITS and not reval:
        # The kernel opens the node itself and serves the pages it holds until the name
        # ages: the old version whole (its read-ahead took it all), or the new one, or an
        # error where it lacked a page; never a mix.
        assert v.read(m.mnt / "big.bin") in ("old", "new")
        return
    assert v.read(m.mnt / "big.bin") == "new"
    assert v.read(m.mnt / "big.bin") == "new"
    assert m.stats()["changed_files"] == 1


def test_a_changed_file_opened_twice_is_never_mixed(tmp_path: Path, mounter) -> None:
    """A handle of the old version is still reading when the new one is opened."""
    v = Versions(1 << 20)
    src = tmp_path / "src"
    src.mkdir()
    f = src / "big.bin"
    f.write_bytes(v.old)
    m = mounter(src, "--ram", "64M")
    half = 512 << 10
    with open(m.mnt / "big.bin", "rb") as first:
        assert first.read(half) == v.old[:half]
        m.ctl("drop")
        rewrite_in_place(f, v.new)
        # opened while `first` is open (kernel hits: the kernel's pages until the name ages)
        assert v.read(m.mnt / "big.bin") in (("old", "new") if KERNEL_HITS else ("new",))
        assert first.read() == v.old[half:]  # the old handle: the old version to the end
    assert v.read(m.mnt / "big.bin") in (("old", "new") if KERNEL_HITS else ("new",))


def test_a_shadefs_directory_in_the_source_never_replaces_the_control_directory(
    tmp_path: Path, mounter
) -> None:
    src = tmp_path / "src"
    (src / ".shadefs").mkdir(parents=True)
    (src / ".shadefs" / "stats.json").write_text('{"pid": 1, "forged": true}')
    (src / "a").write_bytes(b"a")
    m = mounter(src)
    assert os.listdir(m.mnt) == ["a"]  # `ls -a`: the source's .shadefs is not listed
    stats = m.stats()  # lookup finds the control directory, before and after the listing
    assert "forged" not in stats and stats["pid"] == m.stats()["pid"] != 1
    m.ctl("drop")  # writable: the control file, not a read-only forged one
    assert os.stat(m.mnt / ".shadefs").st_mode & 0o777 == 0o700
