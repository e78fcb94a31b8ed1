"""SSD-tier hits through the mount versus reading the source directly, in files/s.

    python tools/bench/bench_ssd_hits.py [--files 4000] [--size 110000] [--repeat 3]

SRC and the SSD cache directory sit on the same local disk, so this compares two ways of
getting a file off one disk, not a remote against a local SSD. The mount gets `--ram 1M
--max-entry 64K`, so no file fits in the RAM tier, and `--ssd DIR:SIZE` big enough for all
of them. Every file is read through the mount until the SSD tier holds all of them (a write
the full write-behind queue dropped is retried on the next pass, after a drop of the page
cache) and `queued_writes` is 0.

Cold passes (the headline; needs root): the kernel's caches are dropped (`sync; echo 3 >
/proc/sys/vm/drop_caches`) right before each timed pass, so direct reads come from the
disk, and every open through the mount is an SSD-tier hit whose entry file comes from the
disk; the kernel's lookup also reaches the daemon again, which lstat()s the source file
(the signature an SSD hit is validated against). stats.json's `ssd_hits` must grow by
exactly one per file opened in the timed passes, with no RAM hits and no misses.

Warm passes: no dropping, after one untimed pass of each side, as in a second epoch. Direct
reads come from the page cache; through the mount, open and release still reach the daemon,
which reads the entry file (from the page cache) on every open.

Each figure is the median of --repeat passes over every file in a fresh random order with 1
and 4 reader processes. Nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchlib import (
    can_drop_caches,
    describe_disk,
    drop_caches,
    files_per_second,
    make_dataset,
    median,
    mounted,
    raise_on_sigterm,
    stats,
    wait_until,
)


def _ssd_counts(s: dict[str, Any]) -> tuple[int, int, int, int, int]:
    """(opens, SSD hits, RAM hits, misses, bytes from source) so far."""
    ram_hits = s["tiers"]["ram"]["hits"]
    return s["hits"] + s["misses"], s["ssd_hits"], ram_hits, s["misses"], s["bytes_from_source"]


def populate(mnt: Path, paths: list[str], files: int, passes: int = 5) -> str:
    """Read everything through the mount until the SSD tier holds every file. From the second
    pass the kernel's pages are dropped first: else it serves the files whose write the full
    queue dropped from its page cache, and the daemon never fetches (and offers) them again."""
    for n in range(1, passes + 1):
        if n > 1:
            drop_caches(pages_only=True)
        files_per_second(paths, 1)
        s = wait_until(mnt, lambda s: s["tiers"]["ssd"]["queued_writes"] == 0, timeout=600)
        if s["ssd_entries"] >= files:
            dropped = s["tiers"]["ssd"]["dropped_writes"]
            return (
                f"{s['ssd_entries']} SSD entries ({s['ssd_bytes'] / 1e6:.0f} MB on disk) after "
                f"{n} pass{'es' if n > 1 else ''} ({dropped} writes dropped by the full "
                f"write-behind queue)"
            )
    sys.exit(f"the SSD tier holds {s['ssd_entries']} of {files} files after {passes} passes")


def table(
    title: str,
    direct: list[str],
    through: list[str],
    readers_list: list[int],
    repeat: int,
    before: Callable[[], None] | None,
    rng: random.Random,
) -> None:
    print(title)
    print(f"{'readers':>8} {'direct files/s':>15} {'ssd-hit files/s':>16} {'ratio':>6}")
    for readers in readers_list:
        d, m = [], []
        for _ in range(repeat):
            order = list(range(len(direct)))
            rng.shuffle(order)
            d.append(files_per_second([direct[i] for i in order], readers, before))
            m.append(files_per_second([through[i] for i in order], readers, before))
        dm, mm = median(d), median(m)
        print(f"{readers:>8} {dm:>15.0f} {mm:>16.0f} {mm / dm:>6.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=4000)
    ap.add_argument("--size", type=int, default=110_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--readers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp"), help="on the local disk")
    args = ap.parse_args()
    if not can_drop_caches():
        sys.exit("the cold passes drop the kernel's caches: run as root")
    with raise_on_sigterm():
        run(args)


def run(args: argparse.Namespace) -> None:

    with tempfile.TemporaryDirectory(prefix="shadefs-bench-ssd-", dir=args.workdir) as tmp:
        src, mnt, cache = Path(tmp) / "src", Path(tmp) / "mnt", Path(tmp) / "ssd"
        rels = make_dataset(src, args.files, args.size)
        ssd_size = 2 * args.files * (args.size + 4096) + (64 << 20)
        opts = ["--ram", "1M", "--max-entry", "64K", "--ssd", f"{cache}:{ssd_size}"]
        opts += ["--log", "none"]
        with mounted(src, mnt, *opts):
            direct = [str(src / r) for r in rels]
            through = [str(mnt / r) for r in rels]
            print(
                f"{args.files} files of {args.size} B ({args.files * args.size / 1e6:.0f} MB); "
                f"SRC and the SSD cache on the same disk ({describe_disk(Path(tmp))})"
            )
            print(f"mount {' '.join(opts[:4])} --ssd DIR:{ssd_size >> 20}M: ", end="")
            print(populate(mnt, through, args.files), flush=True)
            rng = random.Random(0)
            before = _ssd_counts(stats(mnt))
            table(
                "cold: kernel caches dropped before every timed pass; direct = SRC from disk, "
                "mount = SSD-tier hits read from disk",
                direct,
                through,
                args.readers,
                args.repeat,
                drop_caches,
                rng,
            )
            mid = _ssd_counts(stats(mnt))
            files_per_second(direct, 1)  # one untimed pass of each side warms the caches
            files_per_second(through, 1)
            warm0 = _ssd_counts(stats(mnt))
            table(
                "warm: no dropping, as in a second epoch; direct = SRC from the page cache, "
                "mount = SSD-tier hits from the page cache",
                direct,
                through,
                args.readers,
                args.repeat,
                None,
                rng,
            )
            after = _ssd_counts(stats(mnt))
            for name, a, b in (("cold", before, mid), ("warm", warm0, after)):
                opens, ssd, ram, miss, src_bytes = (y - x for x, y in zip(a, b, strict=True))
                print(
                    f"{name} timed mount passes: {opens} opens, {ssd} SSD hits, {ram} RAM hits, "
                    f"{miss} misses, {src_bytes} B read from the source"
                )


if __name__ == "__main__":
    main()
