"""Jobs: which training job a reader belongs to, and what each job has read.

Several jobs share one mount in a hyperparameter sweep (HFTA's setting). The daemon tells
them apart without code changes, from the process tree of the reading process (FUSE gives
the caller's thread id with every request):

- a reader's job is the topmost ancestor reached by walking up while the parent runs the
  same program (same /proc/<pid>/exe, or argv[0] when exe is unreadable) *and* is the same
  invocation: the same command line (a fork, such as a DataLoader worker), or the child is a
  multiprocessing helper (`spawn_main`, the forkserver). So the workers of a job map to the
  training process, while jobs that one shell script, a scheduler or a Python driver starts
  as separate commands stay apart, even though they share a process group and a session;
- a sampler may name its job (`name`), and then its reads count under that name.

Each job gets a dense *row* (a small int, reused after the job ends) that the cache hands
to its policy with every access, so that the policy keeps per-job state in numpy rows.
A job with no reads for `idle` seconds is over: `expire` drops it and returns its rows.

The pid -> job mapping is cached, so the hit path reads /proc only for a pid it has not
seen, and reads no clock: the reads are counted in the job, and a periodic `expire` (the
readers' sweep, readers/part.py, runs it a few times per idle period) turns a changed
count into a `last_seen`, ends the idle jobs, and re-checks each cached pid's start
time, so that a reused pid (or one that exited) is resolved afresh.
"""

from __future__ import annotations

import logging
import os
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from shadefs.stats import JobStats

log = logging.getLogger(__name__)

# How many ancestors a walk visits at most (a loop in /proc would be a kernel bug; be safe).
_MAX_DEPTH = 64
DEFAULT_IDLE = 120.0
_CHUNK = 64 << 10  # what one read of a /proc file asks for


@dataclass(slots=True)
class Job:
    """One job: its id, its group, and what it read (a handful of jobs: plain objects)."""

    id: str
    row: int
    group: str = ""
    hits: int = 0
    misses: int = 0
    bytes: int = 0
    last_seen: float = 0.0  # the table's clock at its last read (to the sweep period)
    swept_opens: int = 0  # hits + misses at the last expiry sweep
    pids: set[int] = field(default_factory=set)
    root: int = 0  # the process it is named for (`job_root`), 0: none known
    root_start: int | None = None  # that process's start time, when first seen
    # The keys it opened since the speculator last took them (its plans' entries are
    # consumed in batches, prefetch/speculate.py): the hit path appends one machine word.
    reads: array[int] = field(default_factory=lambda: array("Q"))


def _read(path: str) -> bytes | None:
    # (os-level calls, not open(): a burst of misses from new threads resolves a few
    # hundred readers on the event loop, and a buffered file object costs more than the
    # read. A /proc file is read whole up to the size asked: a shorter read is its end.)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        parts = []
        while True:
            chunk = os.read(fd, _CHUNK)
            parts.append(chunk)
            if len(chunk) < _CHUNK:
                break
    except OSError:
        return None
    finally:
        os.close(fd)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class ProcInfo:
    """What the job resolution reads from /proc (a class so that tests can point it elsewhere)."""

    def __init__(self, root: str = "/proc") -> None:
        self.root = root

    def start_time(self, pid: int, live: bool = False) -> int | None:
        """Field 22 of /proc/<pid>/stat (the start time in ticks), or None if it is gone
        (`live`: or if it exited and waits to be reaped, a zombie)."""
        raw = _read(f"{self.root}/{pid}/stat")
        if raw is None:
            return None
        # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
        rest = raw[raw.rfind(b")") + 2 :].split()
        try:
            if live and rest[0] in (b"Z", b"X"):
                return None
            return int(rest[19])
        except (IndexError, ValueError):
            return None

    def tgid_ppid(self, pid: int) -> tuple[int, int] | None:
        """(the process of thread `pid`, that process's parent), or None if it is gone."""
        raw = _read(f"{self.root}/{pid}/status")
        if raw is None:
            return None
        tgid = ppid = -1
        for line in raw.splitlines():
            if line.startswith(b"Tgid:"):
                tgid = int(line.split()[1])
            elif line.startswith(b"PPid:"):
                ppid = int(line.split()[1])
                break
        return (tgid, ppid) if tgid > 0 else None

    def cmdline(self, pid: int) -> bytes:
        return _read(f"{self.root}/{pid}/cmdline") or b""

    def program(self, pid: int) -> bytes:
        try:
            return os.fsencode(os.readlink(f"{self.root}/{pid}/exe"))
        except OSError:
            return self.cmdline(pid).split(b"\0", 1)[0]


def _mp_helper(cmdline: bytes) -> bool:
    # multiprocessing's spawn and forkserver start their children with `-c` code that names
    # the module; such a child belongs to whoever started it.
    return b"multiprocessing" in cmdline and (b"spawn_main" in cmdline or b"forkserver" in cmdline)


def job_root(pid: int, proc: ProcInfo) -> int:
    """The process whose job `pid` (a thread id) reads for: see the module docstring."""
    return _root_of(pid, proc.tgid_ppid(pid), proc)


def _root_of(pid: int, ids: tuple[int, int] | None, proc: ProcInfo) -> int:
    """`job_root` of `pid`, whose (process, parent) are `ids` (None: it is gone)."""
    if ids is None:
        return pid
    root, parent = ids
    program, cmdline = proc.program(root), proc.cmdline(root)
    for _ in range(_MAX_DEPTH):
        if parent <= 1:
            break
        up = proc.tgid_ppid(parent)
        if up is None or proc.program(parent) != program:
            break
        parent_cmd = proc.cmdline(parent)
        if parent_cmd != cmdline and not _mp_helper(cmdline):
            break
        root, cmdline = parent, parent_cmd
        parent = up[1]
    return root


class JobTable:
    """The active jobs, the pid -> job cache, and expiry after `idle` seconds without reads."""

    def __init__(
        self,
        idle: float = DEFAULT_IDLE,
        proc: ProcInfo | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: seconds, for the idle times (tests hand trio's virtual clock)."""
        self.idle = idle
        self.clock = clock
        self.proc = proc or ProcInfo()
        self.jobs: dict[int, Job] = {}  # row -> job
        self._by_id: dict[str, int] = {}
        self.pids: dict[int, Job] = {}  # the hit path's cache: reader pid -> its job
        self._starts: dict[int, int | None] = {}  # those pids' start times
        self._next_row = 0
        self._free: list[int] = []
        self.expired = 0

    def _row_for(self, job_id: str, group: str = "") -> int:
        row = self._by_id.get(job_id)
        if row is None:
            row = self._free.pop() if self._free else self._next_row
            if row == self._next_row:
                self._next_row += 1
            self.jobs[row] = Job(job_id, row, group, last_seen=self.clock())
            self._by_id[job_id] = row
            log.debug("job %s started (row %d)", job_id, row)
        elif group:
            self.jobs[row].group = group
        return row

    @property
    def period(self) -> float:
        """Seconds between expiry sweeps: a job ends at most a quarter period late."""
        return min(self.idle / 4, 10.0)

    def job_of(self, pid: int) -> Job:
        """The job that reader `pid` belongs to (cached; /proc only when unseen). The
        caller counts the read in the job's fields (the hit path: no further call)."""
        job = self.pids.get(pid)
        if job is not None:
            return job
        proc = self.proc
        start = proc.start_time(pid)
        ids = proc.tgid_ppid(pid) if pid else None
        # A new thread of a process seen before (a reader's pool of threads, a burst of
        # misses from fresh threads) belongs to that process's job: one /proc read, not
        # the walk up its ancestors (a thread's job is its process's, `job_root`).
        tgid = ids[0] if ids is not None else pid
        job = self.pids.get(tgid) if tgid != pid else None
        if job is None:
            root = _root_of(pid, ids, proc) if pid else 0
            job = self.jobs[self._row_for(f"pid:{root}")]
            if not job.root and root:
                job.root = root
                job.root_start = start if root == pid else proc.start_time(root)
            if tgid != pid and ids is not None:
                # The process itself, for its next new thread: checked by the sweep as
                # every cached pid is (a reused pid is resolved afresh).
                tgid_start = job.root_start if tgid == job.root else proc.start_time(tgid)
                self._add(tgid, job, tgid_start)
        self._add(pid, job, start)
        return job

    def _add(self, pid: int, job: Job, start: int | None) -> None:
        job.pids.add(pid)
        self.pids[pid] = job
        self._starts[pid] = start

    def running(self, row: int) -> bool:
        """Whether job `row` may still read: the process it is named for, or one of its
        readers, still runs (not exited, and not a new process with a reused pid). A job
        none of whose processes runs (a `cat` in a shell loop, right after its one file)
        reads nothing more, although the table keeps it, and the stats show it, until
        its idle time ends it. A job of no known process (pid 0) counts as running. Reads
        /proc: not for the hit path."""
        job = self.jobs.get(row)
        if job is None:
            return False
        if not job.root:
            return True
        proc = self.proc
        if proc.start_time(job.root, live=True) == job.root_start:
            return True
        starts = self._starts
        return any(p in starts and proc.start_time(p, live=True) == starts[p] for p in job.pids)

    def row_of(self, pid: int) -> int:
        """The row of the job that reader `pid` belongs to."""
        return self.job_of(pid).row

    def name(self, pid: int, name: str, group: str = "") -> tuple[int, int | None]:
        """`pid`'s job is called `name` from now on, in sweep group `group` (a sampler's
        registration). Returns (its row, the row of a job merged into an existing job of
        that name, or None): the caller ends the merged row in the policies."""
        job = self.job_of(pid)
        other = self._by_id.get(name)
        if other is None or other == job.row:
            del self._by_id[job.id]
            job.id = name
            self._by_id[name] = job.row
            job.group = group
            return job.row, None
        named = self.jobs[other]
        if group:
            named.group = group
        for p in job.pids:
            self.pids[p] = named
        named.pids |= job.pids
        job.pids.clear()
        self._drop(job.row)
        return other, job.row

    def members(self, group: str) -> int:
        """How many active jobs belong to sweep group `group`."""
        return sum(1 for job in self.jobs.values() if job.group == group)

    def group_of(self, pid: int) -> str:
        """The sweep group of `pid`'s job ("" for none)."""
        return self.job_of(pid).group

    def _drop(self, row: int) -> None:
        job = self.jobs.pop(row)
        del self._by_id[job.id]
        for p in job.pids:
            if self.pids.get(p) is job:
                del self.pids[p]
                self._starts.pop(p, None)
        self._free.append(row)

    def expire(self, now: float) -> list[int]:
        """The sweep: note which jobs read since the last one, drop the jobs idle for `idle`
        seconds (returns their rows, now free for reuse), forget pids that exited or were
        reused."""
        for job in self.jobs.values():
            opens = job.hits + job.misses
            if opens != job.swept_opens:
                job.swept_opens = opens
                job.last_seen = now
        for pid, start in list(self._starts.items()):
            if self.proc.start_time(pid) != start:
                del self._starts[pid]
                job = self.pids.pop(pid)
                job.pids.discard(pid)
        gone = [row for row, job in self.jobs.items() if now - job.last_seen >= self.idle]
        for row in gone:
            log.debug("job %s is over (idle)", self.jobs[row].id)
            self._drop(row)
        self.expired += len(gone)
        return gone

    def describe(self, epoch_of: dict[int, int]) -> list[JobStats]:
        now = self.clock()
        return [
            JobStats(
                id=job.id,
                group=job.group,
                epoch=epoch_of.get(row, 0),
                hits=job.hits,
                misses=job.misses,
                bytes_served=job.bytes,
                idle_seconds=round(now - job.last_seen, 3),
                last_seen=round(time.time() - (now - job.last_seen), 3),
            )
            for row, job in sorted(self.jobs.items())
        ]
