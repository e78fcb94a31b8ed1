"""Open handles keep evicted bytes alive: counted, visible in stats.json, and bounded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shadefs.cache.handles import HandleLedger
from tests.conftest import FakeCtx, make_tree, poll
from tests.test_fs_api import lookup_path, make_fs

CTX = FakeCtx()
SIZE = 400


def test_the_ledger_counts_each_object_once_and_only_outside_the_tier() -> None:
    ledger = HandleLedger()
    a, b = bytes(100), bytes(300)
    ledger.pin(a, resident=True)
    ledger.pin(a, resident=True)  # a second handle on the same bytes
    assert (ledger.held, ledger.handles) == (0, 2)
    ledger.evicted(a)
    assert ledger.held == 100  # once, however many handles hold it
    ledger.pin(b, resident=False)  # never admitted (refused, or read past the budget)
    assert ledger.held == 400
    ledger.admitted(a)  # back in the tier: no longer memory outside the budget
    assert ledger.held == 300
    ledger.unpin(a)
    ledger.unpin(a)
    ledger.unpin(b)
    assert (ledger.held, ledger.handles) == (0, 0)
    ledger.evicted(a)  # unknown objects are ignored
    ledger.unpin(a)
    assert (ledger.held, ledger.handles) == (0, 0)


def _tree(tmp_path: Path, n: int) -> Path:
    return make_tree(tmp_path / "src", {f"f{i:03d}": bytes([i % 251]) * SIZE for i in range(n)})


async def test_handles_past_the_limit_read_through(tmp_path: Path) -> None:
    src = _tree(tmp_path, 20)
    # The RAM tier holds two files; open handles may keep three more alive.
    ops, svc = make_fs(src, ram=2 * SIZE, max_entry=SIZE, handle_limit=3 * SIZE, policy="lru")
    cache = svc.cache
    fhs = []
    for i in range(20):
        ino = await lookup_path(ops, f"f{i:03d}")
        fi = await ops.open(ino, os.O_RDONLY, CTX)
        fhs.append(fi.fh)
        # However many handles are open, what they keep outside the budget stays bounded.
        assert cache.handles.held <= cache.handle_limit
        assert cache.used <= cache.capacity
    # LRU admits every file: f0-f1 fill the tier, f2-f4 each evict an older open one (3 files
    # held outside the budget: the limit), and f5-f19 are read through.
    s = svc.stats().cache.handles
    assert (s.open, s.bytes, s.limit, s.passthrough_opens) == (5, 3 * SIZE, 3 * SIZE, 15)
    # Every handle still reads its own file's bytes, pinned or read through.
    for i, fh in enumerate(fhs):
        assert bytes(await ops.read(fh, 0, SIZE + 10)) == bytes([i % 251]) * SIZE
    for fh in fhs:
        await ops.release(fh)
    s = svc.stats().cache.handles
    assert (s.bytes, s.open) == (0, 0)


async def test_the_default_limit_is_the_ram_budget(tmp_path: Path) -> None:
    src = _tree(tmp_path, 2)
    _, svc = make_fs(src, ram=10 * SIZE)
    assert svc.cache.handle_limit == 10 * SIZE
    svc.cache.set_capacity(4 * SIZE)
    assert svc.stats().cache.handles.limit == 4 * SIZE


@pytest.mark.mount
def test_many_open_files_through_a_mount_stay_bounded(tmp_path: Path, mounter) -> None:
    n = 300
    src = _tree(tmp_path, n)
    m = mounter(src, "--ram", str(20 * SIZE), "--handle-limit", str(40 * SIZE), "--policy", "lru")
    fds = [os.open(m.mnt / f"f{i:03d}", os.O_RDONLY) for i in range(n)]
    try:
        h = m.stats()["handles"]
        assert h["limit"] == 40 * SIZE
        assert h["bytes"] <= 40 * SIZE
        if m.no_open:  # the kernel opened them all; the daemon holds nothing until a read
            assert (h["open"], h["bytes"]) == (0, 0)
        else:
            assert h["passthrough_opens"] > 0
        for i, fd in enumerate(fds):
            assert os.pread(fd, SIZE + 10, 0) == bytes([i % 251]) * SIZE
    finally:
        for fd in fds:
            os.close(fd)
    # The kernel sends RELEASE after close() has returned: wait for the last ones.
    h = poll(lambda: (h := m.stats()["handles"])["open"] == 0 and h, "handles still open", 10)
    assert (h["bytes"], h["open"]) == (0, 0)
