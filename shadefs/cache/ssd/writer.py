"""The SSD tier's write-behind queue, and the one OS thread, at a low CPU priority, that
does its disk work.

The write-behind must not be paid on the reader's time. Its cost is mostly in the kernel:
each entry is a new file, and creating an inode can cost far more than writing the bytes
(0.1-0.7 ms on the 2-core VM's ext4, which has no journal: its inode allocator steps over
every inode freed in the last half minute). A sequential tool that reads many small files
(`tar`, `sha256sum`) reads them faster than they can be written, so the writes must take
the CPU the readers leave, not the readers' cores.

So the writes run here, in batches (one thread hop for many entries), in a thread whose
nice value is `WRITER_NICE`: when the cores are busy the scheduler gives the reader and the
event loop first call. The queue absorbs the lag, bounded in entries and in bytes; a queue
that stays full drops writes (the tier counts them in `dropped_writes`), never the reader's
time. What is queued is an entry already: a reopen before the write lands reads the queued
bytes (`SsdTier.lookup`). The thread is the tier's own because a nice value belongs to a
thread and cannot be lowered again without CAP_SYS_NICE: in trio's shared thread cache it
would slow the source reads that reuse the thread.

The thread touches only the store (guarded by its own lock) and the job's arguments, as any
worker thread (docs/developer-notes.md, "One thread").
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import trio

from shadefs.file_version import Signature

log = logging.getLogger(__name__)

T = TypeVar("T")

# Weight 110 against a nice-0 thread's 1024 (CFS): about a tenth of a contended core, all of
# an idle one. Not SCHED_IDLE: on a node whose cores a training job keeps busy, the tier
# must still fill, only more slowly.
WRITER_NICE = 10
# The queue holds at most this many bytes (besides its count bound), unless it is empty: one
# file larger than this is still queued alone. 256 blocks of the default 1M, as the queue of
# 256 entries held before it had a byte bound; most of them are shared with the RAM tier's
# entries, the rest are the price of not making the reader wait.
QUEUE_BYTES = 256 << 20
# One thread hop writes at most this much: a batch's entries wait for the whole batch, and
# an unmount waits for the batch in hand.
BATCH = 64
BATCH_BYTES = 8 << 20


@dataclass(slots=True)
class Pending:
    key: int
    relpath: bytes
    data: bytes
    sig: Signature


class _Job(Generic[T]):
    """One call to run in the thread, and its outcome for the trio task that waits."""

    def __init__(self, fn: Callable[[], T], token: trio.lowlevel.TrioToken) -> None:
        self.fn = fn
        self.token = token
        self.done = trio.Event()
        self.value: T | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:  # handed to the waiting task, raised there
            self.error = exc
        try:
            self.token.run_sync_soon(self.done.set)
        except trio.RunFinishedError:
            pass  # the daemon's loop ended while we wrote: nobody waits any more


class WriterThread:
    """A lazily started OS thread at nice `nice` that runs jobs one at a time, in order."""

    def __init__(self, nice: int = WRITER_NICE, name: str = "shadefs-ssd-writer") -> None:
        self.nice = nice
        self.name = name
        self._jobs: queue.SimpleQueue[_Job[object] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.jobs = 0  # jobs run: the thread hops the write-behind cost the loop
        self.native_id: int | None = None  # the thread's id, once it has started

    async def run_sync(self, fn: Callable[[], T]) -> T:
        """`fn()` in the thread; its result or its exception.

        Not cancellable once handed over (as `trio.to_thread.run_sync`): a cancelled caller
        would release the room it reserved for the write while the write still runs.
        """
        if self._thread is None:
            self._start()
        job = _Job(fn, trio.lowlevel.current_trio_token())
        self._jobs.put(job)  # type: ignore[arg-type]
        with trio.CancelScope(shield=True):
            await job.done.wait()
        self.jobs += 1
        if job.error is not None:
            raise job.error
        return job.value  # type: ignore[return-value]

    def _start(self) -> None:
        started = threading.Event()
        # A daemon thread: an interpreter that exits without close() must not hang on it.
        self._thread = threading.Thread(target=self._run, args=(started,), name=self.name)
        self._thread.daemon = True
        self._thread.start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        self.native_id = threading.get_native_id()
        try:
            # PRIO_PROCESS with a thread id sets that one thread's nice value on Linux.
            os.setpriority(os.PRIO_PROCESS, self.native_id, self.nice)
        except OSError as exc:
            log.warning("cannot lower the SSD writer's priority: %s", exc)
        started.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job.run()

    def close(self) -> None:
        """Let the thread end after the jobs it has (idempotent; a later job restarts it)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join()


class WriteQueue:
    """What waits for the SSD, by key (queued or being written), and the thread that writes it.

    :thread: the writer thread, which the tier's writer task hands each batch to
    """

    def __init__(self, entries: int = 4096, max_bytes: int = QUEUE_BYTES) -> None:
        self._send, self._recv = trio.open_memory_channel[Pending](entries)
        self.max_bytes = max_bytes
        self.bytes = 0  # data bytes of the entries in `_pending`
        self._pending: dict[int, Pending] = {}
        self.thread = WriterThread()

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, key: int) -> bool:
        return key in self._pending

    def get(self, key: int) -> Pending | None:
        return self._pending.get(key)

    def put(self, item: Pending) -> bool:
        """Queue `item` (never blocks); False if the queue is full, in entries or bytes."""
        if self.bytes and self.bytes + len(item.data) > self.max_bytes:
            return False
        try:
            self._send.send_nowait(item)
        except trio.WouldBlock:
            return False
        self._pending[item.key] = item
        self.bytes += len(item.data)
        return True

    async def next_batch(self) -> list[Pending]:
        """The oldest queued entries, at least one, at most `BATCH` or `BATCH_BYTES`; they
        stay readable by key until `done`."""
        item = await self._recv.receive()
        batch, size = [item], len(item.data)
        while len(batch) < BATCH and size < BATCH_BYTES:
            try:
                item = self._recv.receive_nowait()
            except trio.WouldBlock:
                break
            batch.append(item)
            size += len(item.data)
        return batch

    def done(self, batch: list[Pending]) -> None:
        """The batch has landed or failed: a lookup goes to the disk (or the source) now."""
        for item in batch:
            if self._pending.get(item.key) is item:
                del self._pending[item.key]
                self.bytes -= len(item.data)
