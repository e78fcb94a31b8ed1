"""Versioned binary formats of the sampler's control channel (``MOUNT/.shadefs/``).

This module owns the byte layout shared by the daemon (decoders) and the torch client
(encoders): dataset registration, per-sample losses, order requests and order responses.
It is pure and side-effect free, so both sides import it without pulling in FUSE.

Every message is little-endian and starts with an 8-byte header: a 4-byte magic, a u16
version (``VERSION``) and u16 flags (0).  Decoders treat their input as hostile: every length
field is checked against the real buffer length before it is used, sizes must match the
header exactly, and anything malformed raises ``WireError`` (a ``ValueError``) with a
one-line message, which the daemon turns into EINVAL.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

VERSION = 1

MAGIC_DATASET = b"SHDS"
MAGIC_LOSSES = b"SHDL"
MAGIC_ORDER_REQUEST = b"SHDQ"
MAGIC_ORDER_RESPONSE = b"SHDR"
_MAGICS = (MAGIC_DATASET, MAGIC_LOSSES, MAGIC_ORDER_REQUEST, MAGIC_ORDER_RESPONSE)

#: Sanity limits, checked before any allocation so a forged header cannot make the daemon
#: buffer gigabytes.  ImageNet-22k is 14 M files (about 1 GB of relative paths).
MAX_SAMPLES = 1 << 27
MAX_DATASET_BYTES = 1 << 31
#: The longest relative path a dataset may hold (Linux's PATH_MAX).
MAX_PATH = 4096
MAX_LOSSES = 1 << 22
MAX_WORLD_SIZE = 65536

_HEADER = struct.Struct("<4sHH")
_DATASET = struct.Struct("<4sHHQQ")  # magic, version, flags, count, payload length
_LOSSES = struct.Struct("<4sHHII")  # magic, version, flags, batches, total count
_REQUEST = struct.Struct("<4sHHQIIQ")  # magic, version, flags, epoch, rank, world, seed
_RESPONSE = struct.Struct("<4sHHQQ")  # magic, version, flags, epoch, count

_U64_MAX = (1 << 64) - 1


class WireError(ValueError):
    """A control-channel message is malformed; the message is one line."""


def _byte_view(buf: bytes | bytearray | memoryview) -> memoryview:
    """A flat byte view of ``buf``, so len() counts bytes whatever the caller passed."""
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        try:
            view = view.cast("B")
        except TypeError as exc:
            raise WireError(f"unusable buffer: {exc}") from None
    return view


def _check_header(buf: bytes | bytearray | memoryview, magic: bytes) -> None:
    if len(buf) < _HEADER.size:
        raise WireError(f"message too short for a header: {len(buf)} bytes")
    got, version, flags = _HEADER.unpack_from(buf)
    if got != magic:
        raise WireError(f"bad magic {got!r}, expected {magic!r}")
    if version != VERSION:
        raise WireError(f"unsupported version {version}, expected {VERSION}")
    if flags != 0:
        raise WireError(f"unknown flags 0x{flags:04x}")


def _check_size(buf: bytes | bytearray | memoryview, expected: int, what: str) -> None:
    if len(buf) != expected:
        raise WireError(f"{what} message is {len(buf)} bytes, header says {expected}")


def message_length(prefix: bytes | bytearray | memoryview) -> int | None:
    """Total length of the message ``prefix`` starts, or None while its header is incomplete.

    The daemon buffers a control file's writes and calls this to know when a message is
    whole.  It validates magic, version, flags and counts as soon as they are present, so a
    bad or oversized message is rejected before the daemon buffers it.
    """
    prefix = _byte_view(prefix)
    head = bytes(prefix[:4])
    if len(head) < 4:
        if not any(m.startswith(head) for m in _MAGICS):
            raise WireError(f"bad magic {head!r}")
        return None
    if head not in _MAGICS:
        raise WireError(f"bad magic {head!r}")
    if len(prefix) < _HEADER.size:
        return None
    _check_header(prefix, head)
    if head == MAGIC_DATASET:
        if len(prefix) < _DATASET.size:
            return None
        _, _, _, count, payload = _DATASET.unpack_from(prefix)
        _check_dataset_counts(count, payload)
        return _DATASET.size + int(payload)
    if head == MAGIC_LOSSES:
        if len(prefix) < _LOSSES.size:
            return None
        _, _, _, batches, count = _LOSSES.unpack_from(prefix)
        _check_loss_counts(batches, count)
        return _LOSSES.size + 4 * int(batches) + 12 * int(count)
    if head == MAGIC_ORDER_REQUEST:
        return _REQUEST.size
    if len(prefix) < _RESPONSE.size:
        return None
    _, _, _, _, count = _RESPONSE.unpack_from(prefix)
    _check_response_count(count)
    return _RESPONSE.size + 8 * int(count)


# -- dataset registration -------------------------------------------------------------------


def _check_dataset_counts(count: int, payload: int) -> None:
    if count > MAX_SAMPLES:
        raise WireError(f"dataset count {count} above the limit {MAX_SAMPLES}")
    limit = min(MAX_DATASET_BYTES, count * (MAX_PATH + 1))
    if payload > limit:
        # No real list needs more than PATH_MAX per path: a header that declares more is
        # refused before its payload is buffered.
        raise WireError(f"dataset payload of {payload} bytes above the limit {limit}")
    # Every path is at least one character plus its newline.
    if payload < 2 * count or (count == 0 and payload != 0):
        raise WireError(f"dataset payload of {payload} bytes cannot hold {count} paths")


def encode_dataset(paths: Sequence[str]) -> bytes:
    """Encode the dataset's relative paths; their order defines the sample ids."""
    text = "".join(p + "\n" for p in paths)
    try:
        payload = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        # os.fsdecode() turns non-UTF-8 file names into lone surrogates.
        raise WireError(f"dataset path is not valid UTF-8 (character {exc.start})") from None
    _check_dataset_counts(len(paths), len(payload))
    msg = _DATASET.pack(MAGIC_DATASET, VERSION, 0, len(paths), len(payload)) + payload
    # Run the daemon's checks on the client side too, so a bad list fails where the user
    # can see the traceback, not as a bare EINVAL from write().
    decode_dataset(msg)
    return msg


def decode_dataset(buf: bytes | bytearray | memoryview) -> list[str]:
    """Decode and validate a dataset registration; returns the relative paths in order.

    Rejects empty paths, NUL, absolute paths, empty, ``.`` and ``..`` components, duplicates
    and non-UTF-8.  Runs on 1.28 M paths (~80 MB), so every check is one pass of a C-level
    string operation over the whole text rather than a Python loop over paths.
    """
    view = _byte_view(buf)
    _check_header(view, MAGIC_DATASET)
    if len(view) < _DATASET.size:
        raise WireError(f"dataset message too short: {len(view)} bytes")
    _, _, _, count, payload = _DATASET.unpack_from(view)
    _check_dataset_counts(count, payload)
    _check_size(view, _DATASET.size + payload, "dataset")
    if count == 0:
        return []
    try:
        text = str(view[_DATASET.size :], "utf-8")
    except UnicodeDecodeError as exc:
        raise WireError(f"dataset paths are not UTF-8 (byte {exc.start})") from None
    if not text.endswith("\n"):
        raise WireError("dataset payload does not end with a newline")
    if "\0" in text:
        raise WireError("dataset path contains NUL")
    # Turn every path separator and terminator into "/" and prefix one: then an empty path,
    # an absolute path, an empty component and a trailing slash all show up as "//", and a
    # "." or ".." component as "/./" or "/../".  Three C-level searches instead of a
    # Python loop over 1.28 M paths.
    joined = "/" + text.replace("\n", "/")
    for needle, what in (
        ("//", "empty or absolute path, or empty component"),
        ("/./", "'.' component"),
        ("/../", "'..' component"),
    ):
        at = joined.find(needle)
        if at >= 0:
            raise WireError(f"{what} in dataset path {_line_at(text, at):.200}")
    paths = text[:-1].split("\n")
    if len(paths) != count:
        raise WireError(f"dataset header says {count} paths, payload holds {len(paths)}")
    if len(set(paths)) != count:
        raise WireError(f"duplicate dataset path {_first_duplicate(paths)!r:.200}")
    return paths


def _line_at(text: str, joined_at: int) -> str:
    """Error path only: repr of the path a match in the "/"-joined text points into."""
    # joined[i] is text[i - 1]; a match that starts on a separator belongs to the next path,
    # unless it is the terminator that follows an empty path.
    at = min(max(joined_at, 0), len(text) - 1)
    start = text.rfind("\n", 0, at) + 1
    end = text.find("\n", start)
    return repr(text[start:end])


def _first_duplicate(paths: list[str]) -> str:
    """Error path only: find a duplicate to name in the message."""
    seen: set[str] = set()
    for p in paths:
        if p in seen:
            return p
        seen.add(p)
    return ""


# -- losses ---------------------------------------------------------------------------------


def _check_loss_counts(batches: int, count: int) -> None:
    if count > MAX_LOSSES:
        raise WireError(f"loss count {count} above the limit {MAX_LOSSES}")
    if batches > count:
        raise WireError(f"{batches} batches cannot hold {count} losses")


def _validate_losses(
    indices: np.ndarray, losses: np.ndarray, batch_lengths: np.ndarray, n: int | None
) -> None:
    count = len(indices)
    if len(losses) != count:
        raise WireError(f"{count} indices but {len(losses)} losses")
    if np.any(batch_lengths < 1):
        raise WireError("empty batch in losses")
    if int(batch_lengths.sum(dtype=np.uint64)) != count:
        raise WireError("batch lengths do not sum to the loss count")
    if count == 0:
        return
    if not np.isfinite(losses).all():
        raise WireError("non-finite loss")
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0:
        raise WireError(f"negative sample index {lo}")
    if n is not None and hi >= n:
        raise WireError(f"sample index {hi} out of range for {n} samples")


def encode_losses(
    indices: np.ndarray | Sequence[int],
    losses: np.ndarray | Sequence[float],
    batch_lengths: np.ndarray | Sequence[int] | None = None,
) -> bytes:
    """Encode per-sample losses of one or more batches (one batch if no lengths are given).

    ``indices`` must be the sample ids the loader returned for those losses.
    """
    idx = np.ascontiguousarray(indices, dtype="<i8").reshape(-1)
    val = np.ascontiguousarray(losses, dtype="<f4").reshape(-1)
    if batch_lengths is None:
        lengths = np.array([len(idx)] if len(idx) else [], dtype="<u4")
    else:
        signed = np.asarray(batch_lengths, dtype=np.int64).reshape(-1)
        if np.any(signed < 1) or np.any(signed > MAX_LOSSES):
            raise WireError("batch lengths must be in [1, MAX_LOSSES]")
        lengths = signed.astype("<u4")
    _check_loss_counts(len(lengths), len(idx))
    _validate_losses(idx, val, lengths, None)
    head = _LOSSES.pack(MAGIC_LOSSES, VERSION, 0, len(lengths), len(idx))
    return b"".join((head, lengths.tobytes(), idx.tobytes(), val.tobytes()))


def decode_losses(
    buf: bytes | bytearray | memoryview, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode and validate a losses message for a dataset of ``n`` samples.

    Returns ``(indices int64, losses float32, batch_lengths uint32)``, native-endian copies
    that do not alias ``buf``.
    """
    view = _byte_view(buf)
    _check_header(view, MAGIC_LOSSES)
    if len(view) < _LOSSES.size:
        raise WireError(f"losses message too short: {len(view)} bytes")
    _, _, _, batches, count = _LOSSES.unpack_from(view)
    _check_loss_counts(batches, count)
    _check_size(view, _LOSSES.size + 4 * batches + 12 * count, "losses")
    off = _LOSSES.size
    lengths = np.frombuffer(view, dtype="<u4", count=batches, offset=off).astype(np.uint32)
    off += 4 * batches
    indices = np.frombuffer(view, dtype="<i8", count=count, offset=off).astype(np.int64)
    off += 8 * count
    losses = np.frombuffer(view, dtype="<f4", count=count, offset=off).astype(np.float32)
    _validate_losses(indices, losses, lengths, n)
    return indices, losses, lengths


# -- order request / response ---------------------------------------------------------------


@dataclass(frozen=True)
class OrderRequest:
    """Which epoch order a rank asks for; validated on construction."""

    epoch: int
    rank: int
    world_size: int
    seed: int

    def __post_init__(self) -> None:
        if not 0 <= self.epoch <= _U64_MAX or not 0 <= self.seed <= _U64_MAX:
            raise WireError("epoch and seed must fit in u64")
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise WireError(f"world size {self.world_size} not in [1, {MAX_WORLD_SIZE}]")
        if not 0 <= self.rank < self.world_size:
            raise WireError(f"rank {self.rank} not in [0, {self.world_size})")


def encode_order_request(epoch: int, rank: int, world_size: int, seed: int) -> bytes:
    req = OrderRequest(epoch=epoch, rank=rank, world_size=world_size, seed=seed)
    return _REQUEST.pack(
        MAGIC_ORDER_REQUEST, VERSION, 0, req.epoch, req.rank, req.world_size, req.seed
    )


def decode_order_request(buf: bytes | bytearray | memoryview) -> OrderRequest:
    view = _byte_view(buf)
    _check_header(view, MAGIC_ORDER_REQUEST)
    _check_size(view, _REQUEST.size, "order request")
    _, _, _, epoch, rank, world_size, seed = _REQUEST.unpack_from(view)
    return OrderRequest(epoch=epoch, rank=rank, world_size=world_size, seed=seed)


def _check_response_count(count: int) -> None:
    if count > MAX_SAMPLES:
        raise WireError(f"order length {count} above the limit {MAX_SAMPLES}")


def encode_order_response(epoch: int, indices: np.ndarray) -> bytes:
    idx = np.ascontiguousarray(indices, dtype="<i8").reshape(-1)
    if not 0 <= epoch <= _U64_MAX:
        raise WireError("epoch must fit in u64")
    _check_response_count(len(idx))
    if len(idx) and int(idx.min()) < 0:
        raise WireError("negative sample index in order")
    return _RESPONSE.pack(MAGIC_ORDER_RESPONSE, VERSION, 0, epoch, len(idx)) + idx.tobytes()


def decode_order_response(
    buf: bytes | bytearray | memoryview, n: int | None = None
) -> tuple[int, np.ndarray]:
    """Decode an order response; returns ``(epoch, indices int64)``.

    With ``n`` (the registered sample count) indices must also be below it.
    """
    view = _byte_view(buf)
    _check_header(view, MAGIC_ORDER_RESPONSE)
    if len(view) < _RESPONSE.size:
        raise WireError(f"order response too short: {len(view)} bytes")
    _, _, _, epoch, count = _RESPONSE.unpack_from(view)
    _check_response_count(count)
    _check_size(view, _RESPONSE.size + 8 * count, "order response")
    indices = np.frombuffer(view, dtype="<i8", count=count, offset=_RESPONSE.size)
    indices = indices.astype(np.int64)
    if count:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0:
            raise WireError(f"negative sample index {lo} in order")
        if n is not None and hi >= n:
            raise WireError(f"sample index {hi} in order out of range for {n} samples")
    return epoch, indices
