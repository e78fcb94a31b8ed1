"""One open of a block-cached file (cache/blocks.py): its descriptor, its place in the file
(the block it reads, its sequential run), what read-ahead staged for it, and the extents it
read that wait for a signed read (cache/extents.py). State only: `Blocks` acts on it."""

from __future__ import annotations

from shadefs.file_version import Signature

__all__ = ["BlockHandle"]


class BlockHandle:
    """One open of a block-cached file."""

    # fmt: off
    __slots__ = (
        "key", "path", "sig", "size", "nblocks", "fd", "users", "closed", "staged", "seen",
        "ahead_to", "pos", "cur", "cur_data", "next_off", "streak", "run", "checked", "pending",
        "random", "counted", "pieces",
    )
    # fmt: on

    def __init__(self, key: int, path: bytes, sig: Signature, block_size: int) -> None:
        self.key = key
        self.path = path
        self.sig = sig
        self.size = sig.size
        self.nblocks = -(-sig.size // block_size)
        self.fd = -1
        self.users = 0  # source reads in flight on fd
        self.closed = False
        self.staged: dict[int, bytes] = {}  # loaded ahead, not admitted, not yet read
        # Per block: 0 untouched, 1 counted as an access, 2 loaded by this handle.
        self.seen = bytearray(self.nblocks)
        self.ahead_to = 0  # read-ahead has been started for blocks below this
        self.pos = -1  # the last block the reader asked for
        # The block the reader is in: a block the policy did not admit is read by many
        # requests (1 MiB reads of an 8 MiB block) but loaded once.
        self.cur = -1
        self.cur_data = b""
        self.next_off = 0  # where the last read ended: the next one is sequential there
        self.streak = 1  # reads in a row that continued the last (cache/extents.py)
        self.run = 0  # bytes of that run
        self.checked = -1e9  # when its last signed extent read began
        self.pending: list[tuple[int, int, bytes]] = []  # extents read since (unconfirmed)
        self.random = False  # as the source descriptor was last advised
        self.counted = False  # in the mount's hits or misses (by its first read)
        self.pieces: set[int] = set()  # pieces whose read the policy heard of (extents.py)
