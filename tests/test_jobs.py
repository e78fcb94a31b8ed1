"""Several jobs on one cache: per-job epochs, demand-aware eviction, jobs from process trees."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from shadefs.cache.policies import EpochPolicy
from shadefs.readers.jobs import JobTable, ProcInfo, job_root
from tests.conftest import poll


def interleaved(n: int, jobs: int, epochs: int, seed: int) -> list[tuple[int, int]]:
    """(job, key) reads: each job reads every key once per epoch in its own order, the jobs'
    streams interleaved at random (so they drift apart). No epoch starts with the file the
    last one ended with (that would be a reopen: one read, readers/tracker.py)."""
    rng = np.random.default_rng(seed)
    streams: list[list[int]] = []
    for _ in range(jobs):
        stream: list[int] = []
        for _ in range(epochs):
            perm = [int(k) for k in rng.permutation(n)]
            if stream and perm[0] == stream[-1]:
                perm[0], perm[1] = perm[1], perm[0]
            stream += perm
        streams.append(stream)
    pos = [0] * jobs
    out = []
    while any(p < len(s) for p, s in zip(pos, streams, strict=True)):
        j = int(rng.integers(jobs))
        if pos[j] < len(streams[j]):
            out.append((j, streams[j][pos[j]]))
            pos[j] += 1
    return out


def drive(
    policy: EpochPolicy, trace: list[tuple[int, int]], capacity: int, check=None
) -> list[bool]:
    """Drive the policy like the cache does (unit sizes); whether each access hit."""
    resident: set[int] = set()
    hits: list[bool] = []
    for t, (job, key) in enumerate(trace):
        hit = key in resident
        hits.append(hit)
        policy.tracker.read(key, job)  # the cache tells the readers' tracker first
        policy.accessed(key, hit, job)
        if hit:
            continue
        victims = policy.admit(key, 1, capacity - len(resident))
        if check is not None:
            check(t, key, victims, resident)
        if victims is None:
            continue
        for v in victims:
            resident.remove(v)
            policy.removed(v)
        resident.add(key)
        policy.inserted(key, 1)
    return hits


def test_per_job_epochs_with_interleaved_readers() -> None:
    n, epochs = 200, 5
    policy = EpochPolicy()
    drive(policy, interleaved(n, 4, epochs, seed=1), capacity=40)
    # Every job is in its last epoch (0-based): no spurious epoch from another job's reads.
    assert policy.tracker.epochs_of() == {
        0: epochs - 1,
        1: epochs - 1,
        2: epochs - 1,
        3: epochs - 1,
    }
    assert policy.describe().epoch == epochs - 1


def test_per_job_epochs_follow_each_jobs_own_pace() -> None:
    n = 100
    policy = EpochPolicy()
    rng = np.random.default_rng(2)
    trace = [(0, int(k)) for _ in range(3) for k in rng.permutation(n)]
    trace += [(1, int(k)) for k in rng.permutation(n)]
    drive(policy, trace, capacity=30)
    assert policy.tracker.epochs_of() == {0: 2, 1: 0}


def test_one_job_alone_is_the_single_job_policy() -> None:
    # The same trace with and without a job id gives the same decisions.
    trace = interleaved(150, 1, 4, seed=3)
    a = drive(EpochPolicy(), trace, capacity=30)
    b = drive(EpochPolicy(), [(7, key) for _, key in trace], capacity=30)
    assert a == b and sum(a) > 0


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_policy_against_a_brute_force_demand_oracle(seed: int) -> None:
    n, jobs, epochs = 30, 3, 4
    trace = interleaved(n, jobs, epochs, seed)
    # The oracle: the rule in plain sets. A job's epoch ends when it reads again a file it
    # read this epoch, after 90% of the files it knows (a reopen of its last file is no
    # read); the remaining demand of a key is the number of jobs that have not read it in
    # their current epoch.
    reads_so_far: list[list[int]] = [[] for _ in range(jobs)]
    checked = []

    def this_epoch(reads: list[int]) -> set[int]:
        current: set[int] = set()
        known: set[int] = set()
        prev = None
        for k in reads:
            if k == prev:
                continue
            prev = k
            known.add(k)
            if k in current and len(current) >= 0.9 * len(known):
                current = set()
            current.add(k)
        return current

    def state(key: int) -> tuple[int, int]:
        wanted = consumed = 0
        for j in range(jobs):
            if key in this_epoch(reads_so_far[j]):
                consumed += 1
            else:
                wanted += 1
        return wanted, consumed

    def check(t: int, key: int, victims, resident: set[int]) -> None:
        # The oracle's reads: the trace up to and including this access.
        for j in range(jobs):
            reads_so_far[j] = [k for jj, k in trace[: t + 1] if jj == j]
        if len(set(j for j, _ in trace[: t + 1])) < 2 or len(resident) < 10:
            return  # not shared yet, or not full
        new = state(key)
        ranks = {k: state(k) for k in resident}
        if victims is None:
            assert all(r >= new for r in ranks.values()), (t, key)
        else:
            kept = [ranks[k] for k in resident - set(victims)]
            for v in victims:
                assert ranks[v] < new  # never evict for a miss with less demand
                assert not kept or ranks[v] <= min(kept)  # the least demand goes first
        checked.append(victims is not None)

    drive(EpochPolicy(), trace, 10, check)
    assert any(checked) and not all(checked)  # both admissions and refusals were checked


def test_four_unchanged_jobs_beat_the_single_job_rules() -> None:
    # The trace setting of the issue: 4 shuffled streams, cache 20%.
    n = 500
    trace = interleaved(n, 4, 5, seed=5)
    warm = 4 * n
    hits = drive(EpochPolicy(), trace, n // 5)
    assert np.mean(hits[warm:]) >= 0.28


def test_a_job_that_ends_leaves_the_demand() -> None:
    policy = EpochPolicy()
    drive(policy, interleaved(50, 2, 2, seed=6), capacity=10)
    assert policy.shared
    policy.tracker.leave(1)
    assert not policy.shared and policy.tracker.epochs_of() == {0: 1}
    assert policy.epoch == 1  # the single-job state is the remaining job's


# --- jobs from process trees ------------------------------------------------------------


def _pids(out: Path, count: int, proc: subprocess.Popen[bytes]) -> list[int]:
    def started() -> list[int]:
        lines = out.read_text().split() if out.exists() else []
        return [int(x) for x in lines[:count]] if len(lines) >= count else []

    return poll(started, "the process tree did not start", alive=proc)


REPORT = "import os,sys,time; open(sys.argv[1],'a').write(f'{os.getpid()}\\n'); time.sleep(30)"


def test_forked_workers_belong_to_their_training_process(tmp_path: Path) -> None:
    out = tmp_path / "pids"
    code = textwrap.dedent(
        """
        import os, sys, time
        out = sys.argv[1]
        kids = []
        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                if os.fork() == 0:  # a worker's own fork, one level deeper
                    open(out, "a").write(f"{os.getpid()}\\n"); time.sleep(30); os._exit(0)
                open(out, "a").write(f"{os.getpid()}\\n"); time.sleep(30); os._exit(0)
            kids.append(pid)
        open(out, "a").write(f"{os.getpid()}\\n")
        time.sleep(30)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], start_new_session=True)
    try:
        pids = _pids(out, 5, proc)
        roots = {job_root(p, ProcInfo()) for p in pids}
        assert roots == {proc.pid}
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_jobs_started_by_one_script_stay_apart(tmp_path: Path) -> None:
    out = tmp_path / "pids"
    py = sys.executable
    script = f'{py} -c "{REPORT}" {out} 1 & {py} -c "{REPORT}" {out} 2 & wait'
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    try:
        pids = _pids(out, 2, proc)
        assert os.getpgid(pids[0]) == os.getpgid(pids[1])  # one process group, one session
        assert os.getsid(pids[0]) == os.getsid(pids[1])
        assert [job_root(p, ProcInfo()) for p in pids] == pids
        table = JobTable()
        rows = {table.row_of(p) for p in pids}
        assert len(rows) == 2
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_a_python_driver_launching_trials_gives_one_job_per_trial(tmp_path: Path) -> None:
    out = tmp_path / "pids"
    driver = textwrap.dedent(
        f"""
        import subprocess, sys
        trials = [subprocess.Popen([sys.executable, "-c", {REPORT!r}, sys.argv[1], str(lr)])
                  for lr in (1, 2)]
        for t in trials:
            t.wait()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", driver, str(out)], start_new_session=True)
    try:
        pids = _pids(out, 2, proc)
        assert sorted(job_root(p, ProcInfo()) for p in pids) == sorted(pids)
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_threads_belong_to_their_process() -> None:
    import threading

    tids: list[int] = []
    t = threading.Thread(target=lambda: tids.append(threading.get_native_id()))
    t.start()
    t.join()
    me = job_root(os.getpid(), ProcInfo())
    # A finished thread's id is gone: it falls back to itself; a live one maps to us.
    assert job_root(threading.get_native_id(), ProcInfo()) == me


class _CountingProc(ProcInfo):
    """The real /proc, counting what the job resolution asks of it."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    def start_time(self, pid: int, live: bool = False) -> int | None:
        self.asked.append("start_time")
        return super().start_time(pid, live)

    def tgid_ppid(self, pid: int) -> tuple[int, int] | None:
        self.asked.append("tgid_ppid")
        return super().tgid_ppid(pid)

    def cmdline(self, pid: int) -> bytes:
        self.asked.append("cmdline")
        return super().cmdline(pid)

    def program(self, pid: int) -> bytes:
        self.asked.append("program")
        return super().program(pid)


def test_a_new_thread_of_a_known_process_joins_its_job_without_the_walk() -> None:
    import threading

    # A burst of misses from fresh threads (a reader's pool) resolves each thread on the
    # event loop: after the first, a thread of the same process costs its own start time
    # and process id, not the walk up the ancestors' programs and command lines.
    proc = _CountingProc()
    table = JobTable(proc=proc)
    tids: list[int] = []
    stop = threading.Event()
    threads = [
        threading.Thread(target=lambda: (tids.append(threading.get_native_id()), stop.wait(10)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    try:
        poll(lambda: len(tids) == 3, "threads started", 10)
        first = table.job_of(tids[0])
        assert "cmdline" in proc.asked  # the first thread: the walk
        assert first.root == job_root(os.getpid(), ProcInfo())
        assert os.getpid() in table.pids and os.getpid() in first.pids  # the process too
        for tid in tids[1:]:
            proc.asked.clear()
            assert table.job_of(tid) is first
            assert sorted(proc.asked) == ["start_time", "tgid_ppid"]
        assert table.job_of(os.getpid()) is first  # the process's own reads: cached
    finally:
        stop.set()
        for t in threads:
            t.join()
    # The threads are gone: the sweep forgets them (a reused id is resolved afresh), and
    # keeps the process, which still runs.
    table.expire(time.monotonic())
    assert set(table.pids) == {os.getpid()}
    assert first.pids == {os.getpid()}


def test_the_pid_cache_and_job_expiry() -> None:
    table = JobTable(idle=0.5)
    now = time.monotonic()
    row = table.row_of(os.getpid())
    assert table.row_of(os.getpid()) == row  # cached
    table.jobs[row].last_seen = now
    assert [j.id for j in table.describe({row: 3})] == [f"pid:{job_root(os.getpid(), ProcInfo())}"]
    assert table.describe({row: 3})[0].epoch == 3
    assert table.expire(now + 0.2) == []
    assert table.expire(now + 0.6) == [row]
    assert table.describe({}) == []
    # A reader seen again after its job expired starts a new job.
    assert table.row_of(os.getpid()) == row and len(table.jobs) == 1
    # Reads since the last sweep keep a job alive.
    table.jobs[row].hits += 1
    assert table.expire(now + 10) == [] and table.jobs[row].last_seen == now + 10
    assert table.expire(now + 10.6) == [row]


def test_a_job_runs_while_its_process_or_one_of_its_readers_does(tmp_path: Path) -> None:
    table = JobTable()
    assert table.running(table.row_of(os.getpid()))  # this process: it runs
    assert table.running(table.row_of(0))  # no process known: it may read
    # A `cat` of a shell loop: its own job, over once it exited (a zombie is exited too).
    cat = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        row = table.row_of(cat.pid)
        assert table.running(row)
        cat.kill()
        poll(lambda: ProcInfo().start_time(cat.pid, live=True) is None, "not a zombie", 10)
        assert not table.running(row)
    finally:
        cat.kill()
        cat.wait()
    assert not table.running(row)
    # A training process whose forked worker reads: the job runs while either does.
    out = tmp_path / "pids"
    code = textwrap.dedent(
        """
        import os, sys, time
        if os.fork() == 0:
            open(sys.argv[1], "a").write(f"{os.getpid()}\\n"); time.sleep(30); os._exit(0)
        time.sleep(30)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], start_new_session=True)
    try:
        (worker,) = _pids(out, 1, proc)
        row = table.row_of(worker)
        assert table.jobs[row].id == f"pid:{proc.pid}"
        proc.kill()  # the training process is gone, its worker reads on
        proc.wait()
        assert table.running(row)
        os.kill(worker, 9)
        # (reaped by init, or a zombie until then)
        poll(lambda: not table.running(row), "the job still runs", 10, interval=0.01)
    finally:
        with contextlib.suppress(ProcessLookupError):  # (gone with its last process)
            os.killpg(proc.pid, 9)
        proc.wait()


def test_a_named_job_takes_over_its_processes() -> None:
    table = JobTable()
    row = table.row_of(os.getpid())
    assert table.name(os.getpid(), "trial-3", group="sweep") == (row, None)  # renamed in place
    assert table.row_of(os.getpid()) == row
    (job,) = table.describe({})
    assert (job.id, job.group) == ("trial-3", "sweep")
    # A second process naming itself alike joins that job (its own row ends).
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        mine = table.row_of(other.pid)
        assert mine != row
        assert table.name(other.pid, "trial-3") == (row, mine)
        assert table.row_of(other.pid) == row and len(table.jobs) == 1
    finally:
        other.kill()
        other.wait()


# --- through a real mount -------------------------------------------------------------


def test_jobs_through_a_mount_and_their_expiry(tmp_path: Path, mounter) -> None:
    from tests.conftest import make_tree

    src = make_tree(tmp_path / "src", {f"f{i}": bytes([i]) * 1000 for i in range(20)})
    m = mounter(src, "--ram", "1M", "--job-idle", "2")
    # Two jobs from one shell script (one process group); the first forks a worker that
    # reads for it, the second reads every file twice.
    one = (
        "import os,sys; m=sys.argv[1]\n"
        "pid=os.fork()\n"
        "for i in (range(10) if pid else range(10, 20)): open(f'{m}/f{i}','rb').read()\n"
        "os.waitpid(pid,0) if pid else os._exit(0)\n"
        "print(os.getpid())"
    )
    two = (
        "import os,sys; m=sys.argv[1]\n"
        "[open(f'{m}/f{i}','rb').read() for _ in range(2) for i in range(20)]\n"
        "print(os.getpid())"
    )
    py = sys.executable
    out = subprocess.run(
        ["sh", "-c", f'{py} -c "{one}" {m.mnt}; {py} -c "{two}" {m.mnt}'],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    stats = json.loads((m.mnt / ".shadefs" / "stats.json").read_bytes())
    jobs = {j["id"]: j for j in stats["jobs"]}
    assert set(jobs) == {f"pid:{out[0]}", f"pid:{out[1]}"}
    first, second = jobs[f"pid:{out[0]}"], jobs[f"pid:{out[1]}"]
    assert first["hits"] + first["misses"] == 20  # its worker's reads count for it
    assert second["hits"] + second["misses"] == 40
    assert second["hits"] == 40 and second["bytes_served"] == 40_000
    metrics = (m.mnt / ".shadefs" / "metrics").read_text()
    assert f'shadefs_job_hits_total{{group="",job="pid:{out[1]}"}} 40.0' in metrics
    time.sleep(2.5)
    stats = json.loads((m.mnt / ".shadefs" / "stats.json").read_bytes())
    assert stats["jobs"] == []


# --- sweep groups ---------------------------------------------------------------------


def test_a_group_shares_one_order_per_epoch_whatever_the_table_does(tmp_path: Path) -> None:
    import trio

    from shadefs.control import commands
    from shadefs.options import MountOptions
    from shadefs.sampling import wire
    from shadefs.service import Service
    from tests.conftest import make_tree

    make_tree(tmp_path / "src", {f"c/f{i}": b"x" * (100 + i) for i in range(64)})
    service = Service(MountOptions(source=str(tmp_path / "src"), mountpoint="/unused", ram=1 << 20))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    me = os.getpid()

    async def run() -> None:
        await service.register_dataset([f"c/f{i}" for i in range(64)])
        for pid, name in ((me, "a"), (other.pid, "b")):
            await commands.execute(service, f"job {name} group=sweep".encode(), pid)
        for epoch in range(2):
            first = await service.order(wire.OrderRequest(epoch, 0, 1, seed=1), me)
            # Losses arrive between the members' requests: the table changes, not the order.
            losses = wire.encode_losses(np.arange(64), np.linspace(0, 5, 64, dtype=np.float32))
            service.ingest_losses(losses)
            second = await service.order(wire.OrderRequest(epoch, 0, 1, seed=2), other.pid)
            assert np.array_equal(first, second)
        # Outside the group, another seed gives another order.
        alone = await service.order(wire.OrderRequest(1, 0, 1, seed=2))
        assert not np.array_equal(alone, second)
        jobs = {j.id: j.group for j in service.stats().jobs}
        assert jobs == {"a": "sweep", "b": "sweep"}

    try:
        trio.run(run)
    finally:
        other.kill()
        other.wait()


def test_what_a_known_order_still_reads_stays_for_misses_it_does_not_read() -> None:
    # Two jobs (members of a sweep group read known orders): entries with reads to come
    # (readers/pending.py) are never evicted for a miss without; such a miss takes any
    # entry without, even one with more demand.
    to_come: set[int] = {1, 5}
    policy = EpochPolicy(pending=lambda key: key in to_come)
    resident: set[int] = set()
    for row in (0, 1):
        policy.tracker.announce(0, row)
    for key in (1, 2, 3):
        policy.tracker.read(key, 0)
        policy.accessed(key, False, 0)
        policy.inserted(key, 1)
        resident.add(key)
    for key in (1, 2, 3):
        policy.tracker.read(key, 1)
        policy.accessed(key, True, 1)  # both read 1-3: they least want 2 and 3
    policy.tracker.read(4, 1)
    policy.accessed(4, False, 1)  # job 1's miss, that no order reads again
    assert policy.shared
    assert policy.admit(4, 1, 0) == [2]
    assert policy.admit(4, 3, 0) is None  # 1 is still to be read: it stays
    assert policy.admit(5, 3, 0) is None  # 2 and 3 free too little for 5: refused
    victims = policy.admit(5, 2, 0)
    assert victims is not None and sorted(victims) == [2, 3]
