"""The daemon's CPU per opened file, against the floor of pyfuse3 + trio, in one run.

    python tools/bench/bench_cpu.py [--files 20000] [--size 4096] [--readers 4] [--rounds 3]
                                    [--profile DIR] [--only floor shadefs ...]

The method (issue 21): FILES files of SIZE bytes on local disk, a RAM budget that holds all
of them. READERS reader processes read every file once in a shuffled order (cold: every
open a miss), then twice more (warm: every open a hit). The figure is the daemon's own CPU
time, utime + stime of all its threads from /proc/PID/stat, divided by the opens: it hardly
depends on what else runs on the machine, unlike the wall-clock files/s printed beside it.
It still moves by 10-20% from one pass to the next on a 2-core VM, so every config is
measured `--rounds` times (3), and each line shows the round of the median ratio to the
floor of the same round, that round's floor, and every round's ratio. Within a round the
floor and shadefs are mounted side by side and their passes alternate (cold, cold, then
warm, warm, warm, warm), so that each ratio divides figures taken seconds apart; the
cold-only configs follow, one mount at a time.

The floor is `floorfs.py` (beside this script): a minimal pyfuse3 + trio filesystem that
serves the same tree from memory with keep_cache and long timeouts and does nothing else,
measured in the same run. No Python pyfuse3 daemon serves a file with less work; the ratios
are shadefs's figures divided by it. The cold figure is also measured with --no-speculate,
--no-prefetch and --no-inline-reads (every source read in a worker thread, as over NFS).

Requests per sample come from each daemon's own counters (shadefs's stats.json `requests`,
floorfs's `user.floorfs.requests` xattr), and for shadefs how the misses were served, per
open: from the prefetcher's staging, by joining a flight in progress, or fetched by the
opener itself (stats.json `misses`, `fetches_shared`, `prefetch.served`).

With --profile DIR, py-spy (pip install py-spy; root can attach to any process) records
each pass into DIR/<config>-<pass>.txt as collapsed stacks, and the top entries (own and
total time) are printed; sampling disturbs the figures, so profile in a separate run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchlib import (
    FLOORFS,
    mounted,
    process_cpu,
    read_files,
    slowfs_mounted,
    stats,
    worker_pool,
)

PERF = bool(os.environ.get("PERF"))
SPY = os.environ.get("SPY_ARGS", "--gil").split()
PROFILES: list[tuple[Path, Pass]] = []  # (py-spy output, its pass) with --profile
WARM = ("floor", "floor-no-open", "shadefs", "kernel-hits")

#: name -> extra mount options; the floors are floorfs.py (with its own options). The floors
#: and the two shadefs modes run warm too.
CONFIGS: dict[str, tuple[str, ...]] = {
    "floor": (),
    "floor-no-open": ("--no-open",),
    "shadefs": ("--kernel-hits", "off"),
    "kernel-hits": ("--kernel-hits", "on"),
    "no-speculate": ("--no-speculate",),
    "no-prefetch": ("--no-prefetch",),
    "no-inline": ("--no-inline-reads",),
}


@dataclass
class Pass:
    """One measured pass (or several, summed): opens, the daemon's CPU, wall time, requests."""

    opens: int = 0
    cpu: float = 0.0
    trio_cpu: float = 0.0  # of the main thread (the trio loop); the rest is worker threads
    wall: float = 0.0
    requests: Counter[str] = field(default_factory=Counter)
    nbytes: int = 0

    def add(self, other: Pass) -> None:
        self.opens += other.opens
        self.cpu += other.cpu
        self.trio_cpu += other.trio_cpu
        self.wall += other.wall
        self.requests.update(other.requests)
        self.nbytes += other.nbytes

    @property
    def us_per_open(self) -> float:
        return self.cpu / self.opens * 1e6

    @property
    def files_per_core(self) -> float:
        return self.opens / self.cpu if self.cpu else float("inf")


#: One round: config -> (its cold pass, its warm passes summed; None if it ran none).
Results = dict[str, tuple[Pass, Pass | None]]


def make_tree(root: Path, files: int, size: int, dirs: int) -> list[str]:
    """FILES files of SIZE random bytes in DIRS directories (kept if already there)."""
    rels = []
    for i in range(files):
        rel = f"d{i % dirs:03d}/f{i:07d}.bin"
        rels.append(rel)
        path = root / rel
        if path.exists() and path.stat().st_size == size:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
    return rels


def read_pass(
    paths: Sequence[str],
    readers: int,
    pid: int,
    requests: Callable[[], Counter[str]],
    seed: int,
    profile: Path | None = None,
    drop: bool = False,
) -> Pass:
    """Every path read once by `readers` processes (a disjoint share each, shuffled);
    `drop`: the kernel's pages of the files dropped first, so that every read reaches the
    daemon."""
    if drop:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    order = list(paths)
    random.Random(seed).shuffle(order)
    shares = [order[i::readers] for i in range(readers)]
    with worker_pool(readers) as pool:
        pool.map(abs, range(readers), chunksize=1)  # the workers exist before the clock runs
        before = requests()
        with _py_spy(pid, profile):
            cpu0, main0, t0 = _cpu(pid), _cpu(pid, pid), time.perf_counter()
            pool.map(read_files, shares, chunksize=1)
            wall, cpu1, main1 = time.perf_counter() - t0, _cpu(pid), _cpu(pid, pid)
    after = requests()
    after.subtract(before)
    nbytes = sum(os.stat(p).st_size for p in paths)
    return Pass(len(paths), cpu1 - cpu0, main1 - main0, wall, +after, nbytes)


def _cpu(pid: int, tid: int | None = None) -> float:
    """The CPU seconds of process `pid`, all threads (also those that ended), or of one."""
    cpu = process_cpu(pid) if tid is None else process_cpu(pid, tid)
    if cpu is None:
        raise RuntimeError(f"daemon {pid} is gone")
    return cpu


@contextlib.contextmanager
def _py_spy(pid: int, out: Path | None) -> Iterator[None]:
    if out is None:
        yield
        return
    cmd = ["py-spy", "record", "-p", str(pid), "-f", "raw", "-r", "500", "-o", str(out), *SPY]
    if "--native" not in SPY:  # py-spy cannot unwind native frames without stopping them
        cmd.append("--nonblocking")
    if PERF:
        cmd = ["perf", "record", "-F", "999", "-g", "-p", str(pid), "-o", f"{out}.perf"]
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached before the pass starts
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(60)


def shadefs_requests(mnt: Path) -> Callable[[], Counter[str]]:
    """The FUSE requests by type, and (as "@..." keys) how the opens were served."""

    def counts() -> Counter[str]:
        st = stats(mnt)
        got = Counter(st.get("requests", {}))
        got["@misses"] = st["misses"]
        got["@shared"] = st["fetches_shared"]
        pf = st.get("prefetch") or {}
        got["@staged"] = pf.get("served", 0)
        got["@prefetched"] = pf.get("fetched", 0)
        got["@inline"] = st.get("source_inline_reads", 0)
        got["@served"] = st["bytes_served"]
        return got

    return counts


def floor_requests(mnt: Path) -> Callable[[], Counter[str]]:
    return lambda: Counter(json.loads(os.getxattr(mnt, "user.floorfs.requests")))


@contextlib.contextmanager
def daemon(
    name: str, src: Path, mnt: Path, ram: int, more: Sequence[str] = ()
) -> Iterator[tuple[int, Callable[[], Counter[str]]]]:
    """Mount config `name` on `mnt`; yields (the daemon's pid, its request counters)."""
    extra = CONFIGS[name]
    if name.startswith("floor"):
        with slowfs_mounted(src, mnt, extra, script=FLOORFS) as (_, pid):
            yield pid, floor_requests(mnt)
        return
    with mounted(src, mnt, "--ram", str(ram), *extra, *more):
        yield int(stats(mnt)["pid"]), shadefs_requests(mnt)


def run_side_by_side(
    names: Sequence[str], args: argparse.Namespace, src: Path, root: Path, rels: Sequence[str]
) -> Results:
    """The cold pass and (for the floor and the default) the warm passes of `names`, each
    mounted on its own directory under `root` for the whole round: the cold passes one after
    the other, then the warm passes in turn (floor, shadefs, floor, shadefs). A config and
    the floor it is divided by then run seconds apart, not a mount's lifetime apart: a
    2-core VM's load moves within a minute, and one config's warm pass measured in a busy
    moment made the whole ratio (warm 1.06-1.31x between rounds with the configs one after
    the other)."""
    ram = 2 * len(rels) * args.size + (64 << 20)
    prof: Path | None = args.profile
    live: dict[str, tuple[list[str], int, Callable[[], Counter[str]]]] = {}
    cold: dict[str, Pass] = {}
    warm: dict[str, Pass] = {}

    def measure(name: str, seed: int, label: str) -> Pass:
        paths, pid, requests = live[name]
        out = prof / f"{name}-{label}.txt" if prof else None
        one = read_pass(paths, args.readers, pid, requests, seed, out, args.drop)
        if out is not None:
            PROFILES.append((out, one))
        return one

    with contextlib.ExitStack() as stack:
        for name in names:
            mnt = root / f"mnt-{name}"
            mnt.mkdir(exist_ok=True)
            pid, requests = stack.enter_context(daemon(name, src, mnt, ram, args.shadefs_args))
            if args.max_background is not None:
                set_queue(mnt, args.max_background)
            live[name] = ([str(mnt / r) for r in rels], pid, requests)
        for name in names:
            cold[name] = measure(name, 0, "cold")
        warm_too = [n for n in names if _warm(n, args)]
        for i in range(args.warm_passes if warm_too else 0):
            for name in warm_too:
                warm.setdefault(name, Pass()).add(measure(name, i + 1, f"warm{i}"))
    return {name: (cold[name], warm.get(name)) for name in names}


def _warm(name: str, args: argparse.Namespace) -> bool:
    return bool(args.warm_all) or name in WARM


def run_round(args: argparse.Namespace, src: Path, root: Path, rels: Sequence[str]) -> Results:
    """Every config of --only once: those with warm passes side by side, then the others
    one at a time (a mount each, so that no idle daemon shares the machine with them)."""
    got = run_side_by_side([n for n in args.only if _warm(n, args)], args, src, root, rels)
    for name in args.only:
        if name not in got:
            got.update(run_side_by_side([name], args, src, root, rels))
    return {name: got[name] for name in args.only}


def set_queue(mnt: Path, max_background: int) -> None:
    """Override the FUSE connection's queue depth (root; the kernel's defaults: 12 and 9)."""
    dev = os.stat(mnt).st_dev
    conn = Path("/sys/fs/fuse/connections") / str((os.major(dev) << 20) | os.minor(dev))
    (conn / "max_background").write_text(str(max_background))
    (conn / "congestion_threshold").write_text(str(max(1, max_background * 3 // 4)))


def _rate(x: float) -> str:
    """A rate per sample, with its first digits even when it is small (a few reads of a
    warm pass each re-arm the pages' re-push for the next handles, fs/operations.py)."""
    return f"{x:.2f}" if x >= 0.01 or not x else f"{x:.1e}"


def per_sample(p: Pass) -> str:
    """Requests per sample; then, per open, the misses and how they were served: from
    staging, by joining a flight (a reader's or the prefetcher's), or fetched by the opener."""
    reqs = " ".join(
        f"{k}={_rate(v / p.opens)}" for k, v in sorted(p.requests.items()) if v and k[0] != "@"
    )
    r = p.requests
    if r["@served"]:  # pushed with an open (kernel/notify.py) or read: what the kernel lacked
        reqs += f"; served {r['@served'] / p.opens / 1024:.2f} KiB/open"
    if not r["@misses"]:
        return reqs
    own = r["@misses"] - r["@staged"] - r["@shared"]
    return (
        f"{reqs}; misses={r['@misses'] / p.opens:.2f}: staged={r['@staged'] / p.opens:.2f} "
        f"joined={r['@shared'] / p.opens:.2f} own={own / p.opens:.2f} "
        f"(prefetched {r['@prefetched'] / p.opens:.2f}; read without a thread "
        f"{r['@inline'] / p.opens:.2f})"
    )


def report(rounds: Sequence[Results], files: int, readers: int) -> None:
    """One line per config and pass: the round whose ratio to the floor of the same round is
    the median (the floor's own line: its median round), that round's floor beside it, and
    every round's ratio at the end of the line (one round: just its own)."""
    print(f"\n{files} files, {readers} readers; CPU = the daemon's utime+stime from /proc")
    if len(rounds) > 1:
        print(f"{len(rounds)} rounds, floor and shadefs side by side; shown: the median round")
    print(
        f"{'config':<14} {'pass':<5} {'us/open':>8} {'floor':>6} {'x floor':>8} {'trio':>6} "
        f"{'files/s/core':>13} {'files/s wall':>13} {'wall x fl':>9} {'MB/s':>7}  "
        "requests per sample"
    )
    for name in rounds[0]:
        for k, label in enumerate(("cold", "warm")):
            runs: list[tuple[Pass, Pass | None]] = []
            for r in rounds:
                p, base = r[name][k], r["floor"][k] if "floor" in r else None
                if p is not None and p.opens:
                    runs.append((p, base))
            if not runs:
                continue
            ratios = [p.us_per_open / base.us_per_open if base else 0.0 for p, base in runs]
            by = [p.us_per_open for p, _ in runs] if name == "floor" else ratios
            at = sorted(range(len(runs)), key=by.__getitem__)[(len(runs) - 1) // 2]
            p, base = runs[at]
            floor = f"{base.us_per_open:.0f}" if base else "-"
            ratio = f"{ratios[at]:.2f}" if base else "-"
            # files/s against the floor's (with opens) in the same round
            wall = f"{base.wall / base.opens * p.opens / p.wall:.2f}" if base else "-"
            spread = ""
            if base and len(runs) > 1 and name != "floor":
                spread = " [" + " ".join(f"{r:.2f}" for r in ratios) + "]"
            print(
                f"{name:<14} {label:<5} {p.us_per_open:>8.0f} {floor:>6} {ratio:>8} "
                f"{p.trio_cpu / p.opens * 1e6:>6.0f} "
                f"{p.files_per_core:>13.0f} {p.opens / p.wall:>13.0f} {wall:>9} "
                f"{p.nbytes / p.wall / 1e6:>7.0f}  {per_sample(p)}{spread}"
            )
    print("floor: the floor's us/open in the same round; trio: us/open of the main thread (the")
    print("trio loop), the rest ran in worker threads. files/s wall depends on the machine's load;")
    print("the CPU figures hardly do. wall x fl: files/s over the floor's (with opens) in the same")
    print("round. floor-no-open and kernel-hits: FUSE no-open mode (the kernel opens files itself;")
    print("a warm open reaches the daemon only for pages the kernel lacks).")
    if len(rounds) > 1:
        print("[...]: x floor of every round, in order; the floor's line: its median round")


def top_entries(path: Path, trio_us: float, n: int = 15) -> None:
    """The trio thread's functions with the most samples in a py-spy raw (collapsed) profile,
    in us per open: each function's share of the trio thread's samples times its CPU."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not any(f.startswith("unrolled_run ") for f in frames):
            continue  # a worker thread: its CPU is the rest of the figure
        k = int(count)
        samples += k
        own[_short(frames[-1])] += k
        for f in {_short(f) for f in frames}:
            total[f] += k
    if not samples:
        return
    us = trio_us / samples
    print(f"\n{path.name}: trio thread {trio_us:.0f} us/open; top own | top total, us/open")
    for (fo, co), (ft, ct) in zip(own.most_common(n), total.most_common(n), strict=False):
        print(f"  {co * us:6.1f} {fo:<56.56} | {ct * us:6.1f} {ft:.56}")


def _short(frame: str) -> str:
    # "fn (path/to/module.py:123)" -> "fn (module.py)"
    fn, _, where = frame.partition(" (")
    return f"{fn} ({where.rsplit('/', 1)[-1].split(':')[0]})" if where else fn


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--dirs", type=int, default=20, help="directories the files spread over")
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--warm-passes", type=int, default=2)
    ap.add_argument(
        "--max-background",
        type=int,
        metavar="N",
        help="set the FUSE connection's max_background to N (congestion_threshold 3N/4) "
        "after mounting, for every config (root)",
    )
    ap.add_argument(
        "--drop",
        action="store_true",
        help="drop the kernel's pages of the files before every pass (parallel-reader "
        "throughput of the daemon's read path: try --files 64 --size 16777216 --readers 16)",
    )
    ap.add_argument(
        "--remote-latency",
        type=float,
        metavar="MS",
        help="serve the tree through slowfs with this latency per read request",
    )
    ap.add_argument(
        "--shadefs-args", nargs="+", default=[], metavar="ARG", help="more mount options"
    )
    ap.add_argument("--warm-all", action="store_true", help="warm passes for every config")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="measure every config this many times, in turn (a 2-core VM's figures move by "
        "10-20%% from one pass to the next); the report shows the median ratio",
    )
    ap.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--profile", type=Path, metavar="DIR", help="py-spy every pass into DIR")
    ap.add_argument("--workdir", type=Path, help="where the tree goes (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.profile is not None:
        if shutil.which("py-spy") is None:
            sys.exit("--profile needs py-spy on PATH (pip install py-spy)")
        args.profile.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        src = Path(tmp) / "src"
        rels = make_tree(src, args.files, args.size, args.dirs)
        read_files([str(src / r) for r in rels])  # the source in the page cache, for all
        with contextlib.ExitStack() as stack:
            if args.remote_latency is not None:
                # Misses that wait on the source: what the kernel's queue depth may bound.
                opts = ["--read-latency", str(args.remote_latency), "--bandwidth", "0"]
                src, _ = stack.enter_context(slowfs_mounted(src, Path(tmp) / "remote", opts))
            rounds = [
                run_round(args, src, Path(tmp), rels)
                for _ in range(1 if args.profile else max(1, args.rounds))  # (one profile)
            ]
    report(rounds, args.files, args.readers)
    for path, p in PROFILES if not PERF else ():
        top_entries(path, p.trio_cpu / p.opens * 1e6)


if __name__ == "__main__":
    main()
