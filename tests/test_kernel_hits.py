"""Kernel hits (FUSE no-open) driven through the handlers: what a READ that names an inode
gets, the control directory's sessions, and the choice of mode (kernel/no_open.py)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pyfuse3
import pytest
import trio
import trio.testing

from shadefs.control.entries import DIR_INODE, SESSION_BASE
from shadefs.control.files import PLAN_QUIET
from shadefs.kernel import no_open
from shadefs.sampling import wire
from tests.conftest import FakeCtx, make_tree
from tests.test_fs_api import lookup_path, make_fs

CTX = FakeCtx(pid=4242)


def _src(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    files = {f"c{i % 3}/f{i:02d}.bin": os.urandom(3000 + 500 * i) for i in range(12)}
    return make_tree(tmp_path / "src", files), files


async def test_every_open_answers_enosys(tmp_path: Path) -> None:
    src, files = _src(tmp_path)
    ops, _ = make_fs(src, kernel_hits="on")
    ino = await lookup_path(ops, "c0/f00.bin")
    with pytest.raises(pyfuse3.FUSEError) as exc:
        await ops.open(ino, os.O_RDONLY, CTX)
    assert exc.value.errno == errno.ENOSYS


async def test_a_read_names_the_inode_and_a_second_read_is_a_hit(tmp_path: Path) -> None:
    src, files = _src(tmp_path)
    ops, svc = make_fs(src, ram=1 << 20, kernel_hits="on", prefetch=False)
    for rel, data in files.items():
        ino = await lookup_path(ops, rel)
        assert bytes(await ops.read(ino, 0, 1 << 20)) == data
        assert bytes(await ops.read(ino, 100, 50)) == data[100:150]  # no count: not at 0
    m = svc.metrics
    assert (m.hits, m.misses) == (0, len(files))
    for rel, data in files.items():  # the kernel lost the pages: served from RAM
        assert bytes(await ops.read(await lookup_path(ops, rel), 0, 1 << 20)) == data
    svc.cache.take_hits()
    assert (m.hits, m.misses) == (len(files), len(files))
    assert svc.source.describe().bytes_read == sum(map(len, files.values()))
    assert svc.cache.handles.describe(0, 0).open == 0  # no handle outlives its read


async def test_a_new_version_at_the_first_read_is_estale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ESTALE, and only once the kernel dropped the name's dentry: the kernel does not
    retry a READ, so the reader's next open would walk that dentry to the retired node."""
    src, files = _src(tmp_path)
    ops, _ = make_fs(src, kernel_hits="on")
    ino = await lookup_path(ops, "c1/f01.bin")
    dropped: list[bytes] = []

    def invalidate_entry(parent: int, name: bytes) -> None:
        dropped.append(name)

    monkeypatch.setattr(pyfuse3, "invalidate_entry", invalidate_entry)
    (src / "c1" / "f01.bin").write_bytes(b"a longer new version" * 1000)
    with pytest.raises(pyfuse3.FUSEError) as exc:
        await ops.read(ino, 0, 1 << 20)  # never the new bytes under the old node's size
    assert exc.value.errno == errno.ESTALE
    assert dropped == [b"f01.bin"]


async def test_writes_to_data_files_fail_erofs(tmp_path: Path) -> None:
    src, _ = _src(tmp_path)
    ops, _ = make_fs(src, kernel_hits="on")
    ino = await lookup_path(ops, "c0/f00.bin")
    with pytest.raises(pyfuse3.FUSEError) as exc:
        await ops.write(ino, 0, b"x")
    assert exc.value.errno == errno.EROFS


async def _session(ops, name: bytes) -> int:
    ino = (await ops.lookup(DIR_INODE, name, CTX)).st_ino
    assert ino >= SESSION_BASE
    return ino


async def test_each_control_lookup_is_a_session_of_its_own(tmp_path: Path) -> None:
    src, files = _src(tmp_path)
    ops, svc = make_fs(src, kernel_hits="on")
    a, b = await _session(ops, b"stats"), await _session(ops, b"stats")
    assert a != b
    attrs = await ops.getattr(a, CTX)
    assert attrs.entry_timeout == 0 and attrs.st_size > 0  # its size bounds the reads
    text = bytes(await ops.read(a, 0, 1 << 20))
    assert len(text) == attrs.st_size and b"kernel hits on" in text
    # ctl: the writer's pid is the looking-up process's
    ctl = await _session(ops, b"ctl")
    await ops.write(ctl, 0, b"job sweep-a group=g\n")
    assert svc.readers.jobs.pids[CTX.pid].id == "sweep-a"
    with pytest.raises(pyfuse3.FUSEError) as exc:
        await ops.write(ctl, 0, b"ram lots\n")
    assert exc.value.errno == errno.EINVAL
    await ops.forget([(a, 1), (b, 1), (ctl, 1)])
    with pytest.raises(pyfuse3.FUSEError):
        await ops.getattr(a, CTX)  # a forgotten session is gone


async def test_an_order_request_and_its_response_on_one_session(tmp_path: Path) -> None:
    src, files = _src(tmp_path)
    ops, svc = make_fs(src, kernel_hits="on", policy="shade")
    ds = await _session(ops, b"dataset")
    await ops.write(ds, 0, wire.encode_dataset(sorted(files)))
    order = await _session(ops, b"order")
    req = wire.encode_order_request(epoch=0, rank=0, world_size=1, seed=1)
    await ops.write(order, 0, req)
    size = (await ops.getattr(order, CTX)).st_size
    resp = bytes(await ops.read(order, len(req), size))  # read straight on, as clients do
    epoch, indices = wire.decode_order_response(resp)
    assert epoch == 0 and sorted(indices.tolist()) == list(range(len(files)))
    assert size == len(req) + len(resp)


async def test_a_plan_is_installed_once_its_writer_is_quiet(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """No close is seen: a plan is installed once no plan was written for PLAN_QUIET, as
    far as written, and whole once its last part came."""
    src, files = _src(tmp_path)
    ops, svc = make_fs(src, kernel_hits="on")
    assert svc.prefetcher is not None
    plan = await _session(ops, b"plan")
    text = "".join(f"{r}\n" for r in sorted(files)).encode()
    cut = text.index(b"\n", len(text) // 2) + 1
    async with trio.open_nursery() as nursery:
        nursery.start_soon(svc.control.run)
        await ops.write(plan, 0, text[:cut])
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(PLAN_QUIET / 2)
        await ops.write(plan, cut, text[cut:])  # the writer goes on
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(PLAN_QUIET * 0.75)  # quiet since the first part, not the last
        await trio.testing.wait_all_tasks_blocked()
        assert not svc.prefetcher.plans
        mock_clock.jump(PLAN_QUIET * 0.5)
        await trio.testing.wait_all_tasks_blocked()
        (installed,) = svc.prefetcher.plans.values()
        assert sorted(installed.paths) == sorted(r.encode() for r in files)
        nursery.cancel_scope.cancel()


async def test_a_plan_is_installed_before_the_next_read(tmp_path: Path) -> None:
    src, files = _src(tmp_path)
    ops, svc = make_fs(src, kernel_hits="on")
    plan = await _session(ops, b"plan")
    await ops.write(plan, 0, "".join(f"{r}\n" for r in sorted(files)).encode())
    assert svc.prefetcher is not None and not svc.prefetcher.plans
    await ops.read(await lookup_path(ops, "c0/f00.bin"), 0, 4096)  # no close is ever seen
    assert svc.prefetcher.plans


def test_a_stock_pyfuse3_keeps_opens_and_says_why_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delattr(pyfuse3, "NO_OPEN_FH_IS_INODE", raising=False)
    with caplog.at_level(logging.INFO, logger="shadefs"):
        assert no_open.resolve("on") is False
        assert no_open.resolve("off") is False
    lines = [r for r in caplog.records if "kernel hits" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "kernel hits are off" in lines[0].getMessage()


def test_the_patched_pyfuse3_is_installed() -> None:
    # make setup builds it (tools/install-pyfuse3.sh): the mount tests need it in CI.
    assert no_open.supported(), "pyfuse3 lacks the no-open patch: run `make pyfuse3`"
    assert no_open.resolve("auto") and not no_open.resolve("off")
