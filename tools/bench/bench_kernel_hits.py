"""Shuffled passes with the kernel's page cache kept: what `shadefs stat` says of them.

    python tools/bench/bench_kernel_hits.py [--files 1000] [--size 20000] [--ram 4M]
                                            [--passes 3]

A dataset larger than `--ram` (1,000 files of 20 KB against 4 MB, the case of issue 36),
read with `cat` in a fresh random order each pass, the page cache NOT dropped between
passes: the kernel keeps the pages of every file read, and a deferred open lets it serve
them (cache/deferred.py), so passes after the first fetch nothing from the source although the
daemon's RAM tier holds a fifth of the data. Per pass: the opens, the tiers' hits, the
kernel hits (deferred opens released unread), the hit ratio and the bytes from the source.
The issue asks for a hit ratio >= 0.6 over three passes and the bytes of one pass.

Each pass also shows how often the page cache was dropped while it ran (/proc/vmstat
`drop_pagecache`: someone wrote /proc/sys/vm/drop_caches, as some tests and benchmarks do as
root): the kernel then lacks the pages of deferred opens, their reads reach the daemon
(`read requests`), and once most recent deferred opens were read, the daemon stops
deferring (kernel/pages.py), so the opens after that count as misses.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import tempfile
from pathlib import Path

from benchlib import SHADEFS, make_dataset, mounted, stats


def _drops() -> int:
    """How often the page cache was dropped since boot."""
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("drop_pagecache "):
                return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--size", type=int, default=20_000)
    ap.add_argument("--ram", default="4M")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("mount_args", nargs="*", help="more `shadefs mount` arguments (after --)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        src, mnt = Path(tmp) / "src", Path(tmp) / "mnt"
        rels = make_dataset(src, args.files, args.size)
        one_pass = sum((src / r).stat().st_size for r in rels)
        with mounted(src, mnt, "--ram", args.ram, *args.mount_args):
            rng = random.Random(0)
            for p in range(args.passes):
                order = rels[:]
                rng.shuffle(order)
                drops = _drops()
                # One `cat` per file from one shell: one job for the daemon, as a user's loop.
                subprocess.run(
                    ["bash", "-c", 'while IFS= read -r f; do cat "$f"; done'],
                    input="".join(f"{mnt / r}\n" for r in order).encode(),
                    stdout=subprocess.DEVNULL,
                    check=True,
                )
                s = stats(mnt)
                print(
                    f"after pass {p + 1}: opens {s['hits'] + s['misses']}, tier hits "
                    f"{s['hits']}, misses {s['misses']} (kernel hits {s['kernel_hits']}), "
                    f"deferred {s['handles']['deferred']} (unread {s['handles']['unread']}), "
                    f"read requests {s['requests'].get('read', 0)}, "
                    f"hit ratio {s['hit_ratio']:.3f}, fetches {s['source_fetches']} (refetches "
                    f"{s['refetches']}, prefetched {s.get('prefetch', {}).get('fetched')}), "
                    f"bytes from source {s['bytes_from_source'] / 2**20:.1f} MiB "
                    f"(one pass: {one_pass / 2**20:.1f} MiB); page cache dropped "
                    f"{_drops() - drops} times meanwhile"
                )
            res = subprocess.run(
                [*SHADEFS, "stat", str(mnt)],
                capture_output=True,
                text=True,
                check=True,
            )
            print("shadefs stat:", next(x for x in res.stdout.splitlines() if "hit ratio" in x))


if __name__ == "__main__":
    main()
