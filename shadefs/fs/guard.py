"""The wrapper of every request handler of `fs/operations.py`: counts, bugs as EIO, hits first.

pyfuse3 only catches FUSEError: any other exception leaves its request loop and takes the
whole mount down, which for a training job is far worse than one failed read. Each public
coroutine of the handler class (and of `ReadOnly`, its write-type handlers) is wrapped so
that a bug answers EIO with a logged traceback, and the request is counted (stats.json
`requests`: requests per sample).

A handler `name` may have a synchronous hit path `_hit_<name>`, tried first: a warm open
and its release then cost no coroutine beyond the wrapper's. It returns `PASS` when the
handler must answer. What a hit path leaves for later (the cache's hit log, `Cache.hit`)
is taken in by the instance's `_settle` before any handler runs, so that no other request
meets a read out of its order.
"""

from __future__ import annotations

import errno
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import pyfuse3
import trio

from shadefs.fs.readonly import ReadOnly

__all__ = ["PASS", "Pass", "guard_handlers"]

T = TypeVar("T")
OpsT = TypeVar("OpsT")


class Pass:
    """What a synchronous hit path (`_hit_<name>`) returns when the handler must answer."""


PASS = Pass()


# The wrapper is compiled for each handler with the handler's own parameters: a warm open
# and its release are two calls of a few microseconds each, and `*args` (a tuple packed at
# the call, again for the hit path and again for the handler) cost ~0.4 us of them
# (tools/bench/bench_handlers.py). The source is this module's own; only parameter names
# of the handler class go into it. Whether the handler has a hit path is known then too:
# only those that have one test it (`_HIT`).
_WRAPPER = """
async def {name}(self, {params}):
    _g_counts = self.metrics.requests  # stats.json `requests`: requests per sample
    _g_counts[_g_name] = _g_counts.get(_g_name, 0) + 1
    try:{hit}
        self._settle()
        return await _g_fn(self, {params})
    except (_g_FUSEError, _g_Cancelled):
        raise
    except Exception:
        _g_log.exception("%s failed; answering EIO", _g_name)
        raise _g_FUSEError(_g_EIO) from None
"""
_HIT = """
        _g_got = _g_hit(self, {params})
        if _g_got is not _g_PASS:
            return _g_got"""


def _guarded(
    fn: Callable[..., Awaitable[T]], hit: Callable[..., T | Pass] | None
) -> Callable[..., Awaitable[T]]:
    name = fn.__name__
    params = list(inspect.signature(fn).parameters.values())[1:]  # (without self)
    if any(p.kind is not p.POSITIONAL_OR_KEYWORD or p.name.startswith("_g_") for p in params):
        raise TypeError(f"handler {name}: only positional parameters, none named _g_*")
    scope: dict[str, Any] = {
        "_g_name": name,
        "_g_hit": hit,
        "_g_fn": fn,
        "_g_PASS": PASS,
        "_g_FUSEError": pyfuse3.FUSEError,
        "_g_Cancelled": trio.Cancelled,
        "_g_EIO": errno.EIO,
        "_g_log": logging.getLogger(fn.__module__),  # (the handler's module logs its bug)
    }
    args = ", ".join(p.name for p in params)
    check = "" if hit is None else _HIT.format(params=args)
    exec(_WRAPPER.format(name=name, params=args, hit=check), scope)
    handler = scope[name]
    handler.__defaults__ = fn.__defaults__
    return cast(Callable[..., Awaitable[T]], functools.wraps(fn)(handler))


def guard_handlers(cls: type[OpsT]) -> type[OpsT]:
    """Wrap the public coroutines of `cls` and of `ReadOnly` (class decorator)."""
    for name, fn in {**vars(ReadOnly), **vars(cls)}.items():
        if inspect.iscoroutinefunction(fn) and not name.startswith("_"):
            setattr(cls, name, _guarded(fn, vars(cls).get(f"_hit_{name}")))
    return cls
