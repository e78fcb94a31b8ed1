"""Worker threads for source calls, started without stopping the event loop.

trio's thread cache (`trio.lowlevel.start_thread_soon`) starts a thread with
`threading.Thread.start`, which waits until the new thread runs and says so: the event loop
sleeps meanwhile, for as long as the OS takes to give the new thread a CPU and the GIL. In a
burst of misses on a cold cache (trio lets an idle thread go after 10 s) that is one wait
per thread, up to `--source-threads` of them, and on a loaded machine each is a scheduler
round: with the burst's requests queued in the kernel, every hit behind them waited too
(`tools/bench/bench_hang.py` showed the loop thread of a loaded daemon neither running nor
waiting for a CPU for most of such a hit's 130 ms). Here a new thread is started with
`_thread.start_new_thread`, which returns as soon as the thread exists, with its first job
already handed in.

Otherwise this is trio's cache: a job goes to an idle thread first, an idle thread waits
`IDLE_TIMEOUT` seconds for its next job and then ends, and a thread that is in a call is
never handed another (so a thread stuck in a hung source is never reused).
"""

from __future__ import annotations

import _thread
import sys
import traceback
from collections.abc import Callable
from typing import Any

import outcome

__all__ = ["IDLE_TIMEOUT", "Workers"]

#: Seconds an idle thread waits for a job before it ends (as trio's cache).
IDLE_TIMEOUT = 10.0

Job = tuple[Callable[[], Any], Callable[[outcome.Outcome[Any]], object]]


class _Worker:
    __slots__ = ("_job", "_lock", "_workers")

    def __init__(self, workers: Workers, job: Job) -> None:
        self._workers = workers
        self._job: Job | None = job
        # Held while the worker has no job: `hand` releases it with the job in place.
        self._lock = _thread.allocate_lock()

    def hand(self, job: Job) -> None:
        self._job = job
        self._lock.release()

    def work(self) -> None:
        job = self._job
        while True:
            if job is None:
                if not self._lock.acquire(timeout=IDLE_TIMEOUT):
                    # Idle for long enough, unless a job is being handed in just now: then
                    # `Workers.start_soon` took this worker from the idle ones first.
                    try:
                        del self._workers.idle[self]
                    except KeyError:
                        continue
                    return
                job = self._job
                assert job is not None
            self._job = None
            fn, deliver = job
            del job
            result = outcome.capture(fn)
            del fn  # (nothing of the call stays alive while this thread idles)
            # Idle before the delivery, so that a job the delivery starts may come here.
            self._workers.idle[self] = None
            try:
                deliver(result)
            except BaseException as exc:  # as trio's cache: a thread has no one to raise to
                print("Exception while delivering result of thread", file=sys.stderr)
                traceback.print_exception(type(exc), exc, exc.__traceback__)
            job = None


class Workers:
    """The threads of one `Calls`.

    :started: threads started so far
    """

    def __init__(self) -> None:
        # Idle workers (a dict: atomic popitem and del under the GIL, from any thread).
        self.idle: dict[_Worker, None] = {}
        self.started = 0

    def start_soon(
        self, fn: Callable[[], Any], deliver: Callable[[outcome.Outcome[Any]], object]
    ) -> None:
        """Run fn() in a worker thread, then deliver(its outcome) there (as trio's
        `start_thread_soon`)."""
        try:
            worker, _ = self.idle.popitem()
        except KeyError:
            worker = _Worker(self, (fn, deliver))
            worker._lock.acquire()  # (its first job is in place: it takes it at once)
            _thread.start_new_thread(worker.work, ())
            self.started += 1
            return
        worker.hand((fn, deliver))
