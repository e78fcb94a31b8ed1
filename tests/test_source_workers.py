"""The source calls' thread cache: jobs, reuse of idle threads only, idle threads ending."""

from __future__ import annotations

import threading

import outcome
import pytest

from shadefs.source import workers as workers_module
from shadefs.source.workers import Workers
from tests.conftest import poll


class _Box:
    """What the worker threads delivered, and to whom."""

    def __init__(self) -> None:
        self.got: list[outcome.Outcome[object]] = []
        self.threads: list[int] = []

    def deliver(self, result: outcome.Outcome[object]) -> None:
        self.threads.append(threading.get_ident())
        self.got.append(result)

    def wait(self, count: int) -> None:
        # (real threads: the bound is a failure's, not a speed)
        poll(lambda: len(self.got) >= count, f"{count} deliveries", 10, interval=0.001)


def test_a_job_runs_in_a_thread_and_delivers_its_outcome() -> None:
    workers, box = Workers(), _Box()
    workers.start_soon(lambda: 6 * 7, box.deliver)
    workers.start_soon(lambda: 1 // 0, box.deliver)
    box.wait(2)
    values = [r.unwrap() for r in box.got if isinstance(r, outcome.Value)]
    errors = [r.error for r in box.got if isinstance(r, outcome.Error)]
    assert values == [42] and isinstance(errors[0], ZeroDivisionError)
    assert threading.get_ident() not in box.threads


def test_an_idle_thread_takes_the_next_job_and_a_busy_one_never() -> None:
    workers, box = Workers(), _Box()
    workers.start_soon(lambda: 1, box.deliver)
    box.wait(1)
    # (idle just before its delivery: it is, or will be at once)
    poll(lambda: workers.idle, "the thread idle", 10, interval=0.001)
    workers.start_soon(lambda: 2, box.deliver)
    box.wait(2)
    assert workers.started == 1 and box.threads[0] == box.threads[1]
    # A thread in a call (a hung source) is never handed another: a second thread starts.
    gate = threading.Event()
    workers.start_soon(lambda: gate.wait(10), box.deliver)
    workers.start_soon(lambda: 3, box.deliver)
    box.wait(3)
    assert workers.started == 2 and box.got[2].unwrap() == 3
    gate.set()
    box.wait(4)


def test_an_idle_thread_ends_after_the_idle_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers_module, "IDLE_TIMEOUT", 0.05)
    workers, box = Workers(), _Box()
    workers.start_soon(lambda: threading.get_native_id(), box.deliver)
    box.wait(1)
    tid = box.got[0].unwrap()
    poll(lambda: not workers.idle and not _alive(tid), "the idle thread ended", 10, interval=0.01)
    # The next job starts a thread again.
    workers.start_soon(lambda: 5, box.deliver)
    box.wait(2)
    assert box.got[1].unwrap() == 5 and workers.started == 2


def _alive(tid: int) -> bool:
    try:
        with open(f"/proc/self/task/{tid}/stat"):
            return True
    except FileNotFoundError:
        return False
