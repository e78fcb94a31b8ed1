"""Helpers shared by the benchmarks in tools/: datasets, mounts and timed reader processes.

Benchmarks report ratios measured in one run (shadefs vs direct read, vs LRU, vs theory);
they are not tests and assert nothing.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path


def make_dataset(
    root: Path, files: int, size: int, *, classes: int = 10, jitter: float = 0.0, seed: int = 0
) -> list[str]:
    """An ImageFolder-like tree of `files` random files of about `size` bytes (kept if present)."""
    rng = random.Random(seed)
    rels = []
    for i in range(files):
        rel = f"class_{i % classes:03d}/sample_{i:07d}.bin"
        rels.append(rel)
        path = root / rel
        n = int(size * (1 + jitter * (2 * rng.random() - 1)))
        if path.exists() and path.stat().st_size == n:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(n))
    return rels


@contextlib.contextmanager
def mounted(src: Path, mnt: Path, *args: str) -> Iterator[Path]:
    """`shadefs mount SRC MNT ARGS`, unmounted on exit whatever happens."""
    mnt.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "shadefs", "mount", str(src), str(mnt), "--log", "none", *args]
    subprocess.run(cmd, check=True)
    try:
        yield mnt
    finally:
        subprocess.run([sys.executable, "-m", "shadefs", "umount", str(mnt)], check=False)


def stats(mnt: Path) -> dict:
    return json.loads((mnt / ".shadefs" / "stats.json").read_bytes())


def _read_list(paths: Sequence[str]) -> int:
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
    return total


def files_per_second(paths: Sequence[str], readers: int) -> float:
    """Read every path once with `readers` processes (a disjoint share each); files/s."""
    shares = [list(paths[i::readers]) for i in range(readers)]
    ctx = mp.get_context("fork")
    with ctx.Pool(readers) as pool:
        pool.map(_read_list, [s[:1] for s in shares])  # start the workers before timing
        t0 = time.perf_counter()
        pool.map(_read_list, shares)
        elapsed = time.perf_counter() - t0
    return len(paths) / elapsed


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2]
