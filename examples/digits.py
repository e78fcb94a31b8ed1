#!/usr/bin/env python3
"""Train a real model through shadefs and compare the hit ratios of three set-ups.

scikit-learn's digits (1437 training PNGs of ~3 kB) as an ImageFolder, mounted with RAM for
20% of the training bytes, and the same CNN trained three ways:

1. uniform sampling (RandomSampler) over the ``lru`` policy: the page-cache baseline;
2. uniform sampling over the ``epoch`` policy (shadefs's default, reaches about f = 20%);
3. ``ShadeSampler`` (replay 3) over the ``shade`` policy: the order comes from the daemon and
   replays what is resident, so the hit ratio can exceed f.

It prints every epoch's hit ratio, test accuracy and time, then the hit ratio over epochs
2..N (every open counted, cold misses included) and the ratios between the runs, and the
final test accuracy of each run averaged over ``--seeds`` seeds.  The source is a plain
local directory unless ``--slowfs`` puts the emulated slow remote (``shadefs.demo.slowfs``)
in front of it; hit ratios do not depend on that, epoch times do.

Needs the ``torch`` extra and scikit-learn (``pip install 'shadefs[torch]' scikit-learn``).

Usage: ``python examples/digits.py [--epochs 8] [--seeds 1] [--workdir DIR] [--slowfs]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from shadefs.demo.digits import EpochRecord, build_digits, hit_ratio, train, tree_bytes

log = logging.getLogger("examples.digits")

RUNS = (
    ("uniform + lru", "uniform", "lru"),
    ("uniform + epoch", "uniform", "epoch"),
    ("ShadeSampler + shade", "shade", "shade"),
)
SLOWFS = [sys.executable, "-m", "shadefs.demo.slowfs"]


@contextlib.contextmanager
def mounted(src: Path, mnt: Path, *args: str, kind: str = "shadefs") -> Iterator[Path]:
    """Mount (shadefs, or slowfs), and unmount on the way out whatever happens."""
    mnt.mkdir(parents=True, exist_ok=True)
    if kind == "shadefs":
        cmd = [sys.executable, "-m", "shadefs", "mount", str(src), str(mnt), "--log", "none"]
        umount = [sys.executable, "-m", "shadefs", "umount", str(mnt)]
    else:
        cmd = [*SLOWFS, str(src), str(mnt), "--daemon"]
        umount = ["fusermount3", "-u", str(mnt)]
    subprocess.run([*cmd, *args], check=True)
    try:
        yield mnt
    finally:
        if subprocess.run(umount, capture_output=True).returncode != 0:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


def run_one(
    source: Path,
    data: Path,
    work: Path,
    policy: str,
    sampler: str,
    seed: int,
    args: argparse.Namespace,
) -> list[EpochRecord]:
    ram = int(tree_bytes(data / "train") * args.ram_fraction)
    mnt = work / f"mnt-{sampler}-{policy}"
    with mounted(source, mnt, "--ram", str(ram), "--policy", policy):
        return train(
            mnt / "train",
            data / "test",  # evaluation reads the dataset directly, not through the cache
            sampler=sampler,
            epochs=args.epochs,
            seed=seed,
            replay=args.replay if sampler == "shade" else None,
            on_epoch=lambda r: print(
                f"    epoch {r.epoch + 1:2d}  hit ratio {r.hit_ratio or 0.0:5.3f}  "
                f"accuracy {r.test_accuracy:5.3f}  time {r.epoch_time:5.1f} s  "
                f"misses {r.misses:5d}",
                flush=True,
            ),
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--seeds", type=int, default=1, help="seeds per configuration (default 1)")
    p.add_argument("--ram-fraction", type=float, default=0.2)
    p.add_argument("--replay", type=float, default=3.0)
    p.add_argument("--workdir", help="keep the dataset here (default: a temp dir)")
    p.add_argument("--slowfs", action="store_true", help="put the emulated slow remote in front")
    p.add_argument("--json", help="write every epoch record here")
    args = p.parse_args(argv)
    if args.epochs < 2:
        p.error("--epochs must be at least 2 (the summary starts at epoch 2)")
    torch.set_num_threads(1)  # the other core serves the daemon on a 2-core machine

    with contextlib.ExitStack() as stack:
        if args.workdir:
            work = Path(args.workdir).resolve()
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="digits-")))
        data = build_digits(work / "digits")
        source = data
        if args.slowfs:
            source = stack.enter_context(mounted(data, work / "remote", kind="slowfs"))
        print(
            f"digits: {tree_bytes(data / 'train') / 1e6:.2f} MB of training PNGs; RAM "
            f"{args.ram_fraction:.0%} of it; replay {args.replay:g}; {args.epochs} epochs; "
            f"source {'behind shadefs.demo.slowfs (default options)' if args.slowfs else 'local'}"
        )
        results: dict[str, list[list[EpochRecord]]] = {name: [] for name, _, _ in RUNS}
        for seed in range(args.seeds):
            for name, sampler, policy in RUNS:
                print(f"{name} (seed {seed}):", flush=True)
                results[name].append(run_one(source, data, work, policy, sampler, seed, args))

    print(f"\nhit ratio over epochs 2..{args.epochs} (cold misses counted), final accuracy:")
    ratios = {}
    for name, _, _ in RUNS:
        runs = results[name]
        hits = sum(r.hits or 0 for recs in runs for r in recs[1:])
        opens = hits + sum(r.misses or 0 for recs in runs for r in recs[1:])
        ratios[name] = hits / opens if opens else 0.0
        accs = [recs[-1].test_accuracy for recs in runs]
        per_seed = " ".join(f"{hit_ratio(recs):.3f}" for recs in runs)
        print(
            f"  {name:22s} hit ratio {ratios[name]:.3f} (per seed {per_seed})  "
            f"accuracy {sum(accs) / len(accs):.4f} (per seed "
            f"{' '.join(f'{a:.4f}' for a in accs)})"
        )
    shade, epoch, lru = (ratios[n] for n, _, _ in (RUNS[2], RUNS[1], RUNS[0]))
    for a, b, x, y in (
        ("shade", "epoch", shade, epoch),
        ("shade", "lru", shade, lru),
        ("epoch", "lru", epoch, lru),
    ):
        print(f"  {a} / {b}: " + (f"{x / y:.2f}x" if y > 0 else "inf (no hits in the latter)"))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {k: [[r.as_dict() for r in recs] for recs in v] for k, v in results.items()},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
