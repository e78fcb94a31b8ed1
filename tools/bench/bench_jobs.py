"""Several jobs on one mount (a sweep, HFTA's setting): hit ratio and source bytes.

    python tools/bench/bench_jobs.py [--files 1000] [--size 20000] [--jobs 4] [--epochs 5]
                                     [--fraction 0.2] [--part unchanged,group]

Part `unchanged`: `jobs` unchanged readers run concurrently over one mount, each its own
process (plain file reads, no torch), each reading every file once per epoch in its own
shuffled order (its own seed). The RAM budget is `fraction` of the dataset's bytes. It
reports the hit ratio over epochs 2..N (from each job's own counters in stats.json `jobs`,
taken when that job finishes its first epoch and at its end) and the bytes the source
delivered as a multiple of the dataset, against one such job alone.

Part `group`: `jobs` ShadeSampler jobs of one sweep group (same seed, run concurrently,
`--group-epochs` epochs) against one such job alone: the source bytes of the group as a
multiple of the single job's (the claim: at most 1.1x), under each of `--group-policies`.
Like real jobs, each records a per-sample loss for every batch (its own random losses, as
different hyperparameters give). `--stagger S` starts member i S*i seconds after the first;
`--pace MS` makes every member sleep MS ms per batch (its training step), and `--spread F`
makes member i's step MS*(1+F*i) (members at different speeds). The stagger and the drift
must stay within what the cache and the prefetch window can bridge (the files read between
the first member and the last must fit), or the members refetch what the others read:
stats.json `sampler.unbridged` counts the refused files that no tier held for them.

Part `e2e` is in bench_jobs_e2e.py.

Each read first drops the kernel's pages of its file (POSIX_FADV_DONTNEED), as with a
dataset larger than the page cache: otherwise the kernel serves a miss that shadefs answers
before its fetch (cache/deferred.py), and the daemon never fetches nor admits it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import make_dataset, mounted, stats


def _job_counters(mnt: Path, job_id: str) -> tuple[int, int]:
    for job in stats(mnt).get("jobs", []):
        if job["id"] == job_id:
            return int(job["hits"]), int(job["misses"])
    return 0, 0


def reader(mnt: Path, listing: Path, seed: int, epochs: int, out: Path) -> None:
    """One unchanged job: shuffled epochs of plain reads; writes its counters to `out`."""
    rels = listing.read_text().split("\n")
    rng = random.Random(seed)
    # Under kernel hits the daemon cannot tell readers apart: every read is job pid:0's.
    me = "pid:0" if stats(mnt).get("no_open") else f"pid:{os.getpid()}"
    marks = []
    for _ in range(epochs):
        order = rels[:]
        rng.shuffle(order)
        for rel in order:
            with open(mnt / rel, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # see the docstring
                f.read()
        marks.append(_job_counters(mnt, me))
    out.write_text(json.dumps({"job": me, "marks": marks}))


def run_unchanged(mnt: Path, tmp: Path, rels: list[str], jobs: int, epochs: int) -> float:
    """`jobs` concurrent readers; the hit ratio of epochs 2..N over all of them."""
    listing = tmp / "files.txt"
    listing.write_text("\n".join(rels))
    procs = []
    outs = [tmp / f"reader{i}.json" for i in range(jobs)]
    for i, out in enumerate(outs):
        cmd = [sys.executable, __file__, "--reader", str(mnt), str(listing)]
        cmd += [str(100 + i), str(epochs), str(out)]
        procs.append(subprocess.Popen(cmd))
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a reader failed with {p.returncode}")
    hits = opens = 0
    marks = [json.loads(out.read_text())["marks"] for out in outs]
    if stats(mnt).get("no_open"):
        # One job's counters for all readers (kernel hits): from when the last reader ended
        # its first epoch to the end.
        h1, m1 = max((mk[0] for mk in marks), key=sum)
        h, m = _job_counters(mnt, "pid:0")
        return (h - h1) / max(1, h + m - h1 - m1)
    for mk in marks:
        (h1, m1), (h, m) = mk[0], mk[-1]
        hits += h - h1
        opens += h + m - h1 - m1
    return hits / opens


def part_unchanged(args: argparse.Namespace, tmp: Path, src: Path, rels: list[str]) -> None:
    total = sum((src / r).stat().st_size for r in rels)
    ram = int(total * args.fraction)
    print(
        f"unchanged jobs: {args.files} files, {total / 1e6:.1f} MB, RAM {ram / 1e6:.1f} MB "
        f"(f = {args.fraction:.2f}), {args.epochs} shuffled epochs, policy {args.policy}"
    )
    for jobs in (1, args.jobs):
        opts = ("--ram", str(ram), "--policy", args.policy, "--kernel-hits", args.kernel_hits)
        with mounted(src, tmp / f"mnt-u{jobs}", *opts) as m:
            t0 = time.monotonic()
            ratio = run_unchanged(m, tmp, rels, jobs, args.epochs)
            s = stats(m)
            took = time.monotonic() - t0
        per_job = s["bytes_from_source"] / total / jobs
        print(
            f"{jobs} job(s): hit ratio epochs 2-{args.epochs} = {ratio:.3f}   "
            f"source bytes = {s['bytes_from_source'] / total:.2f}x the dataset "
            f"({per_job:.2f}x per job), evictions {s['evictions']}, "
            f"policy epoch {s['policy_state'].get('epoch')}, {took:.1f} s"
        )


def sampler_job(
    mnt: Path, group: str, seed: int, epochs: int, gate: Path, delay: float, pace: float
) -> None:
    """One ShadeSampler job of `group` (no model: it reads what the order says, and records
    random per-sample losses as a real job records its own); it starts reading `delay`
    seconds after every job has registered (`gate` appears), and sleeps `pace` seconds per
    batch."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, Dataset

    from shadefs.torch import ShadeSampler

    class Files(Dataset[int]):
        def __init__(self, paths: list[str]) -> None:
            self.samples = [(p, 0) for p in paths]

        def __len__(self) -> int:
            return len(self.samples)

        def __getitem__(self, i: int) -> int:
            with open(self.samples[i][0], "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # see the docstring
                return len(f.read())

    rels = sorted(str(p) for p in mnt.rglob("*.bin"))
    data = Files(rels)
    sampler = ShadeSampler(data, group=group or None, seed=seed)
    rng = np.random.default_rng(os.getpid())
    (gate.parent / f"ready-{os.getpid()}").touch()
    while not gate.exists():
        time.sleep(0.01)
    time.sleep(delay)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in DataLoader(data, sampler=sampler, batch_size=32):
            sampler.record(torch.from_numpy(rng.random(len(batch), dtype=np.float32)))
            if pace:
                time.sleep(pace)
    sampler.close()


def part_group(args: argparse.Namespace, tmp: Path, src: Path, rels: list[str]) -> None:
    total = sum((src / r).stat().st_size for r in rels)
    ram = int(total * args.fraction)
    print(
        f"ShadeSampler jobs of one group: {args.files} files, RAM f = {args.fraction:.2f}, "
        f"{args.group_epochs} epochs"
    )
    for policy in args.group_policies.split(","):
        print(
            f"policy {policy}, stagger {args.stagger} s, step {args.pace} ms "
            f"(+{args.spread:.0%} per member)"
        )
        group_once(args, tmp, src, ram, total, policy)


def group_once(
    args: argparse.Namespace, tmp: Path, src: Path, ram: int, total: int, policy: str
) -> None:
    fetched: dict[int, Any] = {}
    for jobs in (1, args.jobs):
        opts = ["--ram", str(ram), "--policy", policy, *args.shadefs_args]
        with mounted(src, tmp / f"mnt-g{policy}{jobs}", *opts) as m:
            gates = tmp / f"gates{policy}{jobs}"
            gates.mkdir()
            procs = []
            for i in range(jobs):
                cmd = [sys.executable, __file__, "--sampler", str(m), "sweep", "7"]
                cmd += [str(args.group_epochs), str(gates / "go")]
                pace = args.pace * (1 + args.spread * i) / 1000
                cmd += [str(args.stagger * i), str(pace)]
                procs.append(subprocess.Popen(cmd))
            while len(list(gates.glob("ready-*"))) < jobs:
                time.sleep(0.05)
            (gates / "go").touch()
            t0 = time.monotonic()
            staged = 0  # the most bytes staged at once (prefetched, or held for members)
            while any(p.poll() is None for p in procs):
                staged = max(staged, int(stats(m).get("prefetch", {}).get("staged_bytes", 0)))
                time.sleep(0.2)
            if any(p.returncode != 0 for p in procs):
                raise SystemExit("a sampler job failed")
            took = time.monotonic() - t0
            s = stats(m)
        fetched[jobs] = s["bytes_from_source"]
        if args.verbose:
            for job in s["jobs"]:
                print(
                    f"  {job['id']}: epoch {job['epoch']}, hits {job['hits']}, "
                    f"misses {job['misses']}"
                )
            print(
                f"  evictions {s['evictions']}, refused {s['refused']}, "
                f"shared fetches {s['fetches_shared']}, refetches {s.get('refetches')}, "
                f"policy {s['policy_state']}"
            )
        print(
            f"{jobs} job(s): source bytes {s['bytes_from_source'] / total:.2f}x the dataset, "
            f"{took:.1f} s, unbridged {s['sampler'].get('unbridged')}, "
            f"hit ratio {s['hit_ratio']:.3f}, staged at most {staged / 1e6:.1f} MB"
            + _served_text(s.get("prefetch"))
        )
    print(f"{args.jobs} jobs / 1 job: source bytes {fetched[args.jobs] / fetched[1]:.2f}x")


def _served_text(pf: dict[str, Any] | None) -> str:
    """The prefetcher's opens served / files fetched (stats.json `prefetch`), if it ran."""
    if not pf or not pf.get("fetched"):
        return ""
    dropped = pf["wasted"] + pf.get("unused", 0)
    return (
        f", prefetch served/fetched {pf['served']}/{pf['fetched']} = "
        f"{pf['served'] / pf['fetched']:.2f} (dropped unread {dropped})"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--reader":
        mnt, listing, seed, epochs, out = sys.argv[2:7]
        reader(Path(mnt), Path(listing), int(seed), int(epochs), Path(out))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--sampler":
        mnt, group, seed, epochs, gate, delay, pace = sys.argv[2:9]
        sampler_job(Path(mnt), group, int(seed), int(epochs), Path(gate), float(delay), float(pace))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--size", type=int, default=20_000)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--group-epochs", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.2)
    ap.add_argument("--policy", default="epoch")
    ap.add_argument("--group-policies", default="shade,epoch")
    ap.add_argument("--stagger", type=float, default=0.0, help="seconds between group starts")
    ap.add_argument("--pace", type=float, default=0.0, help="ms per batch (a training step)")
    ap.add_argument("--spread", type=float, default=0.0, help="member i's step: x(1+F*i)")
    ap.add_argument("--part", default="unchanged,group")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument(
        "--kernel-hits",
        choices=("on", "off"),
        default="off",
        help="part unchanged: mount with --kernel-hits (FUSE no-open; the readers drop each "
        "file's pages before reading it, so their reads still reach the daemon)",
    )
    ap.add_argument(
        "--shadefs-args", nargs="+", default=[], metavar="ARG",
        help="more mount options of the group part, e.g. --shadefs-args=--prefetch-window=4M",
    )  # fmt: skip
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp_name:
        tmp = Path(tmp_name)
        src = tmp / "src"
        rels = make_dataset(src, args.files, args.size, jitter=0.5, seed=args.seed)
        parts = args.part.split(",")
        if "unchanged" in parts:
            part_unchanged(args, tmp, src, rels)
        if "group" in parts:
            part_group(args, tmp, src, rels)


if __name__ == "__main__":
    main()
