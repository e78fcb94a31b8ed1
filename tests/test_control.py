"""The control directory's channels, driven through the handlers: sampler, residency, ctl."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pyfuse3
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shadefs.control.commands import CTL_MAX_WRITE
from shadefs.control.entries import DIR_INODE
from shadefs.sampling import wire
from tests.conftest import FakeCtx, make_tree
from tests.test_fs_api import lookup_path, make_fs, read_all

CTX = FakeCtx()


async def ctl_ino(ops, name: bytes) -> int:
    return (await ops.lookup(DIR_INODE, name, CTX)).st_ino


async def send(ops, name: bytes, data: bytes, *, chunk: int = 1 << 20) -> None:
    fi = await ops.open(await ctl_ino(ops, name), os.O_WRONLY, CTX)
    try:
        for off in range(0, len(data), chunk):
            await ops.write(fi.fh, off, data[off : off + chunk])
    finally:
        await ops.release(fi.fh)


async def transact(ops, name: bytes, data: bytes) -> bytes:
    fi = await ops.open(await ctl_ino(ops, name), os.O_RDWR, CTX)
    try:
        await ops.write(fi.fh, 0, data)
        out = b""
        while chunk := await ops.read(fi.fh, len(out), 1 << 16):
            out += chunk
        return out
    finally:
        await ops.release(fi.fh)


def dataset_tree(tmp_path: Path, n: int = 40) -> tuple[Path, list[str]]:
    files = {f"c{i % 4}/s{i:03d}.bin": os.urandom(100) for i in range(n)}
    return make_tree(tmp_path / "src", files), sorted(files)


async def test_register_losses_and_order(tmp_path: Path) -> None:
    src, paths = dataset_tree(tmp_path)
    ops, svc = make_fs(src, ram=1000, policy="shade")
    sampling = svc.sampling
    # A registration split into 7-byte writes is assembled and applied once complete.
    await send(ops, b"dataset", wire.encode_dataset(paths), chunk=7)
    assert sampling.n == 40
    assert b"samples 40" in await read_all(ops, await ctl_ino(ops, b"dataset"))
    # Sample ids map to the files' inodes.
    assert sampling.sample_of(await lookup_path(ops, paths[5])) == 5
    # Losses: sample 7 is always the hardest of its batch.
    idx = np.arange(40, dtype=np.int64)
    losses = np.where(idx == 7, 10.0, idx / 100).astype(np.float32)
    await send(ops, b"losses", wire.encode_losses(idx, losses, np.array([20, 20], np.uint32)))
    assert sampling.table.scores[7] == 1.0 and sampling.losses_ingested == 40
    # Make a few files resident, then ask for rank 0's and rank 1's shares of epoch 1.
    for p in paths[:5]:
        await read_all(ops, await lookup_path(ops, p))
    await send(ops, b"ctl", b"replay 3\n")
    shares = []
    for rank in (0, 1):
        resp = await transact(ops, b"order", wire.encode_order_request(1, rank, 2, 0))
        epoch, share = wire.decode_order_response(resp, 40)
        assert epoch == 1 and len(share) == 20
        shares.append(share)
    both = np.concatenate(shares)
    resident = {sampling.sample_of(k) for k in svc.cache.entries}
    assert resident and any((both == r).sum() > 1 for r in resident)  # replays are visible
    assert sampling.orders_served == 2
    assert svc.stats().sampler.samples == 40


async def test_order_reads_straight_on_after_the_request(tmp_path: Path) -> None:
    src, paths = dataset_tree(tmp_path)
    ops, _ = make_fs(src)
    await send(ops, b"dataset", wire.encode_dataset(paths))
    request = wire.encode_order_request(0, 0, 1, 0)
    fi = await ops.open(await ctl_ino(ops, b"order"), os.O_RDWR, CTX)
    await ops.write(fi.fh, 0, request)
    # No seek: the file offset is past the request, and the response still starts there.
    resp = await ops.read(fi.fh, len(request), 1 << 20)
    assert wire.decode_order_response(resp, 40)[0] == 0
    await ops.release(fi.fh)


async def test_order_is_fixed_once_built_for_an_epoch(tmp_path: Path) -> None:
    src, paths = dataset_tree(tmp_path)
    ops, svc = make_fs(src)
    await send(ops, b"dataset", wire.encode_dataset(paths))
    first = await transact(ops, b"order", wire.encode_order_request(2, 0, 2, 5))
    # Losses and cache changes between two ranks' requests must not change the epoch.
    idx = np.arange(40, dtype=np.int64)
    await send(ops, b"losses", wire.encode_losses(idx, np.random.rand(40).astype(np.float32)))
    await read_all(ops, await lookup_path(ops, paths[0]))
    again = await transact(ops, b"order", wire.encode_order_request(2, 0, 2, 5))
    assert first == again


async def test_residency_reports_tiers(tmp_path: Path) -> None:
    src, paths = dataset_tree(tmp_path, n=8)
    ops, _ = make_fs(src, ram=1 << 20)
    await read_all(ops, await lookup_path(ops, paths[0]))
    query = f"{paths[0]}\n{paths[1]}\nnope/missing.bin\n".encode()
    # Split mid-line: the partial line waits for the rest.
    fi = await ops.open(await ctl_ino(ops, b"residency"), os.O_RDWR, CTX)
    await ops.write(fi.fh, 0, query[:10])
    await ops.write(fi.fh, 10, query[10:])
    assert await ops.read(fi.fh, 0, 1000) == b"ram\nnone\nmissing\n"
    await ops.release(fi.fh)


async def test_evict_and_report_commands(tmp_path: Path) -> None:
    src, paths = dataset_tree(tmp_path, n=8)
    ops, svc = make_fs(src, ram=1 << 20)
    for p in paths[:3]:
        await read_all(ops, await lookup_path(ops, p))
    await send(ops, b"ctl", f"evict {paths[0]} {paths[1]}\n".encode())
    assert len(svc.cache.entries) == 1
    await send(ops, b"ctl", b"report epoch=3 train_loss=0.5 val_accuracy=0.9\nreplay auto\n")
    assert svc.sampling.epoch == 3
    for bad in (
        f"evict {paths[2]} ../etc/passwd\n",
        "evict /abs/path\n",
        "evict .shadefs/ctl\n",
        "report loss=1\n",
        "report train_loss=nan\n",
        "replay 0.5\n",
        "epoch -1\n",
    ):
        with pytest.raises(pyfuse3.FUSEError) as e:
            await send(ops, b"ctl", bad.encode())
        assert e.value.errno == errno.EINVAL, bad
    assert len(svc.cache.entries) == 1  # nothing applied from the rejected writes


async def test_ctl_write_over_the_limit_fails_whole_with_efbig(tmp_path: Path) -> None:
    src, _ = dataset_tree(tmp_path, n=4)
    ops, svc = make_fs(src, ram=1 << 20)
    head = b"ram 40M\npolicy lru\n"
    # The first part of a write that the kernel split: valid lines, more to come.
    for size in (CTL_MAX_WRITE + 1, 1 << 20):
        with pytest.raises(pyfuse3.FUSEError) as e:
            await send(ops, b"ctl", head + b"#" * (size - len(head) - 1) + b"\n")
        assert e.value.errno == errno.EFBIG
        assert svc.cache.capacity == 1 << 20 and svc.cache.policy.name == "epoch"
        assert f"at most {CTL_MAX_WRITE} bytes" in svc.control.last_result
    # At the limit, the whole write is applied.
    await send(ops, b"ctl", head + b"#" * (CTL_MAX_WRITE - len(head) - 1) + b"\n")
    assert svc.cache.capacity == 40 << 20 and svc.cache.policy.name == "lru"
    help_text = await read_all(ops, await ctl_ino(ops, b"ctl"))
    assert f"at most {CTL_MAX_WRITE} bytes".encode() in help_text


@pytest.mark.parametrize(
    "line",
    [
        "ram \u0663M",  # ARABIC-INDIC DIGIT THREE, which int() and float() take for 3
        "ram 1\u0663",
        "epoch \u0663",
        "epoch \uff13",  # FULLWIDTH DIGIT THREE
        "epoch 1_0",
        "replay \u0663",
        "replay 2.\u0665",
        "replay infinity",
        "report epoch=\u0663",
        "report train_loss=\u0661.5",
        "report val_accuracy=\u0660.9",
    ],
)
async def test_numbers_take_ascii_digits_only(tmp_path: Path, line: str) -> None:
    src, _ = dataset_tree(tmp_path, n=4)
    ops, svc = make_fs(src, ram=1 << 20)
    before = _state(svc)
    with pytest.raises(pyfuse3.FUSEError) as e:
        await send(ops, b"ctl", line.encode() + b"\n")
    assert e.value.errno == errno.EINVAL, line
    assert _state(svc) == before and svc.sampling.reports == 0
    # The same commands in ASCII digits are accepted.
    await send(ops, b"ctl", b"ram 3M\nepoch 3\nreplay 2.5\nreport epoch=3 train_loss=1.5\n")
    assert svc.cache.capacity == 3 << 20 and svc.sampling.epoch == 3


async def test_bad_stream_poisons_the_descriptor(tmp_path: Path) -> None:
    src, paths = dataset_tree(tmp_path, n=8)
    ops, svc = make_fs(src)
    fi = await ops.open(await ctl_ino(ops, b"dataset"), os.O_WRONLY, CTX)
    with pytest.raises(pyfuse3.FUSEError):
        await ops.write(fi.fh, 0, wire.encode_dataset(paths[:2] + ["no/such/file"]))
    # The client retries the rest of its message: still refused.
    with pytest.raises(pyfuse3.FUSEError):
        await ops.write(fi.fh, 0, wire.encode_dataset(paths))
    await ops.release(fi.fh)
    assert svc.sampling.n == 0
    assert "not a regular file" in svc.control.last_result


# --- hostile input: every control entry, EINVAL only, state unchanged -------------------

_ENTRIES = [b"ctl", b"dataset", b"losses", b"order", b"residency"]


def _state(svc) -> tuple:
    s, c = svc.sampling, svc.cache
    return (
        s.n,
        s.table.scores.tobytes(),
        s.table.version,
        s.epoch,
        s.fixed_replay,
        c.capacity,
        c.policy.name,
        len(c.entries),
    )


_hostile = st.one_of(
    st.binary(max_size=300),
    st.sampled_from([b"SHDS", b"SHDL", b"SHDQ", b"SHDR"]).flatmap(
        lambda magic: st.binary(max_size=200).map(lambda tail: magic + tail)
    ),
    st.text(max_size=80).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.sampled_from(
        [
            b"ram 1e400\n",
            b"policy \x00\n",
            b"evict \n",
            b"replay inf\n",
            b"report epoch=99999999999999999999999\n",
            b"SHDS\x01\x00\x00\x00" + (2**63).to_bytes(8, "little") * 2,
            b"SHDL\x01\x00\x00\x00\xff\xff\xff\xff\xff\xff\xff\xff",
            b"SHDQ\x01\x00\x00\x00" + b"\x00" * 8 + b"\x05\x00\x00\x00\x02\x00\x00\x00" + b"\0" * 8,
        ]
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entry=st.sampled_from(_ENTRIES), payload=_hostile)
def test_hostile_input_is_einval_and_changes_nothing(tmp_path_factory, entry, payload) -> None:
    async def run() -> None:
        src = tmp_path_factory.getbasetemp() / "hostile-src"
        if not src.exists():
            make_tree(src, {f"c/s{i}.bin": b"x" * 50 for i in range(6)})
        ops, svc = make_fs(src, ram=1000)
        await send(ops, b"dataset", wire.encode_dataset([f"c/s{i}.bin" for i in range(6)]))
        await send(ops, b"ctl", b"replay 2\n")
        before = _state(svc)
        fi = await ops.open(
            await ctl_ino(ops, entry), os.O_RDWR if entry != b"losses" else os.O_WRONLY, CTX
        )
        try:
            await ops.write(fi.fh, 0, payload)
        except pyfuse3.FUSEError as exc:
            assert exc.errno == errno.EINVAL
            assert _state(svc) == before
        finally:
            await ops.release(fi.fh)

    trio.run(run)
