"""Calls into the source in worker threads, each with a deadline, at the least trio allows.

`Source.run` puts every source access in a worker thread behind one `CapacityLimiter` and
under a timeout. With `trio.to_thread.run_sync` inside `trio.move_on_after` that costs about
80 us of CPU per call on the 2-core machine (the thread hop about 65, the cancel scope about
10-15), which is paid on every miss. This module does the same with trio's low-level
primitives:

- the thread comes from a thread cache like trio's (`start_thread_soon`) whose new threads
  do not stop the loop while they start (source/workers.py), and its result is handed
  back with one `run_sync_soon`, without `to_thread`'s context copy and bookkeeping for
  `trio.from_thread` calls (source calls make none);
- the limiter's token is taken without a checkpoint when one is free, and given back only
  when the thread really ends, so calls abandoned on a hung server keep holding theirs: the
  threads stuck in the kernel are at most the limiter's tokens, never reused until they
  return (the thread cache hands out only idle threads), and counted (`stuck`);
- a call's deadline runs from when it is made, whether it then waits for a token or runs
  in a thread: one that cannot get a thread by its deadline fails as one that timed out in
  a thread (`TimedOut`; `queue_timeouts` counts them). Without this, a hung server that
  holds every token would leave the calls queued behind them waiting until it answers.
  And while every token is held by a thread whose call timed out, no call can get one
  before the server answers again: a call then fails at once, as do those already queued.
  Requests that the kernel sends one after the other (lookups of names in one directory)
  would otherwise fail one timeout after the other. (A cancelled call's thread is counted
  as stuck too, but says nothing of the server: it does not make calls fail at once);
- deadlines are kept by one watchdog task per trio run (a system task, started on first
  use), not by a cancel scope per call. It sleeps until the earliest deadline of the calls
  waiting, or one timeout when none waits (a call made meanwhile has a later deadline), and
  is woken sooner only by a call with an earlier deadline, which never happens while every
  call has the same timeout. So it wakes about once per timeout however many calls
  complete, and a hung call fails on time;
- a call that must wait for a token waits in a queue of this module's own, not in the
  limiter's: a thread that ends hands its token to the first call queued and starts that
  call's thread itself, and the watchdog fails a queued call at its deadline as it fails a
  running one. So a queued call parks once and wakes once, with its result, and pays for no
  cancel scope: in a burst of misses against a hung server (hundreds queued behind the
  threads, all failing at one deadline) a queued miss costs the loop no more than one that
  got a thread, and the hits queued behind them in the kernel wait less.

When the server answers again, the stuck threads return one by one: each gives its token to
the next call queued (and starts its thread), and the pool is back to normal without
anyone's help.

A call whose task is cancelled (unmount) is abandoned at once, like `abandon_on_cancel`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

from shadefs.source.workers import Workers

log = logging.getLogger(__name__)

T = TypeVar("T")


class TimedOut(Exception):
    """A call did not end within the timeout: its thread was abandoned, or it got none."""


class _Call:
    __slots__ = ("task", "deadline", "waiting", "timed_out", "queued")

    def __init__(self, task: trio.lowlevel.Task, deadline: float) -> None:
        self.task = task
        self.deadline = deadline
        self.waiting = True  # False once answered, timed out or cancelled
        self.timed_out = False  # its thread ran past the deadline
        # What starts its thread once it gets a token; None once it has one.
        self.queued: Callable[[], None] | None = None


class Calls:
    """Worker-thread calls behind `limiter`, each ended by its deadline.

    :stuck: threads still in a call that their caller gave up (timed out or cancelled):
        they hold their tokens until the call returns
    :queue_timeouts: calls that timed out before they got a thread
    """

    def __init__(self, limiter: trio.CapacityLimiter) -> None:
        self.limiter = limiter
        self.workers = Workers()  # (source/workers.py)
        self.stuck = 0
        self.queue_timeouts = 0
        self._hung = 0  # of the stuck threads, those whose call timed out (not cancelled)
        # The calls waiting for a token, in the order they came (a thread that ends hands
        # its token to the first: `_next`).
        self._queue: dict[_Call, None] = {}
        self._waiting: dict[_Call, None] = {}  # in deadline order (insertion order)
        self._token: trio.lowlevel.TrioToken | None = None  # of the run the watchdog serves
        self._idle = math.inf  # the shortest timeout asked for: the watchdog's idle sleep
        self._target = math.inf  # when the watchdog wakes next
        self._wake = trio.Event()  # wakes it sooner (a call with an earlier deadline)

    async def run(self, timeout: float, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a worker thread; TimedOut `timeout` seconds after the call, whether
        it was still waiting for a thread or running in one."""
        await trio.lowlevel.checkpoint_if_cancelled()
        token = trio.lowlevel.current_trio_token()
        if timeout < self._idle:
            self._idle = timeout
        if token is not self._token:
            # The first call of this trio run (calls of an earlier run are gone with it).
            self._token = token
            self._waiting = {}
            self._queue = {}
            self._target = math.inf
            trio.lowlevel.spawn_system_task(self._watch, self._waiting, name="source deadlines")
        call = _Call(trio.lowlevel.current_task(), trio.current_time() + timeout)
        limiter = self.limiter
        waiting = self._waiting
        workers = self.workers

        def done(result: outcome.Outcome[T]) -> None:  # in the trio thread
            limiter.release_on_behalf_of(call)
            if call.waiting:
                call.waiting = False
                del waiting[call]
                trio.lowlevel.reschedule(call.task, result)
            else:
                self.stuck -= 1  # an abandoned call's thread came back (and its token)
                if call.timed_out:
                    self._hung -= 1
            if self._queue:
                self._next()

        def deliver(result: outcome.Outcome[T]) -> None:  # in the worker thread
            try:
                token.run_sync_soon(done, result)
            except trio.RunFinishedError:
                pass  # the daemon is gone; so is everything that waited

        def start() -> None:
            workers.start_soon(lambda: fn(*args), deliver)

        def abort(_: Any) -> trio.lowlevel.Abort:
            if call.waiting:
                call.waiting = False
                del waiting[call]
                if call.queued is None:
                    self.stuck += 1  # (a cancelled call says nothing of the source's health)
                else:
                    del self._queue[call]  # it had no thread: nothing runs on
            return trio.lowlevel.Abort.SUCCEEDED  # the thread runs on, abandoned

        try:
            limiter.acquire_on_behalf_of_nowait(call)
        except trio.WouldBlock:
            if self._hung >= limiter.total_tokens:
                # Every token is held by a call that timed out: none comes back before the
                # source answers, so this call would only wait for its deadline.
                self.queue_timeouts += 1
                raise TimedOut() from None
            call.queued = start
            self._queue[call] = None
        else:
            start()
        waiting[call] = None
        if call.deadline < self._target:
            self._wake.set()  # never with one timeout for all calls, but the watchdog must
        result: T = await trio.lowlevel.wait_task_rescheduled(abort)
        return result

    def _next(self) -> None:
        """Hand free tokens to the calls queued first (a thread ended). A call past its
        deadline that the watchdog has not failed yet gets none: it fails now, as it would."""
        now = trio.current_time()
        queue, limiter = self._queue, self.limiter
        while queue and limiter.available_tokens:
            call = next(iter(queue))
            del queue[call]
            start, call.queued = call.queued, None
            if call.deadline <= now:
                self._fail_queued(call)
                continue
            limiter.acquire_on_behalf_of_nowait(call)
            assert start is not None
            start()

    def _fail_queued(self, call: _Call) -> None:
        """A call that got no thread by its deadline (or never can) fails as one that timed
        out in a thread."""
        call.waiting = False
        del self._waiting[call]
        self.queue_timeouts += 1
        trio.lowlevel.reschedule(call.task, outcome.Error(TimedOut()))

    def _timed_out(self, call: _Call) -> None:
        """A running call timed out: its thread is stuck until the source answers."""
        call.timed_out = True
        self.stuck += 1
        self._hung += 1
        if self._hung >= self.limiter.total_tokens:
            # No token can come back before the source answers: the queued calls fail now.
            queue = self._queue
            self._queue = {}
            for queued in queue:
                queued.queued = None
                self._fail_queued(queued)

    async def _watch(self, waiting: dict[_Call, None]) -> None:
        """Fail the calls past their deadline (a system task: ends with its trio run)."""
        while True:
            now = trio.current_time()
            # With none waiting, any call made meanwhile has a deadline at least the
            # shortest timeout away: the watchdog need not wake before then.
            first = now + self._idle
            for call in list(waiting):
                if not call.waiting:
                    continue  # failed meanwhile (the queue's calls, once all threads hung)
                if call.deadline <= now:
                    if call.queued is not None:
                        call.queued = None
                        del self._queue[call]
                        self._fail_queued(call)
                        continue
                    call.waiting = False
                    del waiting[call]
                    self._timed_out(call)  # its thread runs on until the source answers
                    trio.lowlevel.reschedule(call.task, outcome.Error(TimedOut()))
                elif call.deadline < first:
                    first = call.deadline
            self._target = first
            self._wake = trio.Event()
            with trio.move_on_at(first):
                await self._wake.wait()
