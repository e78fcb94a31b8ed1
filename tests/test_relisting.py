"""A directory whose listing went with its inode (the kernel forgot it: a cache drop) is
listed again in the background once its names are looked up one by one (fs/relisting.py):
otherwise each name costs its own lstat in a worker thread."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from shadefs.fs.namespace import ROOT_INODE
from tests.conftest import FakeCtx, make_tree
from tests.test_fs_api import make_fs, readdir_names

CTX = FakeCtx()
ALL = 1 << 30  # a forget of every reference the kernel holds


async def _settled(ns: Any) -> None:
    """Every task blocked and no listing in flight (a listing waits on a worker thread)."""
    await trio.testing.wait_all_tasks_blocked()
    while ns._listing_flights:
        done, _ = next(iter(ns._listing_flights.values()))  # (its event, its waiters' error)
        await done.wait()
        await trio.testing.wait_all_tasks_blocked()


def _count_lstats(svc: Any, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    lstats: list[bytes] = []
    run = svc.source.run

    async def counting(fn: Any, *args: Any) -> Any:
        if fn == svc.source.paths.lstat_in:
            lstats.append(args[0])
        return await run(fn, *args)

    monkeypatch.setattr(svc.source, "run", counting)
    return lstats


async def test_the_names_after_the_first_come_from_a_listing_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = [f"f{i:02d}" for i in range(40)]
    src = make_tree(
        tmp_path / "src", {**{f"d/{n}": b"." for n in names}, **{f"e/{n}": b"." for n in names}}
    )
    ops, svc = make_fs(src)
    ns = svc.namespace
    lstats = _count_lstats(svc, monkeypatch)

    async def look_up(dirname: str) -> list[int]:
        d = (await ops.lookup(ROOT_INODE, dirname.encode(), CTX)).st_ino
        inos = [(await ops.lookup(d, names[0].encode(), CTX)).st_ino]
        await _settled(ns)  # the listing that first name asked for (if any) lands
        inos += [(await ops.lookup(d, n.encode(), CTX)).st_ino for n in names[1:]]
        return [d, *inos]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ns.relist)
        d = (await ops.lookup(ROOT_INODE, b"d", CTX)).st_ino
        assert sorted(await readdir_names(ops, d)) == [n.encode() for n in names]
        first = await look_up("d")
        await ops.forget([(ino, ALL) for ino in first])  # drop_caches: d's listing goes
        assert d not in ns.listings
        lstats.clear()
        assert await look_up("d") == first
        assert lstats == [b"d", b"d/f00"]  # (the root was never listed), then d's listing
        assert ns.relisting.relisted == 1 and ns.describe().directories_relisted == 1

        # A directory never listed keeps its lookups by name: nothing listed for it.
        lstats.clear()
        await look_up("e")
        assert len(lstats) == 1 + len(names) and ns.relisting.relisted == 1
        nursery.cancel_scope.cancel()


async def test_a_directory_forgotten_before_its_turn_is_not_listed(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"d/a": b"1", "d/b": b"2"})
    ops, svc = make_fs(src)
    ns = svc.namespace
    d = (await ops.lookup(ROOT_INODE, b"d", CTX)).st_ino
    await readdir_names(ops, d)
    await ops.forget([(d, ALL)])
    d = (await ops.lookup(ROOT_INODE, b"d", CTX)).st_ino
    a = (await ops.lookup(d, b"a", CTX)).st_ino  # asks for d's listing; no task runs yet
    await ops.forget([(a, ALL), (d, ALL)])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ns.relist)
        await _settled(ns)
        assert d not in ns.listings and ns.relisting.relisted == 0 and not ns.relisting._asked
        nursery.cancel_scope.cancel()
