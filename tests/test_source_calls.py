"""Source calls in worker threads: results, errors, deadlines, cancellation, the limiter."""

from __future__ import annotations

import errno
import math
import threading

import pyfuse3
import pytest
import trio
import trio.testing

from shadefs.source.calls import Calls, TimedOut
from shadefs.source.part import Source


def _blocked(gate: threading.Event, started: threading.Event) -> str:
    started.set()
    gate.wait(10)
    return "late"


async def _wait_for(event: threading.Event) -> None:
    await trio.to_thread.run_sync(event.wait, 10)


async def test_a_call_returns_its_result_or_raises_its_error() -> None:
    calls = Calls(trio.CapacityLimiter(2))
    assert await calls.run(5, sum, [1, 2, 3]) == 6
    with pytest.raises(ZeroDivisionError):
        await calls.run(5, divmod, 1, 0)
    assert calls.limiter.borrowed_tokens == 0


async def test_a_hung_call_times_out_and_keeps_its_thread_token(
    mock_clock: trio.testing.MockClock,
) -> None:
    # The worker thread blocks outside trio: its deadline passes in virtual time. Once it is
    # released, the clock stands still (a thread's real time must not jump it to a deadline).
    mock_clock.autojump_threshold = 0
    calls = Calls(trio.CapacityLimiter(2))
    gate, started = threading.Event(), threading.Event()
    t0 = trio.current_time()
    with pytest.raises(TimedOut):
        await calls.run(0.3, _blocked, gate, started)
    assert trio.current_time() - t0 == pytest.approx(0.3)  # at its deadline, not before
    assert calls.limiter.borrowed_tokens == 1  # the thread is still stuck in its call
    mock_clock.autojump_threshold = math.inf
    gate.set()
    await _threads_back(calls)
    assert await calls.run(0.3, len, b"ok") == 2  # and calls go on afterwards


async def test_a_shorter_deadline_fires_first_whatever_the_order_of_the_calls(
    mock_clock: trio.testing.MockClock,
) -> None:
    mock_clock.autojump_threshold = 0
    calls = Calls(trio.CapacityLimiter(4))
    gate = threading.Event()
    failed: list[str] = []

    async def call(name: str, timeout: float) -> None:
        try:
            await calls.run(timeout, _blocked, gate, threading.Event())
        except TimedOut:
            failed.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, "short", 0.2)
        nursery.start_soon(call, "long", 30)
        with trio.fail_after(10):  # (virtual seconds)
            while not failed:
                await trio.sleep(0.01)
        assert failed == ["short"] and trio.current_time() < 30
        mock_clock.autojump_threshold = math.inf  # (its thread answers in real time)
        gate.set()  # the long one answers before its deadline
    assert failed == ["short"]


async def test_a_cancelled_caller_abandons_its_call(mock_clock: trio.testing.MockClock) -> None:
    mock_clock.autojump_threshold = 0
    calls = Calls(trio.CapacityLimiter(1))
    gate, started = threading.Event(), threading.Event()
    with trio.move_on_after(0.2) as scope:
        await calls.run(30, _blocked, gate, started)
    assert scope.cancelled_caught
    assert calls.limiter.borrowed_tokens == 1  # until the abandoned thread ends
    mock_clock.autojump_threshold = math.inf
    gate.set()
    await _threads_back(calls)


async def test_a_full_limiter_queues_the_next_call() -> None:
    calls = Calls(trio.CapacityLimiter(1))
    gate, started = threading.Event(), threading.Event()
    order: list[str] = []  # appended in the worker threads

    def first() -> str:
        got = _blocked(gate, started)
        order.append("first")
        return got

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: calls.run(30, first))
        await _wait_for(started)
        nursery.start_soon(lambda: calls.run(30, order.append, "second"))
        await trio.testing.wait_all_tasks_blocked()
        assert order == []  # waits for the one thread the limiter allows
        gate.set()
    # The second call's thread started once the first's ended, and both callers got
    # their results; the token is back.
    assert order == ["first", "second"]
    assert calls.limiter.borrowed_tokens == 0 and calls.queue_timeouts == 0


async def test_source_turns_a_timeout_into_eio_once_per_outage(
    tmp_path, mock_clock: trio.testing.MockClock
) -> None:
    mock_clock.autojump_threshold = 0  # (the calls time out in virtual time)
    src = Source(str(tmp_path), timeout=0.2, clock=trio.current_time)
    gate, started = threading.Event(), threading.Event()
    for _ in range(2):
        with pytest.raises(pyfuse3.FUSEError) as e:
            await src.run(_blocked, gate, started)
        assert e.value.errno == errno.EIO
    assert src.timeouts == 2 and not src.healthy
    mock_clock.autojump_threshold = math.inf  # (the next call's thread answers in real time)
    gate.set()
    assert await src.run(len, b"abc") == 3
    assert src.healthy


async def _threads_back(calls: Calls) -> None:
    """Until every abandoned thread has returned (they run in real time, outside trio: the
    wait is counted in real time, 10 s at most, whatever a MockClock does meanwhile)."""
    for _ in range(1000):
        if not calls.limiter.borrowed_tokens:
            return
        await trio.to_thread.run_sync(threading.Event().wait, 0.01)
    raise AssertionError("the abandoned threads did not return")


async def test_calls_beyond_the_threads_of_a_hung_source_fail_at_their_deadline(
    mock_clock: trio.testing.MockClock,
) -> None:
    # More concurrent calls than threads, into a source that never answers: every one ends
    # by its deadline, those that never got a thread included (they waited for ever before).
    mock_clock.autojump_threshold = 0
    calls = Calls(trio.CapacityLimiter(2))
    gate = threading.Event()
    ended: list[float] = []

    async def call() -> None:
        with pytest.raises(TimedOut):
            await calls.run(2.0, _blocked, gate, threading.Event())
        ended.append(trio.current_time())

    t0 = trio.current_time()
    with trio.fail_after(60):  # virtual seconds: a call that waits for ever fails the test
        async with trio.open_nursery() as nursery:
            for _ in range(7):
                nursery.start_soon(call)
    assert ended == [t0 + 2.0] * 7
    assert calls.queue_timeouts == 5  # never got a thread
    assert calls.stuck == 2 and calls.limiter.borrowed_tokens == 2  # never reused, bounded
    # The next call during the outage fails on time too, without a thread of its own.
    with pytest.raises(TimedOut):
        await calls.run(2.0, len, b"x")
    assert calls.queue_timeouts == 6
    # The source answers again: the stuck threads drain and calls go through on their own.
    # (The clock stands still from here: a thread's real time must not jump it to a deadline.)
    mock_clock.autojump_threshold = math.inf
    gate.set()
    await _threads_back(calls)
    assert calls.stuck == 0
    assert await calls.run(2.0, len, b"ok") == 2


async def test_a_cancelled_call_holds_its_thread_but_fails_no_other_call(
    mock_clock: trio.testing.MockClock,
) -> None:
    # Only calls that timed out say the source is hung; a call cancelled by its caller
    # keeps its thread till it returns, and the next call waits for that thread.
    mock_clock.autojump_threshold = 0
    calls = Calls(trio.CapacityLimiter(1))
    gate, started = threading.Event(), threading.Event()
    with trio.move_on_after(0.2):
        await calls.run(30, _blocked, gate, started)
    assert calls.stuck == 1
    mock_clock.autojump_threshold = math.inf  # (the threads answer in real time from here)
    got: list[int] = []

    async def second() -> None:
        got.append(await calls.run(30, len, b"abc"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # queued for the one thread, not failed
        gate.set()
    assert got == [3] and calls.stuck == 0 and calls.queue_timeouts == 0


async def test_a_queued_call_fails_at_its_deadline_while_the_thread_ahead_runs_on(
    mock_clock: trio.testing.MockClock,
) -> None:
    # A slow call (not a hung source: its deadline is far) holds the one thread; the call
    # queued behind it fails at its own deadline, and takes no token afterwards.
    calls = Calls(trio.CapacityLimiter(1))
    gate, started = threading.Event(), threading.Event()
    got: list[str] = []

    async def slow() -> None:
        got.append(await calls.run(100, _blocked, gate, started))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(slow)
        await _wait_for(started)
        t0 = trio.current_time()
        mock_clock.autojump_threshold = 0  # (from here to the first deadline: 2 s)
        with trio.fail_after(60), pytest.raises(TimedOut):
            await calls.run(2.0, len, b"x")
        assert trio.current_time() == t0 + 2.0
        assert calls.queue_timeouts == 1 and calls.stuck == 0
        mock_clock.autojump_threshold = math.inf  # (the thread's real time must not jump)
        gate.set()
    assert got == ["late"] and calls.limiter.borrowed_tokens == 0


async def test_a_cancelled_queued_call_leaves_the_queue_and_holds_nothing() -> None:
    calls = Calls(trio.CapacityLimiter(1))
    gate, started = threading.Event(), threading.Event()
    ran: list[str] = []  # appended in worker threads

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: calls.run(30, _blocked, gate, started))
        await _wait_for(started)
        with trio.CancelScope() as scope:

            async def cancel_once_queued() -> None:
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()

            nursery.start_soon(cancel_once_queued)
            await calls.run(30, ran.append, "cancelled")
        assert scope.cancelled_caught
        nursery.start_soon(lambda: calls.run(30, ran.append, "queued"))
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    # The cancelled call never ran (it had no thread to abandon: not stuck); the one
    # queued after it got the token.
    assert ran == ["queued"]
    assert calls.stuck == 0 and calls.queue_timeouts == 0 and calls.limiter.borrowed_tokens == 0
