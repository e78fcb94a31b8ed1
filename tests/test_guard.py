"""fs/guard.py: the wrapper of every request handler (counts, bugs as EIO, hits first).

The wrapper is compiled per handler with the handler's own parameters (no `*args`), so
these tests check that it still behaves as the handler would: same names, same defaults,
same errors, and that what it cannot wrap is refused when the class is built.
"""

from __future__ import annotations

import errno
import logging
from types import SimpleNamespace

import pyfuse3
import pytest
import trio

from shadefs.fs.guard import PASS, guard_handlers
from shadefs.fs.readonly import ReadOnly


@guard_handlers
class _Ops(ReadOnly):
    def __init__(self) -> None:
        self.metrics = SimpleNamespace(requests={})
        self.settled = 0

    def _settle(self) -> None:
        self.settled += 1

    def _hit_fetch(self, fh: int, off: int, size: int = 7) -> object:
        return ("hit", fh, off, size) if fh == 1 else PASS

    async def fetch(self, fh: int, off: int, size: int = 7) -> object:
        if fh == 2:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if fh == 3:
            raise KeyError("a bug")
        return ("fetched", fh, off, size)


def test_the_wrapper_takes_the_handlers_parameters_and_defaults() -> None:
    ops = _Ops()
    assert trio.run(ops.fetch, 1, 0) == ("hit", 1, 0, 7)
    assert ops.settled == 0  # a hit answers before the log is taken in
    assert trio.run(lambda: ops.fetch(fh=5, off=4, size=3)) == ("fetched", 5, 4, 3)
    assert ops.settled == 1
    assert ops.metrics.requests == {"fetch": 2}
    assert _Ops.fetch.__name__ == "fetch" and _Ops.fetch.__doc__ is None


def test_a_fuse_error_passes_and_a_bug_answers_eio(caplog: pytest.LogCaptureFixture) -> None:
    ops = _Ops()
    with pytest.raises(pyfuse3.FUSEError) as got:
        trio.run(ops.fetch, 2, 0)
    assert got.value.errno == errno.ENOENT
    assert not caplog.records
    with caplog.at_level(logging.ERROR), pytest.raises(pyfuse3.FUSEError) as got:
        trio.run(ops.fetch, 3, 0)
    assert got.value.errno == errno.EIO
    assert "fetch failed; answering EIO" in caplog.text and "KeyError" in caplog.text


def test_a_handler_the_wrapper_cannot_take_is_refused_when_the_class_is_built() -> None:
    with pytest.raises(TypeError, match="only positional"):

        @guard_handlers
        class _Star(ReadOnly):
            async def fetch(self, *args: object) -> None:
                pass

    with pytest.raises(TypeError, match="_g_"):

        @guard_handlers
        class _Clash(ReadOnly):
            async def fetch(self, _g_fn: object) -> None:
                pass
