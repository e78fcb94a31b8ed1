"""Tests of the control channel's binary formats: round trips and hostile input."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shadefs.sampling import wire
from shadefs.sampling.wire import WireError


def _losses_msg(n: int = 3) -> bytes:
    return wire.encode_losses(np.arange(n), np.linspace(0.0, 1.0, n), [n])


VALID = [
    wire.encode_dataset(["a/1.jpg", "a/2.jpg", "b/ü.png"]),
    wire.encode_dataset([]),
    wire.encode_losses([4, 1, 9, 4], [0.5, 1.0, 2.0, 0.25], [3, 1]),
    wire.encode_losses([], []),
    wire.encode_order_request(epoch=3, rank=1, world_size=4, seed=42),
    wire.encode_order_response(3, np.array([5, 0, 9])),
    wire.encode_order_response(0, np.empty(0, np.int64)),
]


def _decode_any(buf: bytes) -> object:
    magic = bytes(buf[:4])
    if magic == wire.MAGIC_DATASET:
        return wire.decode_dataset(buf)
    if magic == wire.MAGIC_LOSSES:
        return wire.decode_losses(buf, 10)
    if magic == wire.MAGIC_ORDER_REQUEST:
        return wire.decode_order_request(buf)
    return wire.decode_order_response(buf, 10)


# -- round trips ----------------------------------------------------------------------------


def test_dataset_round_trip() -> None:
    paths = ["train/n01/a.JPEG", "train/n01/b c.JPEG", "val/ü/日本.png", ".hidden/x", "a..b/c"]
    msg = wire.encode_dataset(paths)
    assert msg[:4] == b"SHDS"
    assert wire.decode_dataset(msg) == paths
    assert wire.decode_dataset(bytearray(msg)) == paths
    assert wire.decode_dataset(memoryview(msg)) == paths
    assert wire.message_length(msg[:24]) == len(msg)


def test_losses_round_trip() -> None:
    msg = wire.encode_losses([7, 2, 7], [0.5, 1.5, 2.5], [2, 1])
    idx, loss, lengths = wire.decode_losses(msg, 8)
    assert idx.dtype == np.int64 and loss.dtype == np.float32 and lengths.dtype == np.uint32
    assert idx.tolist() == [7, 2, 7]
    assert loss.tolist() == [0.5, 1.5, 2.5]
    assert lengths.tolist() == [2, 1]
    assert len(msg) == 16 + 2 * 4 + 3 * 12
    assert wire.message_length(msg) == len(msg)
    idx, _, lengths = wire.decode_losses(wire.encode_losses([1, 2, 3], [1, 2, 3]), 4)
    assert lengths.tolist() == [3]


def test_order_request_and_response_round_trip() -> None:
    msg = wire.encode_order_request(epoch=2**40, rank=3, world_size=8, seed=2**64 - 1)
    assert len(msg) == 32 and wire.message_length(msg[:8]) == 32
    req = wire.decode_order_request(msg)
    assert req == wire.OrderRequest(epoch=2**40, rank=3, world_size=8, seed=2**64 - 1)
    order = np.array([9, 0, 9, 4], dtype=np.int64)
    msg = wire.encode_order_response(7, order)
    epoch, got = wire.decode_order_response(msg, 10)
    assert epoch == 7 and got.tolist() == order.tolist()
    assert wire.message_length(msg[:24]) == len(msg) == 24 + 32


def test_layout_is_little_endian() -> None:
    msg = wire.encode_order_request(epoch=1, rank=2, world_size=3, seed=4)
    assert msg == struct.pack("<4sHHQIIQ", b"SHDQ", 1, 0, 1, 2, 3, 4)


def test_message_length_waits_for_the_header() -> None:
    msg = _losses_msg()
    for cut in range(16):
        assert wire.message_length(msg[:cut]) is None
    assert wire.message_length(msg[:16]) == len(msg)
    with pytest.raises(WireError):
        wire.message_length(b"X")
    with pytest.raises(WireError):
        wire.message_length(b"SHDX")
    with pytest.raises(WireError):
        wire.message_length(b"SHDL\x02\x00\x00\x00")  # version 2


def test_message_length_rejects_oversized_counts_early() -> None:
    head = struct.pack("<4sHHII", b"SHDL", 1, 0, 1, wire.MAX_LOSSES + 1)
    with pytest.raises(WireError, match="limit"):
        wire.message_length(head)
    head = struct.pack("<4sHHQQ", b"SHDS", 1, 0, 1, 2**62)
    with pytest.raises(WireError, match="limit"):
        wire.message_length(head)


# -- rejections -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "paths",
    [
        [""],
        ["a\0b"],
        ["/etc/passwd"],
        [".."],
        ["../x"],
        ["a/../b"],
        ["a/.."],
        ["."],
        ["./a"],
        ["a/./b"],
        ["a/."],
        ["a//b"],
        ["a/"],
        ["a", "b", "a"],
        ["x\ny"],
        ["\udcff.jpg"],
    ],
)
def test_dataset_rejects_bad_paths(paths: list[str]) -> None:
    with pytest.raises(WireError):
        wire.encode_dataset(paths)
    # The daemon side must reject them too, whatever the client did.
    payload = "".join(p + "\n" for p in paths).encode("utf-8", "surrogateescape")
    msg = struct.pack("<4sHHQQ", b"SHDS", 1, 0, len(paths), len(payload)) + payload
    with pytest.raises(WireError):
        wire.decode_dataset(msg)


def test_dataset_rejects_bad_framing() -> None:
    good = wire.encode_dataset(["a", "b"])
    with pytest.raises(WireError, match="header says"):
        wire.decode_dataset(good + b"x")  # trailing bytes
    with pytest.raises(WireError):
        wire.decode_dataset(good[:-1])
    count_off = struct.pack("<4sHHQQ", b"SHDS", 1, 0, 3, 4) + b"a\nb\n"
    with pytest.raises(WireError, match="3 paths"):
        wire.decode_dataset(count_off)
    no_newline = struct.pack("<4sHHQQ", b"SHDS", 1, 0, 1, 2) + b"ab"
    with pytest.raises(WireError, match="newline"):
        wire.decode_dataset(no_newline)
    with pytest.raises(WireError, match="UTF-8"):
        wire.decode_dataset(struct.pack("<4sHHQQ", b"SHDS", 1, 0, 1, 2) + b"\xff\n")
    with pytest.raises(WireError, match="magic"):
        wire.decode_dataset(_losses_msg())


def test_losses_rejections() -> None:
    def raw(lengths: list[int], idx: list[int], loss: list[float]) -> bytes:
        head = struct.pack("<4sHHII", b"SHDL", 1, 0, len(lengths), len(idx))
        return (
            head
            + np.array(lengths, "<u4").tobytes()
            + np.array(idx, "<i8").tobytes()
            + np.array(loss, "<f4").tobytes()
        )

    assert wire.decode_losses(raw([2], [0, 1], [1.0, 2.0]), 2)[0].tolist() == [0, 1]
    bad = [
        raw([2], [0, 1], [1.0, float("nan")]),
        raw([2], [0, 1], [1.0, float("inf")]),
        raw([2], [0, -1], [1.0, 2.0]),
        raw([2], [0, 2], [1.0, 2.0]),  # out of range for n = 2
        raw([1], [0, 1], [1.0, 2.0]),  # lengths do not sum to count
        raw([2, 0], [0, 1], [1.0, 2.0]),  # empty batch
        raw([2], [0, 1], [1.0, 2.0]) + b"\0",  # trailing byte
        raw([2], [0, 1], [1.0, 2.0])[:-1],
        raw([2**32 - 1, 3], [0, 1], [1.0, 2.0]),  # u32 wrap-around of the sum
    ]
    for msg in bad:
        with pytest.raises(WireError):
            wire.decode_losses(msg, 2)
    with pytest.raises(WireError):
        wire.encode_losses([0, 1], [1.0, float("nan")])
    with pytest.raises(WireError):
        wire.encode_losses([0, 1], [1.0, 2.0], [1, 0, 1])


def test_order_request_rejections() -> None:
    for rank, world in ((4, 4), (0, 0), (0, 65537)):
        msg = struct.pack("<4sHHQIIQ", b"SHDQ", 1, 0, 0, rank, world, 0)
        with pytest.raises(WireError):
            wire.decode_order_request(msg)
        with pytest.raises(WireError):
            wire.encode_order_request(epoch=0, rank=rank, world_size=world, seed=0)
    with pytest.raises(WireError):
        wire.encode_order_request(epoch=-1, rank=0, world_size=1, seed=0)
    good = wire.encode_order_request(epoch=0, rank=0, world_size=65536, seed=0)
    with pytest.raises(WireError):
        wire.decode_order_request(good + b"\0")
    flagged = good[:6] + b"\x01\x00" + good[8:]
    with pytest.raises(WireError, match="flags"):
        wire.decode_order_request(flagged)


def test_order_response_rejections() -> None:
    msg = wire.encode_order_response(1, np.array([1, 2, 3]))
    with pytest.raises(WireError):
        wire.decode_order_response(msg, 3)  # index 3 out of range
    with pytest.raises(WireError):
        wire.decode_order_response(msg[:-8])
    with pytest.raises(WireError):
        wire.encode_order_response(1, np.array([-1]))
    neg = struct.pack("<4sHHQQq", b"SHDR", 1, 0, 1, 1, -5)
    with pytest.raises(WireError, match="negative"):
        wire.decode_order_response(neg)


# -- hostile input (hypothesis) -------------------------------------------------------------

_DECODERS = [
    wire.decode_dataset,
    lambda b: wire.decode_losses(b, 100),
    wire.decode_order_request,
    lambda b: wire.decode_order_response(b, 100),
    wire.message_length,
]


def _only_wire_errors(buf: bytes) -> None:
    for decode in _DECODERS:
        try:
            decode(buf)
        except WireError as exc:
            assert "\n" not in str(exc)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_wire_error(buf: bytes) -> None:
    _only_wire_errors(buf)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(sorted(b"SHDS SHDL SHDQ SHDR".split())),
    st.binary(max_size=120),
)
def test_random_bodies_after_a_valid_magic(magic: bytes, body: bytes) -> None:
    _only_wire_errors(magic + b"\x01\x00\x00\x00" + body)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(VALID),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
    st.integers(0, 10**6),
    st.binary(max_size=16),
)
def test_mutated_messages_only_raise_wire_error(
    msg: bytes, flips: list[tuple[int, int]], cut: int, tail: bytes
) -> None:
    buf = bytearray(msg)
    for where, value in flips:
        if buf:
            buf[where % len(buf)] = value
    _only_wire_errors(bytes(buf))
    _only_wire_errors(bytes(buf[: cut % (len(buf) + 1)]))
    _only_wire_errors(bytes(buf) + tail)


_path_part = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="/\n\0"),
    min_size=1,
    max_size=8,
).filter(lambda s: s not in (".", ".."))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(_path_part, min_size=1, max_size=4).map("/".join), unique=True))
def test_dataset_round_trip_hypothesis(paths: list[str]) -> None:
    msg = wire.encode_dataset(paths)
    assert wire.message_length(msg) == len(msg)
    assert wire.decode_dataset(msg) == paths


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(1, 20), max_size=5).flatmap(
        lambda lengths: st.tuples(
            st.just(lengths),
            st.lists(st.integers(0, 999), min_size=sum(lengths), max_size=sum(lengths)),
            st.lists(
                st.floats(allow_nan=False, allow_infinity=False, width=32),
                min_size=sum(lengths),
                max_size=sum(lengths),
            ),
        )
    )
)
def test_losses_round_trip_hypothesis(case: tuple[list[int], list[int], list[float]]) -> None:
    lengths, idx, loss = case
    msg = wire.encode_losses(idx, loss, lengths)
    assert wire.message_length(msg) == len(msg)
    got_idx, got_loss, got_lengths = wire.decode_losses(msg, 1000)
    assert got_idx.tolist() == idx
    assert got_loss.tolist() == loss
    assert got_lengths.tolist() == lengths
