"""Warm cache hits through the mount versus reading the source directly.

    python tools/bench/bench_hits.py [--files 4000] [--size 110000] [--repeat 3]

Both sides are warm: the source files sit in the kernel page cache of a local disk (the
fastest a "remote" can ever be), and the mount has every file resident in its RAM tier and
in the kernel page cache it keeps (keep_cache). What remains per file through the mount
is the FUSE round trips that the kernel cannot skip (open and release reach the daemon;
lookups and data reads do not), so the ratio measures the daemon's per-open cost.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from benchlib import files_per_second, make_dataset, median, mounted, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=4000)
    ap.add_argument("--size", type=int, default=110_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--readers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        src, mnt = Path(tmp) / "src", Path(tmp) / "mnt"
        rels = make_dataset(src, args.files, args.size)
        ram = args.files * args.size * 2
        with mounted(src, mnt, "--ram", str(ram)):
            direct_paths = [str(src / r) for r in rels]
            mount_paths = [str(mnt / r) for r in rels]
            files_per_second(direct_paths, 1)  # warm the source's page cache
            files_per_second(mount_paths, 1)  # fetch everything into the cache
            s = stats(mnt)
            assert s["files_cached"] == args.files, "the benchmark needs every file resident"
            print(
                f"{args.files} files of {args.size} B, every file resident "
                f"({s['ram_bytes'] / 1e6:.0f} MB in RAM)"
            )
            print(f"{'readers':>8} {'direct files/s':>15} {'mount files/s':>14} {'ratio':>6}")
            rng = random.Random(0)
            for readers in args.readers:
                d, m = [], []
                for _ in range(args.repeat):
                    order = list(range(args.files))
                    rng.shuffle(order)
                    d.append(files_per_second([direct_paths[i] for i in order], readers))
                    m.append(files_per_second([mount_paths[i] for i in order], readers))
                dm, mm = median(d), median(m)
                print(f"{readers:>8} {dm:>15.0f} {mm:>14.0f} {mm / dm:>6.3f}")
            s2 = stats(mnt)
            print(
                f"opens counted as hits during the timed passes: {s2['hits'] - s['hits']}, "
                f"misses: {s2['misses'] - s['misses']}"
            )


if __name__ == "__main__":
    main()
