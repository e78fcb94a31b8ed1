"""Benchmark of the sampler's two per-job hot spots: building an epoch order and ingesting losses.

Prints (a) the time to build one rank's PADS order for ImageNet-1k scale (1.28 M samples,
20% resident, r = 3, world size 8; goal < 1 s), and (b) the amortised time to decode a
losses message of one 1,024-sample batch and ingest it into a 1.28 M-entry importance table
(goal < 1 ms).  Pure CPU and in-process: no mount, no source latency involved.

Usage: python tools/bench/bench_pads.py [--samples N] [--repeats R]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np

from shadefs.sampling import wire
from shadefs.sampling.importance import ImportanceTable
from shadefs.sampling.pads import OrderParams, build_order

log = logging.getLogger(__name__)


def bench_order(n: int, repeats: int) -> tuple[float, list[float]]:
    """Return (first build, later builds) in seconds; the first one pays the seed-only
    coverage permutation, which is cached for the rest of the job."""
    rng = np.random.default_rng(0)
    scores = rng.random(n)
    resident = rng.random(n) < 0.2
    times = []
    for epoch in range(repeats + 1):
        params = OrderParams(epoch=epoch, seed=1234, world_size=8, rank=0, replay=3.0)
        start = time.perf_counter()
        order = build_order(scores, resident, params)
        times.append(time.perf_counter() - start)
        assert len(order) == -(-n // 8)
    return times[0], times[1:]


def bench_ingest(n: int, batch: int, batches: int, repeats: int) -> list[float]:
    """Seconds per batch (decode + ingest), one figure per repetition."""
    rng = np.random.default_rng(1)
    table = ImportanceTable(n)
    messages = [
        wire.encode_losses(rng.integers(0, n, batch), rng.random(batch, dtype=np.float32))
        for _ in range(batches)
    ]
    per_batch = []
    for _ in range(repeats):
        start = time.perf_counter()
        for msg in messages:
            table.ingest(*wire.decode_losses(msg, n))
        per_batch.append((time.perf_counter() - start) / batches)
    return per_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1_281_167, help="dataset size")
    parser.add_argument("--repeats", type=int, default=5, help="repetitions per figure")
    args = parser.parse_args()
    n = args.samples

    first, later = bench_order(n, args.repeats)
    print(
        f"(a) build_order N={n} resident=20% r=3 world=8: median {statistics.median(later):.3f} s"
        f" over {len(later)} epochs (first build incl. coverage permutation {first:.3f} s;"
        " goal < 1 s)"
    )
    per_batch = bench_ingest(n, batch=1024, batches=500, repeats=args.repeats)
    print(
        f"(b) decode + ingest of a 1,024-loss batch into a {n}-sample table:"
        f" median {statistics.median(per_batch) * 1e3:.3f} ms per batch"
        f" (500 batches x {len(per_batch)} repeats; goal < 1 ms)"
    )


if __name__ == "__main__":
    main()
