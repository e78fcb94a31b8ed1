"""The hit path's verified reopens (fs/namespace.py, `Operations.open`): a reopen of a file
verified in RAM skips the namespace, yet counts, pins and serves as any hit, and whatever
changes the node, its entry or its check sends the open back through the full path."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pyfuse3
import pytest

from tests.conftest import FakeClock, make_tree
from tests.test_fs_api import CTX, lookup_path, make_fs, open_path


async def _open_read_release(ops, ino: int) -> bytes:
    fh = (await ops.open(ino, os.O_RDONLY, CTX)).fh
    try:
        return bytes(await ops.read(fh, 0, 1 << 16))
    finally:
        await ops.release(fh)


def _no_namespace(ns) -> None:
    def opening(ino: int) -> None:
        raise AssertionError("a verified reopen asked the namespace")

    ns.opening = opening


async def test_a_reopen_is_a_hit_without_the_namespace_and_counts_as_one(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"d/f": b"x" * 5000})
    ops, svc = make_fs(src)
    ino = await lookup_path(ops, "d/f")
    assert await _open_read_release(ops, ino) == b"x" * 5000  # the miss verifies its entry
    assert ino in svc.namespace.verified
    cache = svc.cache
    hits, reads = svc.metrics.hits, cache.readers.tracker.count[0]
    _no_namespace(svc.namespace)
    fh = (await ops.open(ino, os.O_RDONLY, CTX)).fh
    assert cache.handles.handles == 1  # pinned until released, as any hit
    assert bytes(await ops.read(fh, 0, 100)) == b"x" * 100
    await ops.release(fh)
    assert cache.handles.handles == 0
    assert svc.metrics.hits == hits + 1 and cache.ram_hits >= 1
    job = cache.readers.jobs.job_of(CTX.pid)
    assert job.hits == 1 and job.bytes == 2 * 5000  # the miss, then the hit
    assert cache.readers.tracker.count[0] == reads  # a reopen of the file read last: one read


async def test_an_evicted_entry_is_fetched_again_by_the_full_path(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"d/f": b"abc"})
    ops, svc = make_fs(src)
    ino = await lookup_path(ops, "d/f")
    await _open_read_release(ops, ino)
    assert await svc.cache.evict(ino)
    assert ino not in svc.namespace.verified  # the record left with its entry
    misses = svc.metrics.misses
    assert await _open_read_release(ops, ino) == b"abc"
    assert svc.metrics.misses == misses + 1  # (deferred: the kernel may hold its pages)
    assert await _open_read_release(ops, ino) == b"abc"
    assert ino in svc.cache.entries and ino in svc.namespace.verified


async def test_a_changed_file_is_served_in_its_new_version_once_checked(tmp_path: Path) -> None:
    clock = FakeClock()  # (the fs part's: a --revalidate period passes without a sleep)
    src = make_tree(tmp_path / "src", {"d/f": b"1"})
    ops, svc = make_fs(src, revalidate=0.3, clock=clock)
    ino = await lookup_path(ops, "d/f")
    for _ in range(2):
        assert await _open_read_release(ops, ino) == b"1"
    (src / "d" / "f").write_bytes(b"changed")
    assert await _open_read_release(ops, ino) == b"1"  # within --revalidate: as looked up
    clock.advance(0.4)
    # The check was due: ESTALE, and the kernel's retry finds the new version: a new node.
    new, fi = await open_path(ops, ino, "d/f")
    assert new != ino and bytes(await ops.read(fi.fh, 0, 100)) == b"changed"
    await ops.release(fi.fh)
    assert ino not in svc.namespace.verified
    assert await _open_read_release(ops, new) == b"changed"
    assert svc.namespace.verified[new][0].sig.size == 7


async def test_a_forget_or_a_forced_check_drops_the_record(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"d/f": b"1", "d/g": b"2"})
    ops, svc = make_fs(src)
    ns = svc.namespace
    f, g = await lookup_path(ops, "d/f"), await lookup_path(ops, "d/g")
    await lookup_path(ops, "d/g")  # a second reference: one forget leaves the node
    for ino in (f, g):
        await _open_read_release(ops, ino)
    changes = ns.changes
    await ops.forget([(f, 1)])
    assert f not in ns.verified and g in ns.verified and ns.changes > changes
    await ops.forget([(g, 1)])  # (the kernel still holds one: its pages may be gone)
    assert g not in ns.verified and g in ns.table
    await _open_read_release(ops, g)
    await ns.fresh_stat(g, force=True)  # unchanged: the record stays true
    assert g in ns.verified
    (src / "d" / "g").write_bytes(b"22")
    await ns.fresh_stat(g, force=True)
    assert g not in ns.verified
    new, fi = await open_path(ops, g, "d/g")  # ESTALE: the new version is a new node
    assert new != g and bytes(await ops.read(fi.fh, 0, 100)) == b"22"
    await ops.release(fi.fh)


async def test_a_write_open_of_a_verified_file_is_refused(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"d/f": b"1"})
    ops, svc = make_fs(src)
    ino = await lookup_path(ops, "d/f")
    await _open_read_release(ops, ino)
    assert ino in svc.namespace.verified
    with pytest.raises(pyfuse3.FUSEError) as exc:
        await ops.open(ino, os.O_WRONLY, CTX)
    assert exc.value.errno == errno.EROFS
