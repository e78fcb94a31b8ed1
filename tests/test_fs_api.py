"""The Operations handlers driven directly (no mount): namespace, data path, control."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pyfuse3
import pytest
import trio
import trio.testing

from shadefs.control.entries import DIR_INODE, NAME
from shadefs.fs.namespace import ROOT_INODE
from shadefs.fs.operations import Operations
from shadefs.options import MountOptions
from shadefs.service import Service
from tests.conftest import FakeClock, FakeCtx, make_tree

CTX = FakeCtx()


def make_fs(src: Path, **kw) -> tuple[Operations, Service]:
    """The handlers of a service built for `src`, and the service (its parts). `clock`: the
    parts' clock, a FakeClock that moves only when the test moves it (a fresh one if not
    given): no in-process test depends on real time passing."""
    clock = kw.pop("clock", None) or FakeClock()
    opts = MountOptions(
        source=str(src), mountpoint="/nonexistent", ram=kw.pop("ram", 1 << 20), **kw
    )
    service = Service(opts, clock)
    return service.operations, service


async def lookup_path(ops, rel: str) -> int:
    ino = ROOT_INODE
    for part in rel.split("/"):
        ino = (await ops.lookup(ino, part.encode(), CTX)).st_ino
    return ino


async def open_path(ops, ino: int, rel: str) -> tuple[int, pyfuse3.FileInfo]:
    """Open node `ino`, found by `rel`, as the kernel does: on ESTALE (the path leads
    elsewhere now, or the kernel's inode is an older version than the node's) it looks
    the names up again and opens once more (the VFS's LOOKUP_REVAL retry). The node
    opened, and the handle."""
    try:
        return ino, await ops.open(ino, os.O_RDONLY, CTX)
    except pyfuse3.FUSEError as exc:
        if exc.errno != errno.ESTALE:
            raise
    ino = await lookup_path(ops, rel)
    return ino, await ops.open(ino, os.O_RDONLY, CTX)


async def read_all(ops, ino: int) -> bytes:
    fi = await ops.open(ino, os.O_RDONLY, CTX)
    out = b""
    while True:
        chunk = bytes(await ops.read(fi.fh, len(out), 65536))
        if not chunk:
            break
        out += chunk
    await ops.release(fi.fh)
    return out


async def readdir_names(ops, ino: int) -> list[bytes]:
    names: list[bytes] = []
    fh = await ops.opendir(ino, CTX)
    orig = pyfuse3.readdir_reply
    try:
        pyfuse3.readdir_reply = lambda token, name, attr, off: names.append(name) or True
        await ops.readdir(fh, 0, None)
    finally:
        pyfuse3.readdir_reply = orig
    return [n for n in names if n not in (b".", b"..")]


async def test_lookup_getattr_read_and_stable_inodes(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"a/b/c.bin": os.urandom(5000), "top.txt": b"x"})
    ops, svc = make_fs(src)
    ino = await lookup_path(ops, "a/b/c.bin")
    attrs = await ops.getattr(ino, CTX)
    assert attrs.st_size == 5000
    assert attrs.st_mtime_ns == (src / "a/b/c.bin").stat().st_mtime_ns
    assert await read_all(ops, ino) == (src / "a/b/c.bin").read_bytes()
    # Forgotten and looked up again: the same inode number.
    await ops.forget([(ino, 1)])
    assert ino not in svc.namespace.table
    assert await lookup_path(ops, "a/b/c.bin") == ino
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.lookup(ROOT_INODE, b"missing", CTX)
    assert e.value.errno == errno.ENOENT


async def test_forget_bounds_the_table(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {f"d/f{i}": b"." for i in range(200)})
    ops, svc = make_fs(src)
    d = await lookup_path(ops, "d")
    names = await readdir_names(ops, d)
    assert len(names) == 200
    ns = svc.namespace
    assert len(ns.table) == 202  # root, d, 200 files counted by readdirplus
    await ops.forget([(ns.numbers.ino_of((src / "d" / n.decode()).lstat()), 1) for n in names])
    assert len(ns.table) == 2


async def test_control_dir_hidden_but_reachable(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"cls/a.png": b"1"})
    ops, _ = make_fs(src)
    names = await readdir_names(ops, ROOT_INODE)
    assert names == [b"cls"]
    attrs = await ops.lookup(ROOT_INODE, NAME, CTX)
    assert attrs.st_ino == DIR_INODE and attrs.st_mode & 0o777 == 0o700
    assert sorted(await readdir_names(ops, DIR_INODE)) == sorted(
        [
            b"ctl",
            b"stats",
            b"stats.json",
            b"metrics",
            b"dataset",
            b"losses",
            b"order",
            b"residency",
            b"plan",
        ]
    )
    stats_ino = (await ops.lookup(DIR_INODE, b"stats.json", CTX)).st_ino
    stats = json.loads(await read_all(ops, stats_ino))
    for key in (
        "pid", "hits", "misses", "hit_ratio", "bytes_served", "bytes_from_source",
        "ram_bytes", "ram_capacity", "files_cached", "policy",
    ):  # fmt: skip
        assert key in stats
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.open(stats_ino, os.O_RDONLY, FakeCtx(uid=12345))
    assert e.value.errno == errno.EACCES


async def test_hits_misses_and_budget(tmp_path: Path) -> None:
    files = {f"f{i}": os.urandom(1000) for i in range(10)}
    src = make_tree(tmp_path / "src", files)
    ops, svc = make_fs(src, ram=4000, max_entry=1000)
    cache, metrics = svc.cache, svc.metrics
    inos = [await lookup_path(ops, name) for name in files]
    for ino, data in zip(inos, files.values(), strict=True):
        assert await read_all(ops, ino) == data
        assert cache.used <= 4000
    assert metrics.misses == 10 and metrics.hits == 0
    assert len(cache.entries) == 4  # the epoch policy keeps the first four it saw
    for ino in inos:
        await read_all(ops, ino)
    assert metrics.hits == 4 and metrics.misses == 16
    assert svc.source.bytes_read == 16 * 1000


async def test_large_file_passes_through(tmp_path: Path) -> None:
    big = os.urandom(300_000)
    src = make_tree(tmp_path / "src", {"big": big})
    # Above the operator's --passthrough-above (by default a file larger than the budget
    # is cached in part: tests/test_random_reads.py).
    ops, svc = make_fs(src, ram=100_000, passthrough_above=200_000)
    ino = await lookup_path(ops, "big")
    assert await read_all(ops, ino) == big
    assert svc.cache.used == 0
    assert svc.metrics.passthrough_opens == 1


async def test_concurrent_misses_fetch_once(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"f": os.urandom(10_000)})
    ops, svc = make_fs(src, ram=1 << 20)
    source = svc.source
    ino = await lookup_path(ops, "f")
    real = source.read_file
    calls = 0
    answer = trio.Event()

    async def slow_read(rel: bytes, size: int | None = None):
        nonlocal calls
        calls += 1
        await answer.wait()  # the source answers once every reader waits
        return await real(rel, size)

    source.read_file = slow_read
    datas: list[bytes] = []

    async def reader() -> None:
        datas.append(await read_all(ops, ino))

    async with trio.open_nursery() as n:
        for _ in range(8):
            n.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        assert calls == 1 and not datas  # one fetch, which the other seven opens joined
        answer.set()
    assert calls == 1 and len(datas) == 8
    assert svc.cache.shared_fetches == 7
    assert all(d == (src / "f").read_bytes() for d in datas)


async def test_write_operations_fail_with_erofs(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"f": b"data"})
    ops, _ = make_fs(src)
    ino = await lookup_path(ops, "f")
    for coro in (
        ops.open(ino, os.O_WRONLY, CTX),
        ops.open(ino, os.O_RDWR, CTX),
        ops.mkdir(ROOT_INODE, b"d", 0o755, CTX),
        ops.unlink(ROOT_INODE, b"f", CTX),
        ops.rename(ROOT_INODE, b"f", ROOT_INODE, b"g", 0, CTX),
        ops.create(ROOT_INODE, b"new", 0o644, os.O_WRONLY, CTX),
        ops.symlink(ROOT_INODE, b"l", b"f", CTX),
        ops.setxattr(ino, b"user.x", b"1", CTX),
    ):
        with pytest.raises(pyfuse3.FUSEError) as e:
            await coro
        assert e.value.errno == errno.EROFS
    assert (src / "f").read_bytes() == b"data"


async def test_ctl_validates_whole_write(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {f"f{i}": b"x" * 100 for i in range(5)})
    ops, svc = make_fs(src, ram=10_000)
    cache = svc.cache
    for i in range(5):
        await read_all(ops, await lookup_path(ops, f"f{i}"))
    ctl = (await ops.lookup(DIR_INODE, b"ctl", CTX)).st_ino
    fi = await ops.open(ctl, os.O_WRONLY, CTX)
    for bad in (b"ram 1G\nbogus\n", b"ram -5\n", b"policy nope\n", b"drop now\n", b"\xff\n", b""):
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.write(fi.fh, 0, bad)
        assert e.value.errno == errno.EINVAL
    assert cache.capacity == 10_000 and len(cache.entries) == 5 and cache.policy.name == "epoch"
    assert await ops.write(fi.fh, 0, b"policy lru\nram 250\n") == len(b"policy lru\nram 250\n")
    assert cache.policy.name == "lru" and cache.capacity == 250 and cache.used <= 250
    await ops.write(fi.fh, 0, b"drop\n")
    assert cache.used == 0 and not cache.entries
    await ops.release(fi.fh)
