"""A miss answered before its fetch (cache/deferred.py), at the handlers: the
kernel may hold the pages of a file opened before, so its next miss fetches only when a
read reaches the daemon, and never serves another version than the open answered."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pyfuse3
import pytest
import trio
import trio.testing

from tests.conftest import make_tree
from tests.test_fs_api import CTX, lookup_path, make_fs, open_path, read_all

OLD, NEW = b"o" * 100_000, b"n" * 100_000


async def evicted(tmp_path: Path, files: dict[str, bytes], **kw):
    """Handlers over `files`, each read once whole (the kernel may hold their pages) and
    then dropped from RAM: (ops, service, inodes)."""
    src = make_tree(tmp_path / "src", files)
    ops, svc = make_fs(src, ram=kw.pop("ram", 8 << 20), **kw)
    inos = [await lookup_path(ops, name) for name in files]
    for ino, data in zip(inos, files.values(), strict=True):
        assert await read_all(ops, ino) == data
    svc.cache.drop()
    return ops, svc, inos


async def test_a_reopen_whose_reads_the_kernel_serves_fetches_nothing(tmp_path: Path) -> None:
    ops, svc, (ino,) = await evicted(tmp_path, {"f": OLD})
    fetched, misses = svc.source.bytes_read, svc.metrics.misses
    fi = await ops.open(ino, os.O_RDONLY, CTX)
    # Answered with the kernel's pages (the version looked up, checked by one lstat).
    assert fi.keep_cache and not fi.direct_io
    await ops.release(fi.fh)  # the kernel served every read from its pages
    assert svc.source.bytes_read == fetched
    assert svc.metrics.misses == misses + 1  # still a miss for the policies and counters
    h = svc.cache.describe().handles
    assert (h.deferred, h.unread, h.bytes, h.open) == (1, 1, 0, 0)
    # ... and a kernel hit: served without a fetch, in the hit ratio beside the tier hits.
    s = svc.stats()
    assert s.counters.kernel_hits == 1 and s.counters.hits == 0
    assert s.hit_ratio == 1 / s.opens
    assert s.to_json()["kernel_hits"] == 1


async def test_the_first_read_fetches_once_and_later_opens_hit(tmp_path: Path) -> None:
    ops, svc, (ino,) = await evicted(tmp_path, {"f": OLD})
    fetched = svc.source.bytes_read
    fi = await ops.open(ino, os.O_RDONLY, CTX)
    assert svc.source.bytes_read == fetched
    assert bytes(await ops.read(fi.fh, 10, 20)) == OLD[10:30]
    assert bytes(await ops.read(fi.fh, 0, len(OLD))) == OLD
    assert svc.source.bytes_read == fetched + len(OLD)
    assert svc.cache.handles.held == 0  # admitted: the handle holds nothing outside RAM
    await ops.release(fi.fh)
    assert svc.cache.describe().handles.unread == 0
    assert svc.metrics.kernel_hits == 0  # a read reached the daemon: a miss, fetched
    hits = svc.metrics.hits
    assert await read_all(ops, ino) == OLD and svc.metrics.hits == hits + 1


async def test_concurrent_first_reads_of_a_handle_share_one_fetch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ops, svc, (ino,) = await evicted(tmp_path, {"f": OLD})
    fi = await ops.open(ino, os.O_RDONLY, CTX)
    gate = trio.Event()
    real = svc.source.read_file
    calls = []

    async def slow_read(rel: bytes, size: int | None = None):
        calls.append(rel)
        await gate.wait()
        return await real(rel, size)

    monkeypatch.setattr(svc.source, "read_file", slow_read)
    got: dict[int, bytes] = {}

    async def read_at(off: int) -> None:
        got[off] = bytes(await ops.read(fi.fh, off, 1000))

    async with trio.open_nursery() as nursery:
        for off in (0, 50_000, 99_500):
            nursery.start_soon(read_at, off)
        await trio.testing.wait_all_tasks_blocked()
        assert len(calls) == 1  # one fetch, the other reads wait for it
        gate.set()
    assert got == {0: OLD[:1000], 50_000: OLD[50_000:51_000], 99_500: OLD[99_500:]}
    await ops.release(fi.fh)
    assert svc.cache.handles.held == 0 and svc.cache.handles.handles == 0


async def test_a_change_before_the_open_is_served_whole_without_the_old_pages(
    tmp_path: Path,
) -> None:
    ops, svc, (ino,) = await evicted(tmp_path, {"f": OLD})
    (tmp_path / "src" / "f").write_bytes(NEW + b"+")  # within --revalidate: the row is old
    with pytest.raises(pyfuse3.FUSEError) as e:  # the open's lstat saw the change: the
        await ops.open(ino, os.O_RDONLY, CTX)  # kernel looks it up again (a new inode)
    assert e.value.errno == errno.ESTALE
    new = await lookup_path(ops, "f")  # the kernel's retry: a new node, whose inode and
    assert new != ino  # pages are new too
    fi = await ops.open(new, os.O_RDONLY, CTX)
    assert bytes(await ops.read(fi.fh, 0, 200_000)) == NEW + b"+"
    assert svc.namespace.stat(new).st_size == len(NEW) + 1
    await ops.release(fi.fh)
    assert svc.cache.describe().handles.deferred == 0


async def test_a_change_between_the_open_and_its_first_read_is_eio_never_a_mix(
    tmp_path: Path,
) -> None:
    ops, svc, (ino,) = await evicted(tmp_path, {"f": OLD})
    fi = await ops.open(ino, os.O_RDONLY, CTX)
    assert fi.keep_cache  # the kernel may serve this handle pages of OLD ...
    (tmp_path / "src" / "f").write_bytes(NEW)
    for off in (60_000, 0):  # ... so NEW is never served to it, now or on a retry
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.read(fi.fh, off, 4096)
        assert e.value.errno == errno.EIO
    await ops.release(fi.fh)
    # The node stays the old version; its next open is ESTALE, and the kernel's retry
    # opens the new version as a new node.
    assert svc.namespace.stat(ino).st_size == len(OLD)
    new, fi = await open_path(ops, ino, "f")
    assert new != ino
    assert bytes(await ops.read(fi.fh, 0, len(NEW))) == NEW
    await ops.release(fi.fh)
    h = svc.cache.describe().handles
    assert (h.bytes, h.open, h.unread) == (0, 0, 0)


async def test_a_file_removed_before_its_first_read_is_estale(tmp_path: Path) -> None:
    ops, svc, (ino,) = await evicted(tmp_path, {"d/f": OLD})
    fi = await ops.open(ino, os.O_RDONLY, CTX)
    (tmp_path / "src" / "d" / "f").unlink()
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.read(fi.fh, 0, 4096)
    assert e.value.errno == errno.ESTALE
    await ops.release(fi.fh)
    assert svc.cache.handles.held == 0


async def test_a_first_open_fetches_at_open(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"f": OLD})
    ops, svc = make_fs(src, ram=8 << 20)
    ino = await lookup_path(ops, "f")
    fi = await ops.open(ino, os.O_RDONLY, CTX)  # never opened: the kernel holds no pages
    assert svc.source.bytes_read == len(OLD)  # fetched at open, one source call
    await ops.release(fi.fh)
    assert svc.cache.describe().handles.deferred == 0


async def test_a_forgotten_inode_fetches_at_open_again(tmp_path: Path) -> None:
    ops, svc, (ino,) = await evicted(tmp_path, {"f": OLD})
    await ops.forget([(ino, 1)])  # the kernel dropped the inode, and its pages
    ino = await lookup_path(ops, "f")
    fetched = svc.source.bytes_read
    fi = await ops.open(ino, os.O_RDONLY, CTX)
    assert svc.source.bytes_read == fetched + len(OLD)
    await ops.release(fi.fh)


async def test_deferred_opens_count_against_the_handle_limit(tmp_path: Path) -> None:
    files = {f"f{i}": bytes([i]) * 100_000 for i in range(3)}
    ops, svc, inos = await evicted(tmp_path, files, ram=8 << 20, handle_limit=250_000)
    a = await ops.open(inos[0], os.O_RDONLY, CTX)
    b = await ops.open(inos[1], os.O_RDONLY, CTX)
    assert svc.cache.handles.held == 200_000  # reserved for their first reads
    c = await ops.open(inos[2], os.O_RDONLY, CTX)  # past the limit: read through
    assert svc.cache.handle_passthrough == 1
    assert bytes(await ops.read(c.fh, 0, 10)) == files["f2"][:10]
    assert bytes(await ops.read(a.fh, 0, 10)) == files["f0"][:10]
    for fi in (a, b, c):
        await ops.release(fi.fh)
    h = svc.cache.describe().handles
    assert (h.bytes, h.deferred, h.unread) == (0, 2, 1)


async def test_an_empty_file_is_fetched_at_open_since_no_read_comes(tmp_path: Path) -> None:
    ops, svc, (ino,) = await evicted(tmp_path, {"e": b""})
    fi = await ops.open(ino, os.O_RDONLY, CTX)
    await ops.release(fi.fh)
    assert svc.cache.tier_of(ino) == 1 and svc.cache.describe().handles.deferred == 0


def test_opens_are_deferred_rarely_while_the_kernel_keeps_no_pages() -> None:
    # A deferred open costs a version check before the fetch its read needs anyway: while
    # most deferred opens were read (the kernel's pages gone), only a probe is deferred.
    from shadefs.kernel.pages import _PROBE, KernelPages

    kernel = KernelPages()
    assert all(kernel.worth_deferring() for _ in range(100))  # trusted: every one
    for _ in range(40):
        kernel.served(False)
    asked = [kernel.worth_deferring() for _ in range(4 * _PROBE)]
    assert sum(asked) == 4  # one in _PROBE, so that `held` stays measured
    for _ in range(40):
        kernel.served(True)  # the probes found the kernel's pages again
    assert kernel.worth_deferring() and kernel.trusted
