"""The wrapper of every request handler of `fs/operations.py`: counts, bugs as EIO, hits first.

pyfuse3 only catches FUSEError: any other exception leaves its request loop and takes the
whole mount down, which for a training job is far worse than one failed read. Each public
coroutine of the handler class (and of `ReadOnly`, its write-type handlers) is wrapped so
that a bug answers EIO with a logged traceback, and the request is counted (stats.json
`requests`: requests per sample).

A handler `name` may have a synchronous hit path `_hit_<name>`, tried first: a warm open
and its release then cost no coroutine beyond the wrapper's. It returns `PASS` when the
handler must answer. What a hit path leaves for later (the cache's hit log, cache/hits.py)
is taken in by the instance's `_settle` before any handler runs, so that no other request
meets a read out of its order.
"""

from __future__ import annotations

import errno
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pyfuse3
import trio

from shadefs.fs.readonly import ReadOnly

__all__ = ["PASS", "Pass", "guard_handlers"]

T = TypeVar("T")
OpsT = TypeVar("OpsT")


class Pass:
    """What a synchronous hit path (`_hit_<name>`) returns when the handler must answer."""


PASS = Pass()


def _guarded(
    fn: Callable[..., Awaitable[T]], hit: Callable[..., T | Pass] | None
) -> Callable[..., Awaitable[T]]:
    name = fn.__name__
    log = logging.getLogger(fn.__module__)  # (the handler's module logs its bug)

    @functools.wraps(fn)
    async def handler(self: Any, *args: object) -> T:
        counts = self.metrics.requests  # stats.json `requests`: requests per sample
        counts[name] = counts.get(name, 0) + 1
        try:
            if hit is not None:
                got = hit(self, *args)
                if got is not PASS:
                    return got  # type: ignore[return-value]  # (not PASS: a T)
            self._settle()
            return await fn(self, *args)
        except (pyfuse3.FUSEError, trio.Cancelled):
            raise
        except Exception:
            log.exception("%s failed; answering EIO", name)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return handler


def guard_handlers(cls: type[OpsT]) -> type[OpsT]:
    """Wrap the public coroutines of `cls` and of `ReadOnly` (class decorator)."""
    for name, fn in {**vars(ReadOnly), **vars(cls)}.items():
        if inspect.iscoroutinefunction(fn) and not name.startswith("_"):
            setattr(cls, name, _guarded(fn, vars(cls).get(f"_hit_{name}")))
    return cls
