"""The readers part: its sweep ends idle jobs, reading its state changes nothing, and one
tracker answers every part that asks about epochs."""

from __future__ import annotations

import numpy as np
import trio
import trio.testing

from shadefs.cache.fetchlog import FetchLog
from shadefs.cache.policies import EpochPolicy
from shadefs.readers.jobs import JobTable, ProcInfo
from shadefs.readers.part import SETTLE, Readers
from shadefs.readers.pending import PendingReads


def _readers(idle: float = 4.0) -> Readers:
    pending = PendingReads(lambda key: key if 0 <= key < 10 else -1)
    pending.reset(10)
    return Readers(JobTable(idle, ProcInfo("/nonexistent"), trio.current_time), pending)


def test_the_sweep_ends_an_idle_job_everywhere_and_stats_change_nothing() -> None:
    readers = _readers()
    readers.pending.expect(0, np.arange(10), job=0)

    async def run() -> None:
        async def ticking() -> None:  # (as the cache ticks its readers)
            while True:
                await trio.sleep(SETTLE)
                readers.tick()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticking)
            for key in (1, 2):
                readers.read(key, pid=7)
                readers.read(key, pid=8)
            assert len(readers.tracker.active) == 2
            for t in range(40):  # pid 7's job keeps reading, pid 8's does not
                readers.read(3 + t % 2, pid=7).hits += 1  # as the cache counts a hit
                assert len(readers.describe()) == len(readers.jobs.jobs)
                await trio.sleep(0.25)
                if len(readers.jobs.jobs) == 1:
                    break
            (job,) = readers.jobs.jobs.values()
            assert job.id == "pid:7" and list(readers.tracker.active) == [job.row]
            nursery.cancel_scope.cancel()

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    assert readers.jobs.expired == 1
    # pid 7's job (row 0) counts what its order still reads: 0 and 5-9.
    assert np.flatnonzero(readers.pending.left).tolist() == [0, 5, 6, 7, 8, 9]


def test_reading_the_state_never_changes_it() -> None:
    async def run() -> None:
        readers = _readers(idle=0.0)  # every job would be idle at once
        for key in (1, 2, 3):
            readers.read(key, pid=5)
        t = readers.tracker
        before = (t.generation, dict(t.active), len(readers.jobs.jobs))
        for _ in range(3):
            readers.describe()
            EpochPolicy(t).describe()
        assert (t.generation, dict(t.active), len(readers.jobs.jobs)) == before

    trio.run(run)


def test_every_part_hears_the_same_epoch_from_the_one_tracker() -> None:
    readers = Readers()
    tracker = readers.tracker
    ram, ssd = EpochPolicy(tracker), EpochPolicy(tracker)
    log = FetchLog(tracker)
    for key in range(4):
        readers.read(key, pid=3)
        for policy in (ram, ssd):
            policy.accessed(key, False, 0)
            policy.inserted(key, 1)
        log.note(key, 1)
    readers.read(0, pid=3)  # the whole universe read: 0 again begins epoch 1
    assert readers.tracker.epochs_of() == {readers.row_of(3): 1}
    assert ram.describe().epoch == ssd.describe().epoch == 1
    assert not log.note(1, 1)  # a new epoch: 1 may be fetched once more
    assert log.note(1, 1)  # twice in one epoch: a refetch
    readers.announce(5, readers.row_of(3))  # the sampler's word wins
    assert ram.epoch == 5 and ram.describe().epoch_source == "sampler"
