"""Single flight: at most one fetch per key in flight, however many readers want it.

The coordinator (whole files) and the block cache (blocks of large files) both fetch under
this rule (docs/developer-notes.md, invariant 4). A flight is registered under its key while
it runs; later openers wait on it and share its bytes or its error. The flight is removed
*before* its event is set, so a waiter that wakes and misses again starts a new fetch rather
than joining a finished one. A fetch that fails with anything but a FUSE error (cancellation
at unmount, a bug) gives its waiters EIO, while the original exception propagates.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import pyfuse3
import trio

from shadefs.cache.ssd_format import Signature

__all__ = ["FileFlight", "Flight", "flying"]


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


class FileFlight(Flight):
    """A whole file's fetch (cache/coordinator.py): its version, and who started it."""

    __slots__ = ("sig", "ahead", "clean")

    def __init__(self, ahead: bool = False) -> None:
        super().__init__()
        self.sig: Signature | None = None
        self.ahead = ahead  # started by the prefetcher, not by a reader
        self.clean = True  # the bytes are the whole file (else they are never cached)


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
