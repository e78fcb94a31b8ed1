"""Single flight for the prefetcher's batches (cache/flights.py `fly_many`)."""

from __future__ import annotations

import errno
from types import SimpleNamespace

import pyfuse3
import pytest
import trio
import trio.testing

from shadefs.cache.flights import FileFlight, fly_many
from shadefs.cache.ssd_format import Signature


def _st(size: int) -> SimpleNamespace:
    return SimpleNamespace(st_size=size, st_mtime_ns=1, st_ctime_ns=1, st_ino=7)


def test_a_batch_is_one_flight_per_key_and_a_reader_joins_it() -> None:
    async def run() -> None:
        flights: dict[int, FileFlight] = {}
        go = trio.Event()
        asked = []

        async def read_many(items):
            asked.append([p for p, _ in items])
            await go.wait()
            return [(b"aa", _st(2)), pyfuse3.FUSEError(errno.ENOENT), (b"ccc", _st(2))], 1e-5

        busy = flights[9] = FileFlight()  # a reader's own fetch of 9 is in flight
        items = [(1, b"a", 2), (2, b"b", 2), (9, b"x", 2), (3, b"c", 2)]
        out: list = []
        joined: list = []
        noted: list = []

        async def batch() -> None:
            out.extend((await fly_many(flights, items, read_many, lambda k, s: noted.append(k)))[0])

        async def reader() -> None:
            joined.append(await flights[1].result())  # opens 1 while the batch reads it

        async with trio.open_nursery() as nursery:
            nursery.start_soon(batch)
            await trio.testing.wait_all_tasks_blocked()
            assert set(flights) == {1, 2, 3, 9} and flights[9] is busy
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            go.set()
        assert asked == [[b"a", b"b", b"c"]]  # 9 is left to its own flight
        assert joined == [b"aa"] and set(flights) == {9}
        one, two, nine, three = out
        assert one == (b"aa", Signature(2, 1, 1, 7))
        assert isinstance(two, pyfuse3.FUSEError) and two.errno == errno.ENOENT
        assert nine is None
        assert three is None  # it grew past its size: never cached, nor staged
        assert noted == [[1, 3]]  # the fetch log hears of what crossed the link

    trio.run(run)


def test_a_failed_batch_fails_every_flight_and_leaves_none() -> None:
    async def run() -> None:
        flights: dict[int, FileFlight] = {}
        go = trio.Event()

        async def read_many(items):
            await go.wait()
            raise RuntimeError("a bug")

        got: list[object] = []

        async def batch() -> None:
            with pytest.raises(RuntimeError):  # the original error propagates
                await fly_many(flights, [(1, b"a", 1), (2, b"b", 1)], read_many, lambda k, s: None)
            got.append("raised")

        async def reader() -> None:
            try:
                await flights[2].result()
            except pyfuse3.FUSEError as exc:
                got.append(exc.errno)  # its waiters get EIO

        async with trio.open_nursery() as nursery:
            nursery.start_soon(batch)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            go.set()
        assert sorted(got, key=str) == [errno.EIO, "raised"] and not flights

    trio.run(run)
