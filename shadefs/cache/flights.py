"""Single flight: at most one fetch per key in flight, however many readers want it.

The coordinator (whole files) and the block cache (blocks of large files) both fetch under
this rule (docs/developer-notes.md, invariant 4). A flight is registered under its key while
it runs; later openers wait on it and share its bytes or its error. The flight is removed
*before* its event is set, so a waiter that wakes and misses again starts a new fetch rather
than joining a finished one. A fetch that fails with anything but a FUSE error (cancellation
at unmount, a bug) gives its waiters EIO, while the original exception propagates.

`fly_many` fetches several whole files in one source call (the prefetcher's batches: one
thread hop for many small files), each as the one flight of its key, so that a reader that
opens one of them meanwhile joins it, as it would a flight of its own.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import pyfuse3
import trio

from shadefs.cache.ssd_format import Signature

__all__ = ["FileFlight", "Flight", "fly_many", "flying"]

# The source's read of several (path, size): each file's (bytes, fstat) or FUSE error, and
# the seconds per file the worker thread spent (source.py's Source.read_files).
ReadMany = Callable[
    [Sequence[tuple[bytes, int | None]]],
    Awaitable[tuple[list[tuple[bytes, os.stat_result] | pyfuse3.FUSEError], float]],
]


class Flight:
    """One fetch in flight: its outcome, once `done` is set."""

    __slots__ = ("done", "data", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.data: bytes | None = None
        self.error: BaseException | None = None

    async def result(self) -> bytes:
        """Wait for the flight; its bytes, or the error it ended with."""
        await self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.data is not None
        return self.data


F = TypeVar("F", bound=Flight)


@contextmanager
def flying(flights: dict[int, F], key: int, flight: F) -> Iterator[F]:
    """Run the body as the one flight for `key` in `flights`; the body sets `flight.data`."""
    flights[key] = flight
    try:
        yield flight
    except BaseException as exc:
        flight.error = exc if isinstance(exc, pyfuse3.FUSEError) else pyfuse3.FUSEError(errno.EIO)
        raise
    finally:
        del flights[key]
        flight.done.set()


class FileFlight(Flight):
    """The flight of a whole file: also its version's signature, whether the prefetcher
    started it (`ahead`) and whether the bytes are the whole file (`clean`: else they are
    the start of a file that grew past the size looked up, and are never cached)."""

    __slots__ = ("sig", "ahead", "clean")

    def __init__(self, ahead: bool = False) -> None:
        super().__init__()
        self.sig: Signature | None = None
        self.ahead = ahead
        self.clean = True

    def land(self, data: bytes, st: os.stat_result) -> None:
        """The fetch's outcome: `data` read from the version `st` describes."""
        self.data = data
        self.sig = Signature.of(st)
        self.clean = len(data) == st.st_size


async def fly_many(
    flights: dict[int, FileFlight],
    items: Sequence[tuple[int, bytes, int | None]],
    read_many: ReadMany,
    note: Callable[[list[int], list[int]], object],
) -> tuple[list[tuple[bytes, Signature] | BaseException | None], float]:
    """Fetch the (key, path, size) `items` in one source call, each as the one flight of
    its key (started by the prefetcher); a key already in flight is left to that flight.
    Every flight has landed or failed on return, and none is registered any more; `note`
    is told the keys and sizes fetched (the fetch log). Per item: (bytes, signature) of the
    whole file, its error, or None (in flight already, or it grew past its size); and the
    source's seconds per file (`ReadMany`)."""
    mine: list[tuple[int, bytes, int | None]] = []
    fl: list[FileFlight] = []
    for key, path, size in items:
        if key not in flights:
            flights[key] = flight = FileFlight(ahead=True)
            mine.append((key, path, size))
            fl.append(flight)
    if not mine:
        return [None] * len(items), 0.0
    try:
        got, seconds = await read_many([(p, s) for _, p, s in mine])
    except BaseException as exc:
        err = exc if isinstance(exc, pyfuse3.FUSEError) else pyfuse3.FUSEError(errno.EIO)
        for (key, _, _), flight in zip(mine, fl, strict=True):
            flight.error = err
            del flights[key]
            flight.done.set()
        raise
    ours: dict[int, tuple[bytes, Signature] | BaseException | None] = {}
    keys, sizes = [], []
    for (key, _, _), flight, one in zip(mine, fl, got, strict=True):
        if isinstance(one, pyfuse3.FUSEError):
            flight.error = ours[key] = one
        else:
            flight.land(*one)
            assert flight.sig is not None
            ours[key] = (one[0], flight.sig) if flight.clean else None
            keys.append(key)
            sizes.append(len(one[0]))
        del flights[key]  # before the event: a waiter that misses again starts afresh
        flight.done.set()
    note(keys, sizes)
    return [ours.get(k) for k, _, _ in items], seconds
