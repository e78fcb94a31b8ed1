"""The sampler's channel (`dataset`, `losses`, `order`) and the line files (`residency`,
`plan`): assembling what clients write, decoding it, and calling the service.

Binary messages (shadefs/sampling/wire.py) may arrive split over several write() calls: the
handle buffers them, and each message is processed once it is complete. Only what a client
sends to that file is taken (a response's magic is refused), and a header is checked as
soon as it is whole, against the registered dataset too: a forged one that declares more
than a real message needs fails the write with EINVAL before anything is buffered. Line files keep a
partial last line until the rest of it arrives. The decisions (which files, what order,
what to prefetch) are the service's.
"""

from __future__ import annotations

import logging

import numpy as np

from shadefs.control.commands import CommandError, relpath
from shadefs.control.entries import DATASET, LOSSES, ORDER, PLAN, RESIDENCY, STREAMS, Handle
from shadefs.control.service import ControlService
from shadefs.sampling import wire, wire_nodes

log = logging.getLogger(__name__)

# The longest line a line file buffers while waiting for its newline.
_MAX_LINE = 1 << 16
# The messages a client may write to each stream.
_ACCEPTS = {
    DATASET: (wire.MAGIC_DATASET,),
    LOSSES: (wire.MAGIC_LOSSES,),
    ORDER: (
        wire.MAGIC_ORDER_REQUEST,
        wire_nodes.MAGIC_RESIDENT_REQUEST,
        wire_nodes.MAGIC_NODE_ORDER,
    ),
}


class Channel:
    """Processes writes to the channel's entries; returns the result they leave."""

    def __init__(self, service: ControlService) -> None:
        self.service = service

    async def write(self, handle: Handle, buf: bytes) -> str | None:
        """Take `buf` written to `handle`; returns a result to show in ctl, if any.

        Raises CommandError, Rejected or wire.WireError for input that is refused.
        """
        spec = handle.spec
        if spec is RESIDENCY:
            await self._residency(handle, buf)
            return None
        if spec is PLAN:
            await self._plan_lines(handle, buf)
            return None
        assert spec in STREAMS
        handle.pending += buf
        result = None
        samples = self.service.dataset_info().samples
        for message in _complete_messages(handle.pending, _ACCEPTS[spec], samples):
            result = await self._message(handle, message) or result
        return result

    def release(self, handle: Handle) -> None:
        """The handle is closed: a complete plan is installed, a partial message dropped."""
        if handle.poisoned:
            return
        if handle.spec is PLAN and handle.plan:
            keys = np.concatenate([k for k, _, _ in handle.plan])
            sizes = np.concatenate([z for _, _, z in handle.plan])
            rels = [r for _, chunk, _ in handle.plan for r in chunk]
            self.service.prefetch(rels, keys, sizes, handle.owner)
        if handle.spec in STREAMS and handle.pending:
            log.warning(
                "%s closed with an incomplete message (%d bytes): ignored",
                handle.spec.name.decode(),
                len(handle.pending),
            )

    async def _message(self, handle: Handle, message: bytes) -> str | None:
        if handle.spec is DATASET:
            paths = wire.decode_dataset(message)
            await self.service.register_dataset(paths)
            return f"ok: registered {len(paths)} samples"
        if handle.spec is LOSSES:
            self.service.ingest_losses(message)
            return None
        if message.startswith(wire_nodes.MAGIC_RESIDENT_REQUEST):
            n = wire_nodes.decode_resident_request(message)
            handle.data = wire_nodes.encode_resident(await self.service.resident_bitmap(n))
            return None
        if message.startswith(wire_nodes.MAGIC_NODE_ORDER):
            msg = wire_nodes.decode_node_order(message, self.service.dataset_info().samples)
            order = await self.service.install_order(msg)
            # The order goes back only to the node that built it: a node handed the order
            # knows it, and 10 MB back through FUSE per epoch would be for nothing.
            reply = order if len(msg.order) == 0 else order[:0]
            handle.data = wire.encode_order_response(msg.epoch, reply)
            return None
        request = wire.decode_order_request(message)
        share = await self.service.order(request, handle.pid)
        handle.data = wire.encode_order_response(request.epoch, share)
        return None

    async def _residency(self, handle: Handle, buf: bytes) -> None:
        rels = _complete_lines(handle.pending, buf, "residency")
        if not rels:
            return
        out = handle.data
        assert isinstance(out, bytearray)
        for state in await self.service.residency(rels):
            out += state.encode() + b"\n"

    async def _plan_lines(self, handle: Handle, buf: bytes) -> None:
        """A job's own read order, one relative path per line; installed at close."""
        if not self.service.prefetching:
            raise CommandError("prefetching is off (mounted with --no-prefetch)")
        rels = _complete_lines(handle.pending, buf, "plan")
        if not rels:
            return
        keys, sizes = await self.service.resolve_files(rels)
        handle.plan.append((keys, rels, sizes))


def dataset_summary(service: ControlService) -> bytes:
    """What reading `dataset` shows."""
    info = service.dataset_info()
    return (
        f"samples {info.samples}\nregistered_at {info.registered_at:.3f}\n"
        f"resolved {info.resolved}\n"
    ).encode()


def _complete_messages(pending: bytearray, accepts: tuple[bytes, ...], samples: int) -> list[bytes]:
    """Split the complete wire messages off the front of `pending` (in place); WireError
    for a message of a kind not in `accepts`, or a header that a real message never has."""
    out = []
    while pending:
        head = bytes(pending[:4])
        if not any(magic.startswith(head) for magic in accepts):
            raise wire.WireError(f"a {head!r} message cannot be written here")
        length = wire_nodes.message_length(pending, samples)
        if length is None or len(pending) < length:
            break
        out.append(bytes(pending[:length]))
        del pending[:length]
    return out


def _complete_lines(pending: bytearray, buf: bytes, what: str) -> list[bytes]:
    """The complete lines written so far, as checked relative paths; a partial last line
    waits in `pending` (changed in place) for the rest of it."""
    pending += buf
    end = pending.rfind(b"\n")
    if end < 0:
        if len(pending) > _MAX_LINE:
            raise CommandError(f"{what}: line too long")
        return []
    complete = bytes(pending[:end])
    del pending[: end + 1]
    return [relpath(p) for p in complete.split(b"\n")]
