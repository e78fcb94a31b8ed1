"""The daemon's CPU per open as jobs and files grow: it should stay flat (issue 20).

    python tools/bench/bench_open_cpu.py [--small 5000] [--large 40000] [--size 1000]
                                         [--fraction 0.2] [--epochs 2] [--policy epoch]

Unchanged readers (plain reads, each job its own process and its own shuffled order, as in
bench_jobs.py's part `unchanged`), RAM `fraction` of the dataset, `epochs` epochs, in three
runs: 1 job at `large` files, 2 jobs at `large`, 2 jobs at `small`. The daemon's CPU is
utime + stime of its process from /proc/PID/stat, taken around the readers, divided by the
opens it served: CPU time, so other load on the machine does not move it (wall time would).
Prints each run's CPU per open and the two ratios (targets: <= 1.15x each).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchlib import make_dataset, mounted, stats

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (every thread), in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        rest = f.read().rsplit(b")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / _TICK


def run(src: Path, tmp: Path, rels: list[str], jobs: int, args: argparse.Namespace) -> float:
    """µs of daemon CPU per open for `jobs` readers over `rels`."""
    total = sum((src / r).stat().st_size for r in rels)
    listing = tmp / f"files-{len(rels)}.txt"
    listing.write_text("\n".join(rels))
    ram = str(int(total * args.fraction))
    bench_jobs = Path(__file__).with_name("bench_jobs.py")
    opts = ["--ram", ram, "--policy", args.policy, *args.shadefs_args]
    with mounted(src, tmp / f"mnt-{len(rels)}-{jobs}", *opts) as m:
        s0 = stats(m)
        pid = int(s0["pid"])
        opens0 = s0["hits"] + s0["misses"]
        cpu0 = cpu_seconds(pid)
        procs = []
        for i in range(jobs):
            out = tmp / f"reader-{len(rels)}-{jobs}-{i}.json"
            cmd = [sys.executable, str(bench_jobs), "--reader", str(m), str(listing)]
            procs.append(subprocess.Popen([*cmd, str(100 + i), str(args.epochs), str(out)]))
        for p in procs:
            if p.wait() != 0:
                raise SystemExit(f"a reader failed with {p.returncode}")
        cpu = cpu_seconds(pid) - cpu0
        s = stats(m)
        opens = s["hits"] + s["misses"] - opens0
    per_open = cpu / opens * 1e6
    pf = s.get("prefetch") or {}
    misses = max(s["misses"] - s0["misses"], 1)
    print(
        f"{jobs} job(s) at {len(rels)} files: {opens} opens, daemon CPU {cpu:.1f} s, "
        f"{per_open:.0f} µs per open, hit ratio {s['hit_ratio']:.3f}; misses staged "
        f"{pf.get('served', 0) / misses:.2f}, prefetched {pf.get('fetched', 0)} files, "
        f"{pf.get('wasted', 0)} unstaged unread, source files {s['source_fetches']}",
        flush=True,
    )
    return per_open


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=5000)
    ap.add_argument("--large", type=int, default=40000)
    ap.add_argument("--size", type=int, default=1000)
    ap.add_argument("--fraction", type=float, default=0.2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--policy", default="epoch")
    ap.add_argument("--workdir", type=Path)
    ap.add_argument(
        "--shadefs-args",
        nargs="+",
        default=[],
        metavar="ARG",
        help="more mount options, e.g. --shadefs-args=--no-speculate (the bookkeeping alone)",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp_name:
        tmp = Path(tmp_name)
        large = make_dataset(tmp / "large", args.large, args.size, jitter=0.5)
        small = make_dataset(tmp / "small", args.small, args.size, jitter=0.5)
        one_large = run(tmp / "large", tmp, large, 1, args)
        two_large = run(tmp / "large", tmp, large, 2, args)
        two_small = run(tmp / "small", tmp, small, 2, args)
    print(f"2 jobs / 1 job at {args.large} files: {two_large / one_large:.2f}x (target <= 1.15)")
    print(
        f"2 jobs at {args.large} / at {args.small} files: {two_large / two_small:.2f}x "
        "(target <= 1.15)"
    )


if __name__ == "__main__":
    main()
