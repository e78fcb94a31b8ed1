"""A source that stops answering: many concurrent misses, hits, stats, recovery.

    python tools/bench/bench_hang.py [--hang stop|open|read|readdir] [--misses 200]
                                     [--timeout 2] [--threads 32] [--waves 2]

The source is the slow-remote emulator (shadefs/demo/slowfs.py, no added latency) over a
local tree, mounted under shadefs with `--source-timeout`, `--source-threads` and no
speculation (which would stage the cold files before the outage). After the hot files are
read (hits from then on), the emulator stops answering: `stop` is SIGSTOP (every request
hangs, as an NFS server that is gone), `open`, `read` and `readdir` hang only that kind of
request (the emulator's `--hang-on`, SIGUSR1). Then `--waves` waves of `--misses` readers
each open and read a file never read before, all at once (for `readdir`, each lists its
directory, never listed before, first: a lookup by name needs no listing), while a prober
reads hot files and runs `shadefs stat`. Then the source answers again (SIGCONT, SIGUSR2):
the time to the first good miss, 20 misses after it, and the daemon's thread count against
its count before the outage.

It prints each figure with what the issue asks of it (issue 36's "must show"); it asserts
nothing. Figures are wall time on whatever machine runs it: say whether it was shared. To
tell where the slowest hit waited, it also prints when that hit began against the waves'
start, the requests the kernel held for the daemon then (/sys/fs/fuse/connections/N/waiting:
also those in a source call), the daemon's CPU time during the hit and the machine's busy
share (from /proc), the daemon's worst event-loop stall (stats.json `loop_lag_max_ms`), the
daemon's CPU per miss in each wave (with its share in user mode, and the requests per miss
by type from stats.json; the daemon's idle CPU per second and the prober's hits and stats
reads over the wave are in it too: a first wave lasts the timeout, a second far less), and
how often someone dropped the kernel's dentries during the outage (a hit's lookup then asks
the source). Each wave also sends one hit once the kernel holds the wave's requests (the
case a hit at a burst's end meets), with the daemon's loop thread's time meanwhile on a CPU
and runnable without one (/proc/PID/task/PID/schedstat: the rest is the loop blocked).
`--attach COMMAND` runs a profiler on the daemon through the waves.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import errno
import json
import math
import multiprocessing as mp
import os
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

from benchlib import SHADEFS, mounted, slowfs_mounted, stats

_HOT = 20
_AFTER = 21


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise RuntimeError("no Threads line")


def _make(src: Path, misses: int, waves: int) -> tuple[list[str], list[list[str]], list[str]]:
    """Hot files in hot/, and one file per directory for each miss and each later read."""
    data = os.urandom(20_000)
    hot = []
    for i in range(_HOT):
        rel = f"hot/h{i:03d}"
        hot.append(rel)
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data[i:] + data[:i])
    cold = []
    for w in range(waves):
        wave = []
        for i in range(misses):
            rel = f"cold{w}/d{i:04d}/f"
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(data[: 10_000 + i])
            wave.append(rel)
        cold.append(wave)
    after = []
    for i in range(_AFTER):
        rel = f"after/d{i:04d}/f"
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data[: 5_000 + i])
        after.append(rel)
    return hot, cold, after


def _read(path: Path, listing: bool = False) -> tuple[float, int | None]:
    """(seconds, errno or None) of one open and read; `listing`: its directory listed first."""
    t0 = time.monotonic()
    try:
        if listing:
            os.listdir(path.parent)
        path.read_bytes()
    except OSError as exc:
        return time.monotonic() - t0, exc.errno
    return time.monotonic() - t0, None


def _cpu() -> tuple[int, int]:
    """(busy, all) clock ticks of every CPU since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # (idle and iowait are not busy)


def _cpu_of(pid: int) -> int:
    """The clock ticks process `pid` ran (user + system, all its threads)."""
    return sum(_user_sys(pid))


def _user_sys(pid: int) -> tuple[int, int]:
    """The clock ticks process `pid` ran in user mode and in the kernel (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return int(rest[11]), int(rest[12])


def _drops() -> dict[str, int]:
    """How often the page cache (`drop_pagecache`) and the dentries and inodes (`drop_slab`)
    were dropped since boot: someone wrote /proc/sys/vm/drop_caches, as some tests do."""
    with open("/proc/vmstat") as f:
        return {k: int(v) for k, v in (line.split() for line in f) if k.startswith("drop_")}


def _stats(mnt: Path) -> dict[str, Any]:
    """stats.json, or {} when the daemon does not answer within 10 s (a mount whose request
    tasks are all held by misses reads no request, stats.json included)."""
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.update(stats(mnt)), daemon=True)
    t.start()
    t.join(10)
    return box


def _loop_times(pid: int) -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one) of the daemon's main thread, where its
    event loop runs (/proc/PID/task/PID/schedstat)."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        ran, waited, _ = f.read().split()
    return int(ran), int(waited)


class Behind(NamedTuple):
    """A hit sent behind a wave's burst (`_hit_behind`)."""

    took: float  # its latency (inf: it failed)
    held: int  # the requests the kernel held for the daemon as it was sent
    ran: float  # seconds the daemon's loop thread ran meanwhile
    waited: float  # seconds it was runnable but had no CPU


def _hit_behind(
    barrier: threading.Barrier, path: Path, waiting: Path, burst: int, daemon: int
) -> Behind:
    """A hit sent behind a wave's burst: once the kernel holds the wave's requests for the
    daemon (/sys/fs/fuse/connections/N/waiting, 50 ms at most)."""
    barrier.wait()
    t0 = time.monotonic()
    held = int(waiting.read_text())
    while held < burst and time.monotonic() - t0 < 0.05:
        time.sleep(0.0005)
        held = int(waiting.read_text())
    ran, waited = _loop_times(daemon)
    took, err = _read(path)
    ran1, waited1 = _loop_times(daemon)
    return Behind(
        took if err is None else math.inf, held, (ran1 - ran) / 1e9, (waited1 - waited) / 1e9
    )


def _read_together(
    barrier: threading.Barrier, path: Path, listing: bool
) -> tuple[float, int | None]:
    barrier.wait()  # all readers start at once
    return _read(path, listing)


class Probe(NamedTuple):
    """What the probe process saw during the outage (`_probe`)."""

    hits: list[float]  # each hit's latency
    began: list[float]  # when each hit began (CLOCK_MONOTONIC)
    queued: list[int]  # the requests the kernel held for the daemon as each hit began
    busy: list[float]  # the machine's busy share of its CPUs, per hit
    daemon_ticks: list[int]  # the daemon's CPU time per hit (ticks)
    hit_errors: int
    stat_times: list[float]
    stat_failures: int
    stuck_max: int
    lag_max: float


def _probe(mnt: Path, hot: list[str], daemon: int, stop: Any, out: Any) -> None:
    """In a process of its own (the misses' 200 threads share nothing with it): read hot
    files and run `shadefs stat` until `stop`; send the latencies (with when each hit began,
    CLOCK_MONOTONIC, which every process shares), the stuck peak and the daemon's own worst
    event-loop stall (stats.json `loop_lag_max_ms`: each read takes the worst since the last)."""
    hits: list[float] = []
    began: list[float] = []
    queued: list[int] = []  # the requests the kernel held for the daemon as each hit began
    # Per hit: the machine's busy share of its CPUs, and the daemon's CPU time (ticks).
    busy: list[float] = []
    daemon_ticks: list[int] = []
    lag_max = 0.0
    waiting = Path(f"/sys/fs/fuse/connections/{os.minor(os.stat(mnt).st_dev)}/waiting")
    hit_errors = 0
    stat_times: list[float] = []
    stat_failures = 0
    stuck_max = 0
    i = 0
    while not stop.is_set():
        queued.append(int(waiting.read_text()))
        (b0, a0), d0 = _cpu(), _cpu_of(daemon)
        began.append(time.monotonic())
        took, err = _read(mnt / hot[i % len(hot)])
        hits.append(took)
        (b1, a1), d1 = _cpu(), _cpu_of(daemon)
        busy.append((b1 - b0) / max(1, a1 - a0))
        daemon_ticks.append(d1 - d0)
        hit_errors += err is not None
        i += 1
        if i % 10 == 0:
            t0 = time.monotonic()
            res = subprocess.run(
                [*SHADEFS, "stat", str(mnt), "--json", "--timeout", "5"],
                capture_output=True,
                text=True,
            )
            stat_times.append(time.monotonic() - t0)
            stat_failures += res.returncode != 0
            if res.returncode == 0:
                doc = json.loads(res.stdout)
                stuck_max = max(stuck_max, doc.get("source_threads_stuck", -1))
                lag_max = max(lag_max, doc.get("loop_lag_max_ms", 0.0))
        time.sleep(0.02)
    out.send(
        Probe(
            hits,
            began,
            queued,
            busy,
            daemon_ticks,
            hit_errors,
            stat_times,
            stat_failures,
            stuck_max,
            lag_max,
        )  # fmt: skip
    )


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _attach(command: str | None, pid: int) -> subprocess.Popen[bytes] | None:
    """`command` with {pid} the daemon's (a profiler: py-spy, perf) run through the waves,
    ended with SIGINT after them (on which they write what they saw); None without
    `--attach`. Not `strace -f`: it cannot let go of threads stuck in a stopped source."""
    if command is None:
        return None
    spy = subprocess.Popen(shlex.split(command.format(pid=pid)), stdout=subprocess.DEVNULL)
    time.sleep(2)  # attached before the first wave
    return spy


def _resume(mode: str, pid: int) -> None:
    os.kill(pid, signal.SIGCONT if mode == "stop" else signal.SIGUSR2)


def run(args: argparse.Namespace, tmp: Path) -> None:
    src, remote, mnt = tmp / "src", tmp / "remote", tmp / "mnt"
    hot, cold, after = _make(src, args.misses, args.waves)
    opts = ["--open-latency", "0", "--meta-latency", "0", "--bandwidth", "0"]
    if args.hang != "stop":
        opts += ["--hang-on", args.hang]
    with slowfs_mounted(src, remote, opts) as (_, slow_pid):
        extra = ["--source-timeout", str(args.timeout), "--source-threads", str(args.threads)]
        with mounted(remote, mnt, "--ram", "256M", "--no-speculate", *extra):
            pid = int(stats(mnt)["pid"])
            for rel in hot:
                (mnt / rel).read_bytes()
            if args.hang != "readdir":
                for _ in os.walk(mnt):  # the tree is listed: misses need no listing
                    pass
            idle = _cpu_of(pid)
            time.sleep(11)  # trio's idle worker threads end after 10 s
            idle = _cpu_of(pid) - idle
            before = _threads(pid)
            print(
                f"mode {args.hang}: daemon threads before the outage: {before}; the daemon ran "
                f"{idle * 1000 / os.sysconf('SC_CLK_TCK') / 11:.1f} ms of CPU per second idle"
            )
            drops = _drops()
            os.kill(slow_pid, signal.SIGSTOP if args.hang == "stop" else signal.SIGUSR1)
            resumed = False
            try:
                stop, (got_probe, send_probe) = mp.Event(), mp.Pipe(duplex=False)
                prober = mp.Process(target=_probe, args=(mnt, hot, pid, stop, send_probe))
                prober.start()
                spy = _attach(args.attach, pid)
                waiting = Path(f"/sys/fs/fuse/connections/{os.minor(os.stat(mnt).st_dev)}/waiting")
                wave_starts = []
                for w, wave in enumerate(cold):
                    barrier = threading.Barrier(
                        len(wave) + 1, action=lambda: wave_starts.append(time.monotonic())
                    )

                    pool = concurrent.futures.ThreadPoolExecutor(len(wave) + 1)
                    behind = pool.submit(
                        _hit_behind, barrier, mnt / hot[w % len(hot)], waiting, len(wave), pid
                    )
                    asked = _stats(mnt).get("requests", {})
                    user, system = _user_sys(pid)
                    loop = _loop_times(pid)[0]
                    futures = [
                        pool.submit(_read_together, barrier, mnt / rel, args.hang == "readdir")
                        for rel in wave
                    ]
                    done, pending = concurrent.futures.wait(futures, timeout=10 * args.timeout)
                    pool.shutdown(wait=False)
                    got = [f.result() for f in done]
                    loop = _loop_times(pid)[0] - loop
                    user1, system1 = _user_sys(pid)
                    user, system = user1 - user, system1 - system
                    ticks = user + system
                    # The requests the wave sent (and the prober's meanwhile, and one stats
                    # read): how many requests a miss costs, by type.
                    answered = _stats(mnt).get("requests", {})
                    per_miss = {k: (n - asked.get(k, 0)) / len(wave) for k, n in answered.items()}
                    worst = max((t for t, _ in got), default=0.0)
                    eio = sum(e == errno.EIO for _, e in got)
                    other = sorted({e or 0 for _, e in got if e != errno.EIO})
                    print(
                        f"  wave {w + 1}: {len(wave)} concurrent misses: {eio} EIO, other "
                        f"outcomes (errno, 0: read) {other or 'none'}; slowest {worst:.2f} s; "
                        f"{len(pending)} still waiting after {10 * args.timeout:g} s "
                        f"(asked: every one EIO within {2 * args.timeout:g} s); the daemon "
                        f"ran {ticks * 1000 / os.sysconf('SC_CLK_TCK') / len(wave):.2f} ms of "
                        f"CPU per miss ({user / max(1, ticks):.0%} in user mode; its loop's "
                        f"thread {loop / 1e6 / len(wave):.2f} ms)"
                    )
                    print(
                        "    requests per miss: "
                        + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per_miss.items()) if v)
                    )
                    b = behind.result()
                    print(
                        f"    a hit sent behind the burst ({b.held} requests held for the daemon): "
                        f"{b.took * 1e3:.1f} ms (asked: < 100 ms); meanwhile the daemon's loop "
                        f"ran {b.ran * 1e3:.1f} ms and waited {b.waited * 1e3:.1f} ms for a CPU"
                    )
                    if pending:
                        break
                if spy is not None:
                    spy.send_signal(signal.SIGINT)
                    spy.wait()
                s = _stats(mnt)
                stop.set()
                p = got_probe.recv()
                prober.join()
                print(
                    f"  hits during the outage: {len(p.hits)}, errors {p.hit_errors}, median "
                    f"{_pct(p.hits, 0.5) * 1e3:.1f} ms, p99 {_pct(p.hits, 0.99) * 1e3:.1f} ms, "
                    f"slowest {max(p.hits, default=0) * 1e3:.1f} ms (asked: < 100 ms)"
                )
                if p.hits:
                    # Where the slowest hit fell: the waves' start and their deadline (the
                    # timeout after it) are when the daemon has 200 requests to answer.
                    worst = max(range(len(p.hits)), key=p.hits.__getitem__)
                    at = [f"{p.began[worst] - t:+.2f} s" for t in wave_starts]
                    print(
                        f"  the slowest hit began at {', '.join(at)} from the waves' start, "
                        f"behind {p.queued[worst]} requests the kernel held for the daemon (most "
                        f"before a hit: {max(p.queued)}); the daemon's worst event-loop stall "
                        f"{p.lag_max:.1f} ms"
                    )
                    tick = 1000 / os.sysconf("SC_CLK_TCK")
                    print(
                        f"  during the slowest hit the machine's {os.cpu_count()} CPUs were "
                        f"{p.busy[worst]:.0%} busy, the daemon ran "
                        f"{p.daemon_ticks[worst] * tick:.0f} ms of CPU (to {tick:.0f} ms)"
                    )
                print(
                    f"  shadefs stat during the outage: {len(p.stat_times)} runs, "
                    f"{p.stat_failures} failed, slowest {max(p.stat_times, default=0):.2f} s"
                )
                print(
                    f"  stats: threads_stuck {s.get('source_threads_stuck')} (peak seen "
                    f"{p.stuck_max}, of {args.threads}), threads_busy "
                    f"{s.get('source_threads_busy')}, "
                    f"queue_timeouts {s.get('source_queue_timeouts')}, "
                    f"timeouts {s.get('source_timeouts')}; daemon threads {_threads(pid)}"
                )
                slab = _drops().get("drop_slab", 0) - drops.get("drop_slab", 0)
                if slab:
                    # The kernel forgot the hot files' names too: a hit's lookup then asks
                    # the source, whose threads the outage holds (EIO, or the timeout).
                    print(f"  the kernel's dentries were dropped {slab} times during the outage")
                t_resume = time.monotonic()
                _resume(args.hang, slow_pid)
                resumed = True
            finally:
                if not resumed:
                    _resume(args.hang, slow_pid)
            first = None
            while time.monotonic() - t_resume < 30:
                took, err = _read(mnt / after[0])
                if err is None:
                    first = time.monotonic() - t_resume
                    break
                time.sleep(0.05)
            print(
                f"  first good miss {first if first is None else round(first, 2)} s after "
                "the source answers (asked: within 5 s)"
            )
            with concurrent.futures.ThreadPoolExecutor(_AFTER - 1) as pool:
                got = list(pool.map(lambda rel: _read(mnt / rel), after[1:]))
            good = sum(e is None for _, e in got)
            print(f"  then {len(got)} concurrent misses: {good} good (asked: all)")
            t0 = time.monotonic()
            while _threads(pid) > before and time.monotonic() - t0 < 30:
                time.sleep(0.2)
            s = _stats(mnt)
            print(
                f"  daemon threads {_threads(pid)} after {time.monotonic() - t0:.1f} s "
                f"(before the outage: {before}); threads_stuck {s.get('source_threads_stuck')}, "
                f"threads_busy {s.get('source_threads_busy')}, healthy {s.get('source_healthy')}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hang", choices=["stop", "open", "read", "readdir"], default="stop")
    ap.add_argument("--misses", type=int, default=200)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=32)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument(
        "--attach",
        metavar="COMMAND",
        help="run COMMAND ({pid}: the daemon's) through the waves, SIGINT after them: e.g. "
        "'py-spy record --pid {pid} --idle --format speedscope -o hang.json'",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        run(args, Path(tmp))


if __name__ == "__main__":
    main()
