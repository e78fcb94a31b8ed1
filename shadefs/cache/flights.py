"""Single flight: at most one fetch per key in flight, however many readers want it.

The coordinator (whole files) and the block cache (blocks of large files) both fetch under
this rule (docs/developer-notes.md, invariant 4). A flight is registered under its key while
it runs; later openers wait on it and share its bytes or its error. The flight is removed
*before* its event is set, so a waiter that wakes and misses again starts a new fetch rather
than joining a finished one. A fetch that fails with anything but a FUSE error (cancellation
at unmount, a bug) gives its waiters EIO, while the original exception propagates.

`fly_many` fetches several whole files in one source call (the prefetcher's batches: one
thread hop for many small files), each as the one flight of its key, so that a reader that
opens one of them meanwhile joins it, as it would a flight of its own. A batch whose every
file the source answers at once (`ReadNow`: a local source's cached files, read on the loop)
needs no flight at all: no reader runs between the first read and the caller's use of the
bytes (the prefetcher stages them before it awaits anything).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import pyfuse3
import trio

from shadefs.file_version import Signature

__all__ = ["FileFlight", "Flight", "fly_many", "flying"]

# The source's read of several (path, size): each file's (bytes, fstat) or FUSE error, and
# the seconds per file the worker thread spent (source/part.py's Source.read_files).
ReadMany = Callable[
    [Sequence[tuple[bytes, int | None]]],
    Awaitable[tuple[list[tuple[bytes, os.stat_result] | pyfuse3.FUSEError], float]],
]


# The source's read of one (path, size) at once, on the calling thread, or None when it would
# have to wait (source/part.py's Source.read_now).
ReadNow = Callable[[bytes, int | None], tuple[bytes, os.stat_result] | None]


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
    read_now: ReadNow | None = None,
) -> tuple[list[tuple[bytes, Signature] | BaseException | None], float]:
    """Fetch the (key, path, size) `items` in one source call, each as the one flight of
    its key (started by the prefetcher); a key already in flight is left to that flight.
    Every flight has landed or failed on return, and none is registered any more; `note`
    is told the keys and sizes fetched (the fetch log). Per item: (bytes, signature) of the
    whole file, its error, or None (in flight already, or it grew past its size); and the
    source's seconds per file (`ReadMany`). `read_now` is tried first on each file: a batch
    it answers whole returns with no flight and no await (module doc); otherwise what it
    read lands with the rest, after the source call for the others."""
    t0 = time.perf_counter()
    got: dict[int, tuple[bytes, os.stat_result] | pyfuse3.FUSEError] = {}
    rest: dict[int, tuple[bytes, int | None]] = {}  # key -> (path, size): for the source call
    for key, path, size in items:
        if key in flights or key in got or key in rest:
            continue
        one = read_now(path, size) if read_now is not None else None
        if one is None:
            rest[key] = (path, size)
        else:
            got[key] = one
    if not got and not rest:
        return [None] * len(items), 0.0
    seconds = (time.perf_counter() - t0) / len(items)
    fl: dict[int, FileFlight] = {}
    if rest:  # a source call that awaits: every file of the batch is a flight meanwhile
        fl = {key: FileFlight(ahead=True) for key in [*got, *rest]}
        flights.update(fl)
        try:
            many, seconds = await read_many(list(rest.values()))
        except BaseException as exc:
            err = exc if isinstance(exc, pyfuse3.FUSEError) else pyfuse3.FUSEError(errno.EIO)
            for key, flight in fl.items():
                flight.error = err
                del flights[key]
                flight.done.set()
            raise
        got.update(zip(rest, many, strict=True))
    ours: dict[int, tuple[bytes, Signature] | BaseException | None] = {}
    keys, sizes = [], []
    for key, res in got.items():
        landing = fl.get(key)
        if isinstance(res, pyfuse3.FUSEError):
            ours[key] = res
            if landing is not None:
                landing.error = res
        else:
            data, st = res
            sig = Signature.of(st)
            clean = len(data) == st.st_size
            ours[key] = (data, sig) if clean else None
            keys.append(key)
            sizes.append(len(data))
            if landing is not None:
                landing.data, landing.sig, landing.clean = data, sig, clean
        if landing is not None:
            del flights[key]  # before the event: a waiter that misses again starts afresh
            landing.done.set()
    note(keys, sizes)
    return [ours.get(k) for k, _, _ in items], seconds
