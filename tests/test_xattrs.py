"""Extended attributes through the mirror: one source call per directory block for `ls -l`."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pyfuse3
import pytest

from shadefs.fs.xattrs import BLOCK
from tests.conftest import FakeClock, make_tree
from tests.test_fs_api import CTX, lookup_path, make_fs, readdir_names


def _counting(monkeypatch: pytest.MonkeyPatch, obj: object, names: list[str]) -> dict[str, int]:
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(obj, name)

        def counted(*a: object, _real=real, _name=name) -> object:
            calls[_name] += 1
            return _real(*a)

        monkeypatch.setattr(obj, name, counted)
    return calls


async def _errno(coro) -> int:
    with pytest.raises(pyfuse3.FUSEError) as e:
        await coro
    return e.value.errno


async def test_ls_l_of_a_directory_costs_a_source_call_per_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = BLOCK + 44
    src = make_tree(tmp_path / "src", {f"d/f{i:03d}": b"x" for i in range(n)})
    try:
        os.setxattr(src / "d" / "f007", "user.k", b"v")
    except OSError as exc:
        pytest.skip(f"no user xattrs on {src}: {exc.strerror}")
    ops, svc = make_fs(src)
    paths = svc.source.paths
    calls = _counting(monkeypatch, paths, ["getxattr", "listxattr", "xattr_presence"])
    d = await lookup_path(ops, "d")
    assert len(await readdir_names(ops, d)) == n
    inos = [svc.namespace.numbers.ino_of((src / "d" / f"f{i:03d}").lstat()) for i in range(n)]
    for i, ino in enumerate(inos):  # what ls -l asks of every file
        for name in (b"security.selinux", b"system.posix_acl_access"):
            assert await _errno(ops.getxattr(ino, name, CTX)) == errno.ENODATA
        if i != 7:
            assert await ops.listxattr(ino, CTX) == []
    assert await ops.getxattr(inos[7], b"user.k", CTX) == b"v"
    assert b"user.k" in await ops.listxattr(inos[7], CTX)
    # Two blocks scanned; only the file that has attributes went to the source itself.
    assert calls == {"getxattr": 3, "listxattr": 1, "xattr_presence": 2}


async def test_an_attribute_added_on_the_source_shows_after_revalidate(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"d/a": b"1", "d/b": b"2"})
    clock = FakeClock()
    ops, svc = make_fs(src, revalidate=0.5, clock=clock)
    d = await lookup_path(ops, "d")
    await readdir_names(ops, d)
    a = svc.namespace.numbers.ino_of((src / "d" / "a").lstat())
    assert await _errno(ops.getxattr(a, b"user.k", CTX)) == errno.ENODATA
    try:
        os.setxattr(src / "d" / "a", "user.k", b"new")
    except OSError as exc:
        pytest.skip(f"no user xattrs on {src}: {exc.strerror}")
    # Within revalidate the listing's answer stands, as its sizes and times do.
    assert await _errno(ops.getxattr(a, b"user.k", CTX)) == errno.ENODATA
    clock.advance(0.6)
    assert await ops.getxattr(a, b"user.k", CTX) == b"new"
    await readdir_names(ops, d)  # the refreshed listing learns it too
    assert await ops.getxattr(a, b"user.k", CTX) == b"new"
