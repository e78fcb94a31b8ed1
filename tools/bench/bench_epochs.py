"""Shuffled epochs through the mount: the `epoch` policy against `lru` and the theory.

    python tools/bench/bench_epochs.py [--files 2000] [--size 20000] [--epochs 5] [--fraction 0.2]

Each epoch reads every file once in a fresh random order (what RandomSampler and
DistributedSampler do). The RAM budget is `fraction` of the dataset's bytes. Hit ratios
come from the mount's stats.json (opens of regular files), over epochs 2..N. Theory
(docs/design.md, fact 1): no demand cache beats f; LRU gets f + (1 - f) ln(1 - f).

Each read first drops the kernel's pages of its file (POSIX_FADV_DONTNEED), as with a
dataset larger than the page cache: otherwise the kernel serves a miss that shadefs answers
before its fetch (cache/deferred.py), and the daemon never fetches nor admits it.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import tempfile
from pathlib import Path

from benchlib import make_dataset, mounted, stats


def run_epochs(mnt: Path, rels: list[str], epochs: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    ratios = []
    for _ in range(epochs):
        before = stats(mnt)
        order = rels[:]
        rng.shuffle(order)
        for rel in order:
            with open(mnt / rel, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # see the docstring
                f.read()
        after = stats(mnt)
        opens = after["hits"] + after["misses"] - before["hits"] - before["misses"]
        ratios.append((after["hits"] - before["hits"]) / opens)
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--size", type=int, default=20_000)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--fraction", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument(
        "--kernel-hits",
        choices=("on", "off"),
        default="off",
        help="mount with --kernel-hits (FUSE no-open; the reads still reach the daemon, as "
        "each drops its file's pages first)",
    )
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        src = Path(tmp) / "src"
        rels = make_dataset(src, args.files, args.size, jitter=0.5, seed=args.seed)
        total = sum((src / r).stat().st_size for r in rels)
        ram = int(total * args.fraction)
        f = args.fraction
        print(
            f"{args.files} files, {total / 1e6:.1f} MB, RAM budget {ram / 1e6:.1f} MB "
            f"(f = {f:.2f}), {args.epochs} shuffled epochs"
        )
        result = {}
        for policy in ("epoch", "lru"):
            opts = ("--ram", str(ram), "--policy", policy, "--kernel-hits", args.kernel_hits)
            with mounted(src, Path(tmp) / f"mnt-{policy}", *opts) as m:
                ratios = run_epochs(m, rels, args.epochs, args.seed + 1)
                s = stats(m)
                assert s["ram_bytes"] <= s["ram_capacity"]
            steady = sum(ratios[1:]) / len(ratios[1:])
            result[policy] = steady
            per_epoch = " ".join(f"{r:.3f}" for r in ratios)
            print(
                f"{policy:>6}: hit ratio epochs 2-{args.epochs} = {steady:.3f}   "
                f"(per epoch: {per_epoch})"
            )
        print(
            f"theory: bound f = {f:.3f}, LRU f+(1-f)ln(1-f) = {f + (1 - f) * math.log(1 - f):.3f}"
        )
        print(
            f"epoch / lru = {result['epoch'] / max(result['lru'], 1e-9):.1f}x, "
            f"epoch / bound = {result['epoch'] / f:.2f}"
        )


if __name__ == "__main__":
    main()
