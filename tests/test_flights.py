"""Single flight for the prefetcher's batches (cache/flights.py `fly_many`)."""

from __future__ import annotations

import errno
from types import SimpleNamespace

import pyfuse3
import pytest
import trio
import trio.testing

from shadefs.cache.flights import FileFlight, fly_many
from shadefs.file_version import Signature


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


def test_a_batch_the_source_answers_at_once_needs_no_flight_and_no_await() -> None:
    flights: dict[int, FileFlight] = {}
    busy = flights[9] = FileFlight()  # a reader's own fetch of 9 is in flight

    def read_now(path: bytes, size: int | None):
        assert set(flights) == {9}  # no flight of the batch's: no reader could join one
        return (path * 2, _st(2))

    async def read_many(items):
        raise AssertionError("every file was answered at once")

    noted: list = []
    coro = fly_many(flights, [(1, b"a", 2), (9, b"x", 2), (2, b"b", 2)], read_many,
                    lambda k, s: noted.append(k), read_now)  # fmt: skip
    with pytest.raises(StopIteration) as done:  # it returns at its first step: no await
        coro.send(None)
    out, _ = done.value.value
    assert out == [(b"aa", Signature(2, 1, 1, 7)), None, (b"bb", Signature(2, 1, 1, 7))]
    assert noted == [[1, 2]] and flights == {9: busy}


def test_what_was_read_at_once_is_a_flight_while_the_rest_is_read() -> None:
    async def run() -> None:
        flights: dict[int, FileFlight] = {}
        go = trio.Event()
        asked: list = []
        tried: list = []

        def read_now(path: bytes, size: int | None):
            tried.append(path)
            return None if path == b"b" else (path * 2, _st(2))  # b is not in memory

        async def read_many(items):
            asked.append([p for p, _ in items])
            await go.wait()
            return [(b"bb", _st(2))], 1e-5

        out: list = []
        joined: list = []

        async def batch() -> None:
            items = [(1, b"a", 2), (2, b"b", 2), (3, b"c", 2)]
            out.extend((await fly_many(flights, items, read_many, lambda k, s: None, read_now))[0])

        async def reader() -> None:
            joined.append(await flights[1].result())  # opens 1 while the batch waits for 2

        async with trio.open_nursery() as nursery:
            nursery.start_soon(batch)
            await trio.testing.wait_all_tasks_blocked()
            assert set(flights) == {1, 2, 3}  # the files read already too: no second fetch
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            go.set()
        assert tried == [b"a", b"b", b"c"] and asked == [[b"b"]]  # each file read once
        assert joined == [b"aa"] and not flights
        assert [o[0] for o in out] == [b"aa", b"bb", b"cc"]

    trio.run(run)


def test_a_key_twice_in_a_batch_is_read_once() -> None:
    asked: list = []

    async def read_many(items):
        asked.append([p for p, _ in items])
        return [(b"aa", _st(2))], 1e-5

    async def run() -> list:
        flights: dict[int, FileFlight] = {}
        items = [(1, b"a", 2), (1, b"a", 2)]
        return (await fly_many(flights, items, read_many, lambda k, s: None, lambda p, s: None))[0]

    out = trio.run(run)
    assert asked == [[b"a"]] and out[0] == out[1] == (b"aa", Signature(2, 1, 1, 7))
