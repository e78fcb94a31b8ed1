"""The namespace's compact per-file state: the inode table, snapshots, refreshes, resolve."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import numpy as np
import pyfuse3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadefs.fs.namespace import ROOT_INODE, Namespace
from shadefs.fs.snapshots import InodeTable, Snapshot, Stat, scan_rows
from shadefs.sampling.registry import PathTable
from shadefs.source.part import Source
from tests.conftest import FakeClock, make_tree
from tests.test_fs_api import CTX, lookup_path, make_fs, open_path, readdir_names


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 300)), max_size=400))
def test_inode_table_matches_a_dict(ops: list[tuple[bool, int]]) -> None:
    # Few distinct keys in a small table: long probe runs, wrap-around and backward shifts.
    table, model = InodeTable(bits=2), {}
    for add, key in ops:
        if add:
            table.set(key, key * 7)
            model[key] = key * 7
        else:
            assert table.pop(key) == model.pop(key, -1)
        assert len(table) == len(model)
    for key in range(1, 301):
        assert table.get(key) == model.get(key, -1)
        assert (key in table) == (key in model)


def test_inode_table_deletes_inside_probe_runs_and_across_the_wrap() -> None:
    table = InodeTable(bits=4)
    # Keys sharing the last home slot: their probe run wraps around to slot 0.
    same = [k for k in range(1, 100_000) if table._home(k) == 15][:6]
    other = [k for k in range(1, 100_000) if table._home(k) == 0][:2]
    for k in [*same, *other]:
        table.set(k, k)
    popped = set()
    for gone in (same[0], other[0], same[3]):
        assert table.pop(gone) == gone
        popped.add(gone)
        for k in [*same, *other]:
            assert table.get(k) == (-1 if k in popped else k), (gone, k)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 200), max_size=60),
    st.lists(st.lists(st.integers(1, 200), max_size=40), max_size=6),
)
def test_inode_table_adds_a_batch_as_setdefault_does(
    before: list[int], batches: list[list[int]]
) -> None:
    # Repeats inside a batch (hard links in one directory) and keys already there.
    table, model = InodeTable(bits=2), {}
    for key in before:
        table.set(key, key)
        model[key] = key
    for b, batch in enumerate(batches):
        rows = list(range(100, 100 + len(batch)))
        known = table.add_rows(np.array(batch, dtype=np.uint64), rows, b + 1 << 32)
        expect = []
        for k, key in enumerate(batch):
            if key in model:
                expect.append(k)
            else:
                model[key] = (b + 1) << 32 | rows[k]
        assert known == expect
        assert len(table) == len(model)
    for key in range(1, 201):
        assert table.get(key) == model.get(key, -1)


async def test_hard_links_in_one_directory_hold_a_reference_each(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"d/a": b"x", "d/c": b"y"})
    os.link(src / "d" / "a", src / "d" / "b")
    ops, svc = make_fs(src)
    ns = svc.namespace
    d = await lookup_path(ops, "d")
    assert await readdir_names(ops, d) == [b"a", b"b", b"c"]
    ino = ns.numbers.ino_of((src / "d" / "a").lstat())
    assert ns.node(ino).lookups == 2  # readdirplus handed out a and b: two references
    await ops.forget([(ino, 1)])
    assert ns.node(ino).lookups == 1
    await ops.forget([(ino, 1)])
    assert ino not in ns.table


def test_snapshot_finds_names_by_binary_search(tmp_path: Path) -> None:
    names = sorted([b"a", b"ab", b"b", b"\xff\xfe", b"z" * 200, b"m"])
    entries = [(n, os.lstat(tmp_path)) for n in names]
    _, rows, _ = scan_rows(entries)
    snap = Snapshot(5, b"dir", names, rows, np.arange(len(names), dtype=np.uint64), 0.0)
    for i, n in enumerate(names):
        assert snap.find(n) == i
        assert snap.child_path(i) == b"dir/" + n
    for missing in (b"", b"aa", b"c", b"zz", b"\xff"):
        assert snap.find(missing) == -1
    assert snap.stat(0).st_mode == os.lstat(tmp_path).st_mode


@settings(max_examples=50, deadline=None)
@given(st.sets(st.binary(min_size=1, max_size=12), min_size=17, max_size=80), st.data())
def test_a_long_listing_finds_names_by_their_hashes(names: set[bytes], data) -> None:
    listed = sorted(names)
    stat0 = os.lstat(".")
    _, rows, _ = scan_rows([(n, stat0) for n in listed])
    snap = Snapshot(5, b"d", listed, rows, np.arange(len(listed), dtype=np.uint64), 0.0)
    for i, n in enumerate(listed):
        assert snap.find(n) == i
    other = data.draw(st.binary(max_size=13).filter(lambda b: b not in names))
    assert snap.find(other) == -1


async def test_forgetting_every_child_frees_the_snapshot_but_not_the_listing(
    tmp_path: Path,
) -> None:
    src = make_tree(tmp_path / "src", {f"d/f{i}": b"." * i for i in range(50)})
    ops, svc = make_fs(src)
    ns = svc.namespace
    d = await lookup_path(ops, "d")
    await readdir_names(ops, d)
    assert len(ns.table) == 52
    snap = ns._snaps[ns.listings[d]]
    assert snap is not None and snap.refs == 50
    ino = ns.numbers.ino_of((src / "d" / "f7").lstat())
    assert ns.node(ino).path == b"d/f7" and ns.stat(ino).st_size == 7
    await ops.forget([(ns.numbers.ino_of((src / "d" / f"f{i}").lstat()), 1) for i in range(50)])
    assert snap.refs == 0 and ns.listings[d] == snap.slot  # still d's listing
    await ops.forget([(d, 1)])
    assert d not in ns.listings and ns._snaps[snap.slot] is None
    assert len(ns.table) == 1


async def test_a_refreshed_listing_takes_over_every_node(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"d/same": b"1", "d/changed": b"2"})
    clock = FakeClock()
    ops, svc = make_fs(src, revalidate=0.5, clock=clock)
    ns = svc.namespace
    d = await lookup_path(ops, "d")
    await readdir_names(ops, d)
    old = ns._snaps[ns.listings[d]]
    same, changed = (ns.numbers.ino_of((src / "d" / n).lstat()) for n in ("same", "changed"))
    clock.advance(0.6)
    (src / "d" / "changed").write_bytes(b"longer")
    await readdir_names(ops, d)  # refreshed: readdirplus tells the kernel again
    new = ns._snaps[ns.listings[d]]
    assert new is not old
    assert ns.locate(same)[0] is new and ns.node(same).lookups == 2
    # The changed file's new version is a new node, under a fresh number; the old node
    # stays the old version (the kernel's inode of it may have handles still reading).
    now = ns.numbers.ino_of((src / "d" / "changed").lstat())
    assert now != changed and ns.locate(now)[0] is new and ns.stat(now).st_size == 6
    assert ns.locate(changed)[0] is old and ns.stat(changed).st_size == 1
    assert ns.describe().changed_files == 1
    fi = await ops.open(now, os.O_RDONLY, CTX)
    assert fi.keep_cache and await ops.read(fi.fh, 0, 100) == b"longer"
    await ops.release(fi.fh)
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.open(changed, os.O_RDONLY, CTX)  # its path leads to the new node's file
    assert e.value.errno == errno.ESTALE
    await ops.forget([(changed, 1)])
    assert ns._snaps[old.slot] is None  # nothing points into it any more


async def test_an_empty_directory_lists_as_empty(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"a": b"1"})
    (src / "empty").mkdir()
    ops, _ = make_fs(src)
    assert await readdir_names(ops, await lookup_path(ops, "empty")) == []
    assert scan_rows([])[1].shape == (0,)


async def test_lookup_in_an_unlisted_directory_asks_the_source(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"d/a": b"x", "d/b": b"yy"})
    ops, svc = make_fs(src)
    ns = svc.namespace
    b = await lookup_path(ops, "d/b")
    d = await lookup_path(ops, "d")
    assert d not in ns.listings  # nothing listed d
    assert ns.node(b) == (b"d/b", ns.stat(b), 1, ns.node(b).checked)
    assert (await ops.getattr(b, CTX)).st_size == 2
    await ops.forget([(b, 1)])
    assert b not in ns.table


async def test_resolve_answers_arrays_and_marks_the_missing(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"c/a": b"1", "c/bb": b"22", "top": b"333"})
    (src / "c" / "link").symlink_to("a")
    ns = Namespace(Source(os.fsencode(src)))
    paths = [b"c/bb", b"top", b"c/missing", b"c/link", b"nodir/x", b"top/x", b"c/a", b"c/b"]
    found = await ns.resolve(paths)
    assert found.size.tolist()[:2] == [2, 3] and found.size[6] == 1
    assert stat.S_ISLNK(int(found.mode[3]))
    assert [bool(m) for m in found.mode.tolist()] == [1, 1, 0, 1, 0, 0, 1, 0]
    assert found.ino[0] == ns.numbers.ino_of((src / "c" / "bb").lstat())
    assert len(ns.table) == 1  # nothing kept


def test_path_table_round_trips() -> None:
    paths = ["a/b", "c", "é/ü.jpg", "x/y/z"]
    table = PathTable.of(paths)
    assert list(table) == [os.fsencode(p) for p in paths]
    assert table.all() == [os.fsencode(p) for p in paths]
    assert table[-1] == b"x/y/z"
    view = table.take(np.array([3, 0]))
    assert len(view) == 2 and view[0] == b"x/y/z" and view[1] == b"a/b"
    assert table.same(PathTable.of(list(paths)))
    assert not table.same(PathTable.of(paths[:3]))
    assert len(PathTable.of([])) == 0


async def test_stale_inode_is_estale(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"a": b"1"})
    ops, _ = make_fs(src)
    try:
        await ops.getattr(123456, CTX)
    except pyfuse3.FUSEError as exc:
        assert exc.errno == 116  # ESTALE
    else:
        raise AssertionError("no ESTALE")
    assert (await ops.getattr(ROOT_INODE, CTX)).st_ino == ROOT_INODE


def test_scan_rows_keeps_fields_above_2_63(tmp_path: Path) -> None:
    from types import SimpleNamespace

    real = os.lstat(tmp_path)
    fields = {f: getattr(real, f) for f in Stat._fields} | {"st_dev": real.st_dev}
    big = SimpleNamespace(**(fields | {"st_ino": (1 << 64) - 5}))
    names, rows, devs = scan_rows([(b"a", real), (b"b", big)])  # type: ignore[list-item]
    assert names == [b"a", b"b"] and devs.tolist() == [real.st_dev] * 2
    assert Stat.of(real) == Snapshot(1, b"", names, rows, devs, 0.0).stat(0)
    assert int(rows["st_ino"][1]) == (1 << 64) - 5


async def test_a_reopened_file_sees_its_change_and_its_forget(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"d/f": b"1"})
    clock = FakeClock()
    ops, svc = make_fs(src, revalidate=0.3, clock=clock)
    ns = svc.namespace
    ino = await lookup_path(ops, "d/f")
    for _ in range(2):  # the second open comes from the kept record
        await ops.release((await ops.open(ino, os.O_RDONLY, CTX)).fh)
    assert ns.opening(ino)[0].st_size == 1
    (src / "d" / "f").write_bytes(b"changed")
    clock.advance(0.4)
    ino, fi = await open_path(ops, ino, "d/f")  # ESTALE: the new version is a new node
    assert await ops.read(fi.fh, 0, 100) == b"changed"
    await ops.release(fi.fh)
    assert ns.opening(ino)[0].st_size == 7 and ns.stat(ino).st_size == 7
    await ops.forget([(ino, 1)])
    try:
        ns.opening(ino)
    except pyfuse3.FUSEError as exc:
        assert exc.errno == 116  # ESTALE: the record went with the inode
    else:
        raise AssertionError("a forgotten inode still opens")
