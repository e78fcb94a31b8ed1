"""The cache as the file system sees it (cache/face.py): one `open`, one result that says
where the bytes are, and the version decided there (no mount)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shadefs.cache.face import CacheFace
from shadefs.file_version import Changed, Signature
from tests.conftest import make_tree
from tests.test_fs_api import make_fs

DATA = b"x" * 1000
KEY = 7  # (any key: the face opens what it is given)


def _face(tmp_path: Path, files: dict[str, bytes], **kw):
    src = make_tree(tmp_path / "src", files)
    ops, svc = make_fs(src, **kw)
    assert isinstance(ops.cache, CacheFace)
    return ops.cache, svc, src


def _a(tmp_path: Path):
    """A face over one file `a` of DATA, and its stat: (face, service, src, stat)."""
    face, svc, src = _face(tmp_path, {"a": DATA})
    return face, svc, src, os.lstat(src / "a")


async def _open(face: CacheFace, rel: str, st: os.stat_result, lazy: bool = False):
    return await face.open(KEY, rel.encode(), st, 1, lazy=lazy, sig=Signature.of(st))


async def test_a_miss_a_hit_and_a_deferred_miss_each_say_where_their_bytes_are(
    tmp_path: Path,
) -> None:
    face, svc, src, st = _a(tmp_path)
    miss = await _open(face, "a", st)
    assert miss.data == DATA and miss.later is None and miss.block is None and miss.keep
    hit = await _open(face, "a", st, lazy=True)  # resident: a hit, never deferred
    assert hit.data is miss.data and svc.metrics.hits == 1
    for got in (miss, hit):
        assert got.data is not None
        face.unpin(got.data)
    assert svc.cache.handles.handles == 0
    svc.cache.drop()
    fetched = svc.source.bytes_read
    later = await _open(face, "a", st, lazy=True)
    assert later.data is None and later.later is not None and later.keep
    assert svc.source.bytes_read == fetched  # nothing fetched before the first read
    view = await later.later.read()
    assert bytes(view) == DATA and svc.source.bytes_read == fetched + len(DATA)
    face.unpin(view.obj)  # type: ignore[arg-type]


async def test_another_version_at_the_source_raises_changed_and_pins_nothing(
    tmp_path: Path,
) -> None:
    face, svc, src, st = _a(tmp_path)
    (src / "a").write_bytes(b"new version")
    with pytest.raises(Changed):
        await _open(face, "a", st)
    assert svc.cache.handles.handles == 0 and svc.cache.handles.held == 0


async def test_a_deferred_first_read_of_another_version_raises_changed_every_time(
    tmp_path: Path,
) -> None:
    face, svc, src, st = _a(tmp_path)
    got = await _open(face, "a", st)
    assert got.data is not None
    face.unpin(got.data)
    svc.cache.drop()
    later = (await _open(face, "a", st, lazy=True)).later
    assert later is not None
    later.answered()
    (src / "a").write_bytes(b"y" * len(DATA) + b"!")
    for _ in range(2):  # sticky: the kernel may have served this handle old pages
        with pytest.raises(Changed):
            await later.read()
    later.drop()
    assert svc.metrics.kernel_hits == 0  # a read came: not served by the kernel
    assert svc.cache.handles.handles == 0 and svc.cache.handles.held == 0


async def test_a_large_file_is_opened_in_blocks_or_read_through(tmp_path: Path) -> None:
    big = os.urandom(600_000)
    face, svc, src = _face(tmp_path, {"big": big}, ram=1 << 20, block_size=64 << 10)
    st = os.lstat(src / "big")
    assert st.st_size > svc.cache.ram_max
    got = await _open(face, "big", st)
    assert got.data is None and got.later is None and got.block is not None
    assert await face.read_block(got.block, 1000, 100) == big[1000:1100]
    await face.release_block(got.block)
    face, svc, src = _face(tmp_path / "2", {"big": big}, ram=1 << 20, passthrough_above=1)
    through = await _open(face, "big", os.lstat(src / "big"))
    assert (through.data, through.later, through.block, through.keep) == (None, None, None, False)


async def test_the_hit_path_serves_only_what_an_open_verified_until_its_check_is_due(
    tmp_path: Path,
) -> None:
    face, svc, src, st = _a(tmp_path)
    sig = Signature.of(st)
    got = await _open(face, "a", st)
    assert got.data is not None
    face.unpin(got.data)
    assert face.reopen(KEY, 1) is None  # nothing verified yet
    face.verify(KEY, got.data, sig, b"elsewhere", until=10.0)  # another path: not recorded
    assert face.verified_bytes(KEY) is None
    now = svc.namespace.clock()
    face.verify(KEY, got.data, sig, b"a", until=now + 10.0)
    data = face.reopen(KEY, 1)
    assert data is got.data and svc.cache.handles.handles == 1  # pinned, a hit
    face.unpin(data)
    face.unverify(KEY)  # the node changed: the next open decides again
    assert face.reopen(KEY, 1) is None
    face.verify(KEY, got.data, sig, b"a", until=now)  # its check is due
    assert face.reopen(KEY, 1) is None
