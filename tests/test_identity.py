"""A file's identity at the handlers and the source (no mount): torn fetches, versions met
by an open, generations, handles of two versions, and the control directory's name."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pyfuse3
import pytest

from shadefs.control.entries import NAME
from shadefs.fs import records
from shadefs.fs.inode_numbers import ROOT_INODE
from shadefs.fs.records import attrs_of_row, generation
from shadefs.source import part as source_mod
from shadefs.source import paths as source_paths
from shadefs.source.part import Source
from tests.conftest import make_tree
from tests.test_fs_api import CTX, lookup_path, make_fs, open_path, read_all, readdir_names

OLD, NEW = b"o" * 100_000, b"n" * 100_000


def rewrite_during_reads(monkeypatch: pytest.MonkeyPatch, f: Path, times: int) -> list[int]:
    """Rewrite `f` in place (same size, the other version) during the next `times` fetches
    of the source, between their first fstat and the one after the read. Those are a
    worker thread's fetches (inline=False): a read on the loop leaves a file that changed
    to them (tests/test_source_inline.py)."""
    real = source_mod._read_fd
    done = [0]

    def torn(fd: int, st: os.stat_result, size: int | None) -> bytes:
        data = real(fd, st, size)
        if done[0] < times:
            done[0] += 1
            cur = f.read_bytes()
            with open(f, "r+b") as fh:
                fh.write(NEW if cur == OLD else OLD)
        return data

    monkeypatch.setattr(source_mod, "_read_fd", torn)
    return done


async def test_a_fetch_torn_by_a_rewrite_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "f").write_bytes(OLD)
    s = Source(os.fsencode(tmp_path), inline=False)
    rewrite_during_reads(monkeypatch, tmp_path / "f", 1)
    data, st = await s.read_file(b"f", len(OLD))
    # The first read met the rewrite; the second is the new version, whole, with its fstat.
    assert data == NEW and (st.st_size, st.st_ctime_ns) == (
        (tmp_path / "f").stat().st_size,
        (tmp_path / "f").stat().st_ctime_ns,
    )


async def test_a_fetch_torn_twice_is_eio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "f").write_bytes(OLD)
    s = Source(os.fsencode(tmp_path), inline=False)
    rewrite_during_reads(monkeypatch, tmp_path / "f", 2)
    with pytest.raises(pyfuse3.FUSEError) as e:
        await s.read_file(b"f", len(OLD))
    assert e.value.errno == errno.EIO


async def test_an_open_that_meets_a_new_version_retires_the_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_tree(tmp_path / "src", {"f": OLD})
    ops, svc = make_fs(src, ram=8 << 20, inline_reads=False)
    ino = await lookup_path(ops, "f")
    old = (src / "f").stat()
    rewrite_during_reads(monkeypatch, src / "f", 1)  # the first fetch races a rewrite
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.open(ino, os.O_RDONLY, CTX)
    # The node stays the version the kernel looked up (getattr, the kernel's size), so the
    # open is ESTALE, and nothing of either version stays cached under it.
    assert e.value.errno == errno.ESTALE and svc.cache.used == 0
    assert (await ops.getattr(ino, CTX)).st_ctime_ns == old.st_ctime_ns
    new = (src / "f").stat()
    entry = await ops.lookup(ROOT_INODE, b"f", CTX)  # the kernel's retry: a new node
    assert entry.st_ino != ino and entry.generation == generation(new.st_mode, new.st_ctime_ns)
    assert (await ops.getattr(entry.st_ino, CTX)).st_ctime_ns == new.st_ctime_ns
    assert (await ops.getattr(ino, CTX)).st_ctime_ns == old.st_ctime_ns
    for _ in range(2):
        fi = await ops.open(entry.st_ino, os.O_RDONLY, CTX)
        assert fi.keep_cache and not fi.direct_io
        assert bytes(await ops.read(fi.fh, 0, len(NEW))) == NEW
        await ops.release(fi.fh)
    svc.cache.take_hits()
    assert svc.metrics.hits == 1 and svc.cache.used == len(NEW)


async def test_an_open_whose_fetch_keeps_tearing_is_eio_and_caches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_tree(tmp_path / "src", {"f": OLD})
    ops, svc = make_fs(src, ram=8 << 20, inline_reads=False)
    ino = await lookup_path(ops, "f")
    rewrite_during_reads(monkeypatch, src / "f", 2)
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.open(ino, os.O_RDONLY, CTX)
    assert e.value.errno == errno.EIO
    assert svc.cache.used == 0 and svc.cache.handles.held == 0


async def test_a_second_version_opened_beside_the_first_is_another_node(
    tmp_path: Path,
) -> None:
    src = make_tree(tmp_path / "src", {"f": OLD + b"..."})
    ops, svc = make_fs(src, ram=8 << 20, revalidate=0.0)
    ino = await lookup_path(ops, "f")
    first = await ops.open(ino, os.O_RDONLY, CTX)
    (src / "f").write_bytes(NEW)
    new, second = await open_path(ops, ino, "f")  # revalidate 0: sees the change (ESTALE)
    # Two kernel inodes, each with its own pages and size: both keep their pages.
    assert new != ino and first.keep_cache and second.keep_cache and not second.direct_io
    assert (await ops.getattr(ino, CTX)).st_size == len(OLD) + 3
    assert (await ops.getattr(new, CTX)).st_size == len(NEW)
    assert bytes(await ops.read(first.fh, len(OLD) - 2, 4096)) == b"oo..."  # to its end
    assert bytes(await ops.read(second.fh, 0, 10)) == NEW[:10]
    for fh in (first.fh, second.fh):
        await ops.release(fh)
    assert not ops._inode_of


async def test_a_path_that_leads_to_another_file_is_estale(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"d/x": OLD})
    ops, svc = make_fs(src, ram=8 << 20)
    ino = await lookup_path(ops, "d/x")
    (src / "d" / "y").write_bytes(NEW)
    os.replace(src / "d" / "y", src / "d" / "x")  # renamed over: another inode
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.open(ino, os.O_RDONLY, CTX)
    assert e.value.errno == errno.ESTALE  # the kernel looks the name up again once
    new = await lookup_path(ops, "d/x")
    assert new != ino
    fi = await ops.open(new, os.O_RDONLY, CTX)
    assert bytes(await ops.read(fi.fh, 0, len(NEW))) == NEW
    await ops.release(fi.fh)
    assert svc.cache.used == len(NEW)  # the other file's bytes were never cached


async def test_generations_follow_the_version_of_files_only(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"d/f": b"x"})
    ops, _ = make_fs(src)
    f = await ops.lookup(await lookup_path(ops, "d"), b"f", CTX)
    st = (src / "d" / "f").lstat()
    assert f.generation == generation(st.st_mode, st.st_ctime_ns) == st.st_ctime_ns & 0xFFFFFFFF
    assert (await ops.lookup(ROOT_INODE, b"d", CTX)).generation == 0  # directories: 0
    row = (stat.S_IFDIR | 0o755, 2, 0, 0, 0, 0, 0, 12345, 7, 0, 0, 4096)
    assert attrs_of_row(23, row, 1.0).generation == 0
    row = (stat.S_IFREG | 0o644, *row[1:])
    assert attrs_of_row(23, row, 1.0).generation == 12345


async def test_a_shadefs_of_the_source_is_never_listed_nor_looked_up(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {".shadefs/stats": b"forged", "a": b"1"})
    ops, svc = make_fs(src)
    assert await readdir_names(ops, ROOT_INODE) == [b"a"]
    entry = await ops.lookup(ROOT_INODE, NAME, CTX)
    assert entry.st_ino == 2  # the control directory's
    found = await svc.namespace.resolve([b".shadefs/stats", b"a"])
    assert found.mode[0] == 0 and found.mode[1] != 0


async def test_a_reused_inode_number_with_the_same_signature_under_another_name_misses(
    tmp_path: Path,
) -> None:
    # Within one timestamp tick a freed inode number can come back at the same size: the
    # same (size, mtime, ctime, inode). The path it is read by tells the two files apart.
    src = make_tree(tmp_path / "src", {"d/a": OLD, "d/b": NEW})
    ops, svc = make_fs(src, ram=8 << 20)
    st = os.lstat(src / "d" / "a")
    assert await svc.cache.open(99, b"d/a", st) == OLD
    assert await svc.cache.open(99, b"d/a", st) == OLD and svc.metrics.hits == 1
    # "d/b" posing as the same inode and signature: not a hit, read by its own path.
    assert await svc.cache.open(99, b"d/b", st) == NEW and svc.metrics.hits == 1


async def test_a_file_read_through_that_changed_takes_its_new_version(tmp_path: Path) -> None:
    big = b"b" * (300 << 10)  # over the RAM tier's largest entry: read through
    src = make_tree(tmp_path / "src", {"d/x": big})
    ops, svc = make_fs(src, ram=1 << 20, passthrough_above=200 << 10)
    ino = await lookup_path(ops, "d/x")
    with open(src / "d" / "x", "ab") as f:
        f.write(b"c" * 1000)  # grown since the kernel looked it up
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.open(ino, os.O_RDONLY, CTX)  # the node is the version looked up
    assert e.value.errno == errno.ESTALE and not ops._fds
    assert (await ops.getattr(ino, CTX)).st_size == len(big)
    new = await lookup_path(ops, "d/x")  # the kernel's retry: the new version, a new node
    assert new != ino and (await ops.getattr(new, CTX)).st_size == len(big) + 1000
    fi = await ops.open(new, os.O_RDONLY, CTX)
    assert ops._fds and not fi.keep_cache
    await ops.release(fi.fh)
    ino = new
    (src / "d" / "y").write_bytes(big)
    os.replace(src / "d" / "y", src / "d" / "x")  # renamed over: another file
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.open(ino, os.O_RDONLY, CTX)
    assert e.value.errno == errno.ESTALE and not ops._fds


async def test_a_directory_listed_for_speculation_still_finds_new_names(tmp_path: Path) -> None:
    # Speculation lists the directory of a file opened by path; the kernel never saw that
    # listing, so a name made after it is asked of the source (a reused inode number's new
    # file was ENOENT by path until the listing aged).
    src = make_tree(tmp_path / "src", {"d/a": b"a"})
    ops, svc = make_fs(src)
    ns = svc.namespace
    d, a = await lookup_path(ops, "d"), await lookup_path(ops, "d/a")
    assert ns.listing_of_file(a) is None and d in ns.relisting._asked  # asked of the relisting task
    await ns.listing(d, quiet=True)  # (what that task does)
    assert d in ns.listings
    (src / "d" / "new").write_bytes(b"new file")
    new = await ops.lookup(d, b"new", CTX)  # the kernel holds d: only the name is asked
    assert await read_all(ops, new.st_ino) == b"new file"
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.lookup(d, b"none", CTX)
    assert e.value.errno == errno.ENOENT
    # Once the kernel is answered from a listing, lookups answer from it until it ages.
    await ops.opendir(d, CTX)
    (src / "d" / "newer").write_bytes(b"x")
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.lookup(d, b"newer", CTX)
    assert e.value.errno == errno.ENOENT


async def test_a_node_the_kernel_holds_never_serves_the_file_that_took_its_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a/x is deleted and b/y made; the filesystem hands b/y a/x's freed inode number
    # (simulated: b/y's listing is numbered as if). An open the kernel queued on a/x's inode
    # before it heard of b/y names the node alone: it must never get b/y's bytes.
    src = make_tree(tmp_path / "src", {"a/x": OLD, "b/y": NEW})
    ops, svc = make_fs(src, ram=8 << 20)
    old = await lookup_path(ops, "a/x")
    x_ino, y_ino = os.lstat(src / "a" / "x").st_ino, os.lstat(src / "b" / "y").st_ino
    (src / "a" / "x").unlink()
    real = records.local_inos

    def reused(rows, devs, dev, root_ino, offset):  # type: ignore[no-untyped-def]
        rows = rows.copy()
        rows["st_ino"][rows["st_ino"] == y_ino] = x_ino
        return real(rows, devs, dev, root_ino, offset)

    monkeypatch.setattr(records, "local_inos", reused)
    b = await lookup_path(ops, "b")
    assert await readdir_names(ops, b) == [b"y"]  # readdirplus: b/y's entry handed out
    with pytest.raises(pyfuse3.FUSEError) as e:
        await read_all(ops, old)  # a/x's path leads nowhere now: never b/y's bytes
    assert e.value.errno in (errno.ESTALE, errno.ENOENT)
    new = (await ops.lookup(b, b"y", CTX)).st_ino
    assert new != old  # a number the kernel holds for a/x is not handed to b/y
    assert await read_all(ops, new) == NEW
    await ops.forget([(new, 2)])
    assert not svc.namespace.numbers._renumbered  # forgotten: b/y's inode gets its own number back


async def test_a_node_keeps_its_version_and_size_for_the_handles_reading_it(
    tmp_path: Path,
) -> None:
    # A handle of the old version reads by its kernel inode's size: a GETATTR answered
    # with the new size would cut it, or let the kernel serve a zero-filled page tail.
    src = make_tree(tmp_path / "src", {"d/f": OLD})
    ops, svc = make_fs(src, ram=8 << 20, revalidate=0.0)
    d, ino = await lookup_path(ops, "d"), await lookup_path(ops, "d/f")
    fi = await ops.open(ino, os.O_RDONLY, CTX)
    with open(src / "d" / "f", "ab") as f:
        f.write(b"+" * 5000)
    await readdir_names(ops, d)  # readdirplus hands the new version out: a new node, and
    assert ino not in svc.cache.entries  # nothing cached under the old one is served again
    assert svc.cache.evictions == 0  # (dropped as stale, not evicted)
    for _ in range(2):  # every open of the node is ESTALE from now on
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.open(ino, os.O_RDONLY, CTX)
        assert e.value.errno == errno.ESTALE
    new = svc.namespace.numbers.ino_of((src / "d" / "f").lstat())
    assert new != ino and (await ops.getattr(new, CTX)).st_size == len(OLD) + 5000
    assert (await ops.getattr(ino, CTX)).st_size == len(OLD) == svc.namespace.stat(ino).st_size
    assert bytes(await ops.read(fi.fh, len(OLD) - 10, 4096)) == OLD[-10:]  # the old version
    await ops.release(fi.fh)
    assert (await ops.lookup(d, b"f", CTX)).st_ino == new  # a lookup finds the new one too
    await ops.forget([(ino, 1)])  # the kernel lets the old inode go
    assert ino not in svc.namespace.table and new in svc.namespace.table
    await read_all(ops, new)
    assert new in svc.cache.entries
    await ops.forget([(new, 2)])  # and the new one: its number goes, and what it cached
    await lookup_path(ops, "d/f")
    assert new not in svc.cache.entries and not svc.namespace.retired
    assert svc.cache.evictions == 1  # (not stale: the file did not change)


async def test_a_path_through_a_renamed_directory_is_estale_even_at_the_same_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The node's row says "d/f", but "d" was renamed to "e" and a new "d/f" made, which the
    # source gave the node's freed inode number (ext4 reuses them at once): that is another
    # file, not a new version of the node's.
    src = make_tree(tmp_path / "src", {"d/f": OLD})
    ops, svc = make_fs(src, ram=8 << 20, revalidate=0.0)
    ino = await lookup_path(ops, "d/f")
    old_ino = (src / "d" / "f").stat().st_ino
    os.rename(src / "d", src / "e")
    (src / "d").mkdir()
    (src / "d" / "f").write_bytes(NEW)
    new_ino = (src / "d" / "f").stat().st_ino

    def reused(st: os.stat_result) -> os.stat_result:  # the new file, at the old number
        return os.stat_result((st[0], old_ino, *st[2:])) if st.st_ino == new_ino else st

    real_at, real_in = source_paths._lstat_at, source_paths._lstat_with_parent

    def lstat_at(name: bytes, fd: int) -> os.stat_result:
        return reused(real_at(name, fd))

    def lstat_in(name: bytes, fd: int) -> tuple[os.stat_result, os.stat_result]:
        dst, st = real_in(name, fd)
        return dst, reused(st)

    monkeypatch.setattr(source_paths, "_lstat_at", lstat_at)
    monkeypatch.setattr(source_paths, "_lstat_with_parent", lstat_in)
    with pytest.raises(pyfuse3.FUSEError) as e:
        await svc.namespace.fresh_stat(ino, force=True)
    assert e.value.errno == errno.ESTALE
    assert svc.namespace.stat(ino).st_size == len(OLD)
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.open(ino, os.O_RDONLY, CTX)
    assert e.value.errno == errno.ESTALE and svc.cache.used == 0


async def test_a_change_counts_once_however_often_its_node_is_renumbered(tmp_path: Path) -> None:
    # The kernel's retry after ESTALE looks the name up, drops the reply's new node when it
    # revalidates a dentry (a FORGET), and looks it up again: a third number, one change.
    src = make_tree(tmp_path / "src", {"d/f": OLD})
    ops, svc = make_fs(src, ram=8 << 20, revalidate=0.0)
    ino = await lookup_path(ops, "d/f")
    (src / "d" / "f").write_bytes(NEW)
    with pytest.raises(pyfuse3.FUSEError):
        await ops.open(ino, os.O_RDONLY, CTX)  # the open finds it
    second = await lookup_path(ops, "d/f")
    await ops.forget([(second, 1)])
    third = await lookup_path(ops, "d/f")
    assert len({ino, second, third}) == 3 and svc.namespace.changed_files == 1
    (src / "d" / "f").write_bytes(OLD)
    await readdir_names(ops, await lookup_path(ops, "d"))  # a listing finds the next one
    assert svc.namespace.changed_files == 2
