"""A shard dataset read like WebDataset: bytes fetched per epoch and MB/s, through the mount.

    python tools/bench/bench_shards.py [--shards 6] [--size 320M] [--epochs 3] [--readers 1,4]

Each epoch reads every shard once, whole and sequentially with 1 MiB reads, in a fresh
shuffled shard order; with R readers, each takes the next shard of that order. Reported:

- bytes fetched from the source per epoch, as a fraction of the data, for (a) RAM 20% + an
  SSD tier that holds the data and (b) RAM only, 20% (the `epoch` policy's bound is f: the
  fraction fetched on epochs 2..N should approach 1 - f = 0.80);
- MB/s and the ratio to a direct read of the source (its files in the page cache): cold
  (epoch 1, every block from the source; of (b), and of (a) with the SSD tier's write-behind
  running beside it), warm from SSD (epochs 2..N of (a), with the SSD
  tier's files dropped from the page cache before each epoch), warm from RAM (RAM twice the
  data, the mount's pages dropped before each read, so that every read reaches the daemon),
  warm through the kernel's page cache (keep_cache: every block resident), and pass-through
  (`--passthrough-above 1`).

The "source" is a local directory whose files are in the page cache, so "cold" measures the
daemon's miss path, not a network. Byte fractions are exact; MB/s are noisy on a shared
machine: compare them as ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from benchlib import drop_page_cache, mounted, stats

from shadefs.common import parse_size

READ = 1 << 20


def make_shards(src: Path, n: int, size: int) -> list[str]:
    src.mkdir(parents=True, exist_ok=True)
    rels = []
    chunk = os.urandom(16 << 20)
    for i in range(n):
        rel = f"shard-{i:05d}.tar"
        with open(src / rel, "wb") as f:
            left = size
            while left:
                k = min(left, len(chunk))
                f.write(chunk[:k])
                left -= k
                chunk = chunk[1:] + chunk[:1]  # no two 16 MiB runs alike
        rels.append(rel)
    return rels


def read_shard(path: Path, buf: memoryview, before: Callable[[Path], None] | None) -> int:
    if before is not None:
        before(path)
    n = 0
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            n += k
    return n


def epoch(
    root: Path,
    order: list[str],
    readers: int,
    before: Callable[[Path], None] | None = None,
) -> tuple[int, float]:
    """Read the shards of `order` with `readers` threads; (bytes, seconds)."""
    queue = list(reversed(order))
    lock = threading.Lock()
    total = [0]

    def work() -> None:
        buf = memoryview(bytearray(READ))
        while True:
            with lock:
                if not queue:
                    return
                rel = queue.pop()
            n = read_shard(root / rel, buf, before)
            with lock:
                total[0] += n

    threads = [threading.Thread(target=work) for _ in range(readers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return total[0], time.perf_counter() - t0


def fadvise_dontneed(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def wait_writes(mnt: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while stats(mnt)["tiers"]["ssd"]["queued_writes"] and time.monotonic() < deadline:
        time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=6)
    ap.add_argument("--size", type=parse_size, default=320 << 20, help="bytes per shard")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--readers", default="1,4", help="comma-separated reader counts")
    ap.add_argument("--fraction", type=float, default=0.2, help="RAM budget / data")
    ap.add_argument("--block-size", default="8M")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args()
    readers_list = [int(r) for r in args.readers.split(",")]

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        src, mnt, ssd = Path(tmp) / "src", Path(tmp) / "mnt", Path(tmp) / "ssd"
        rels = make_shards(src, args.shards, args.size)
        total = args.shards * args.size
        ram = int(total * args.fraction)
        common = ("--block-size", args.block_size, "--policy", "epoch")
        print(
            f"{args.shards} shards x {args.size / 2**20:.0f} MiB = {total / 2**20:.0f} MiB, "
            f"{args.epochs} epochs, shuffled shard order, {READ >> 20} MiB reads, "
            f"block size {args.block_size}, RAM {args.fraction:.0%} = {ram / 2**20:.0f} MiB"
        )
        rng = random.Random(args.seed)
        orders = [rng.sample(rels, len(rels)) for _ in range(args.epochs)]

        for readers in readers_list:
            print(f"\n== {readers} reader(s)")
            # The direct read: the source's files, warm in the page cache.
            epoch(src, orders[0], readers)
            n, dt = epoch(src, orders[0], readers)
            direct = n / dt / 1e6
            print(f"direct read of the source (page cache): {direct:8.0f} MB/s")
            rates: dict[str, float] = {}

            for name, extra in (
                ("a) RAM 20% + SSD", ("--ssd", f"{ssd}:{2 * total}")),
                ("b) RAM 20% only", ()),
            ):
                fractions: list[float] = []
                warm_ssd: list[float] = []
                with mounted(src, mnt, "--ram", str(ram), *common, *extra) as m:
                    for e, order in enumerate(orders):
                        if extra and e:
                            wait_writes(m)  # write-behind of the previous epoch
                            drop_page_cache(ssd)
                        b0 = stats(m)["bytes_from_source"]
                        n, dt = epoch(m, order, readers)
                        fetched = stats(m)["bytes_from_source"] - b0
                        fractions.append(fetched / total)
                        if e == 0:
                            # With an SSD tier, write-behind runs beside the cold reads.
                            cold = "cold, SSD writes" if extra else "cold (source)"
                            rates[cold] = n / dt / 1e6
                        elif e and extra:
                            warm_ssd.append(n / dt / 1e6)
                    blk = stats(m)["blocks"]
                cells = "  ".join(f"e{e + 1} {f:.3f}" for e, f in enumerate(fractions))
                later = fractions[1:]
                mean = sum(later) / len(later) if later else 0.0
                print(
                    f"{name:18s} fetched/data: {cells}   epochs 2-{args.epochs} mean {mean:.3f}"
                    f"  (blocks: {blk['source_loads']} from source, {blk['ssd_loads']} from SSD)"
                )
                if warm_ssd:
                    rates["warm SSD (page cache dropped)"] = sum(warm_ssd) / len(warm_ssd)
                shutil.rmtree(ssd, ignore_errors=True)

            with mounted(src, mnt, "--ram", str(2 * total), *common) as m:
                epoch(m, orders[0], readers)  # fill
                n, dt = epoch(m, orders[1 % len(orders)], readers, fadvise_dontneed)
                rates["warm RAM (daemon)"] = n / dt / 1e6
                epoch(m, orders[0], readers)  # keep_cache: pages stay from here on
                n, dt = epoch(m, orders[0], readers)
                rates["warm RAM (page cache)"] = n / dt / 1e6
                assert stats(m)["bytes_from_source"] <= total * 1.01
            with mounted(src, mnt, "--ram", str(ram), "--passthrough-above", "1") as m:
                n, dt = epoch(m, orders[0], readers, fadvise_dontneed)
                rates["pass-through"] = n / dt / 1e6
            for key, rate in rates.items():
                print(f"{key:30s} {rate:8.0f} MB/s   ratio to direct {rate / direct:5.2f}")


if __name__ == "__main__":
    main()
