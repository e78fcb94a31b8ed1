"""Helpers for the SSD-tier benchmarks (bench_restore.py, bench_ssd_hits.py).

Mounts that are always unmounted (with a lazy fallback), stats polling, dropping the kernel's
caches, timed reader processes with a hook that runs after the workers exist and just before
the clock starts, and an SSD entry encoder that is checked byte for byte against
`SsdStore.put` before it is trusted.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import multiprocessing.pool
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import xxhash

from shadefs.cache.ssd_format import Signature, encode_header
from shadefs.cache.ssd_store import SsdStore

SHADEFS = [sys.executable, "-m", "shadefs"]


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so that `finally` blocks unmount what we mounted.

    Pool workers must not inherit it: see worker_pool.
    """
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def _unblock_sigterm() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def worker_pool(processes: int) -> multiprocessing.pool.Pool:
    """A fork Pool whose workers have SIGTERM at its default action.

    Pool.terminate() stops workers with SIGTERM. A worker with a Python-level handler can
    take the signal just before it blocks on the pool's shared queue lock, never run the
    handler, and hang the pool's join forever. So the workers are forked with SIGTERM
    blocked and at SIG_DFL, and unblock it first thing; the parent gets its handler back
    and then any SIGTERM that arrived meanwhile.
    """
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        return mp.get_context("fork").Pool(processes, initializer=_unblock_sigterm)
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


# --- mounts -----------------------------------------------------------------------------


def mount(src: Path, mnt: Path, *args: str) -> float:
    """`shadefs mount SRC MNT ARGS`; returns the command's wall time (it returns when ready)."""
    mnt.mkdir(parents=True, exist_ok=True)
    cmd = [*SHADEFS, "mount", str(src), str(mnt), *args]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def umount(mnt: Path) -> float:
    """`shadefs umount MNT` (waits for the daemon), else `fusermount3 -u -z`; wall time."""
    t0 = time.perf_counter()
    res = subprocess.run([*SHADEFS, "umount", str(mnt)], check=False)
    if res.returncode != 0 or os.path.ismount(mnt):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
    return time.perf_counter() - t0


@contextlib.contextmanager
def mounted(src: Path, mnt: Path, *args: str) -> Iterator[float]:
    """Mount for the duration of the block (yields the mount time); always unmounted."""
    if os.path.ismount(mnt):
        umount(mnt)  # left over from an interrupted run of ours
    try:
        yield mount(src, mnt, *args)
    finally:
        if os.path.ismount(mnt):
            umount(mnt)


def stats(mnt: Path) -> dict:
    return json.loads((mnt / ".shadefs" / "stats.json").read_bytes())


def wait_until(
    mnt: Path, done: Callable[[dict], bool], *, timeout: float, interval: float = 0.2
) -> dict:
    """Poll stats.json until done(stats) holds; the last stats. Raises after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(mnt)
        if done(s):
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(f"stats of {mnt} did not reach the expected state in {timeout} s")
        time.sleep(interval)


# --- the kernel's caches ----------------------------------------------------------------


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_caches() -> None:
    """Write back dirty pages, then drop the page cache, dentries and inodes (needs root)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def describe_disk(path: Path) -> str:
    """'DEVICE FSTYPE' of the filesystem holding path, from /proc/self/mountinfo."""
    dev = os.stat(path).st_dev
    want = f"{os.major(dev)}:{os.minor(dev)}"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[2] == want:
                rest = fields[fields.index("-") + 1 :]
                return f"{rest[1]} {rest[0]}"
    return "unknown filesystem"


# --- timed readers ----------------------------------------------------------------------


def _noop(_: int) -> None:
    return None


def read_files(paths: Sequence[str]) -> int:
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
    return total


def files_per_second(
    paths: Sequence[str], readers: int, before: Callable[[], None] | None = None
) -> float:
    """Read every path once with `readers` processes (a disjoint share each); files/s.

    `before` runs once the worker processes exist and just before the clock starts (e.g.
    drop_caches), so that neither process start-up nor its page-cache effects are timed.
    """
    shares = [list(paths[i::readers]) for i in range(readers)]
    with worker_pool(readers) as pool:
        pool.map(_noop, range(readers), chunksize=1)
        if before is not None:
            before()
        t0 = time.perf_counter()
        pool.map(read_files, shares, chunksize=1)
        elapsed = time.perf_counter() - t0
    return len(paths) / elapsed


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


# --- SSD entries written without the daemon ---------------------------------------------


def entry_name(relpath: bytes) -> str:
    """The entry's file name (SsdStore._key); checked against key_path by check_encoder."""
    return xxhash.xxh3_128_hexdigest(relpath)


def encode_entry(relpath: bytes, data: bytes, sig: Signature) -> bytes:
    """The exact bytes SsdStore.put writes for this entry (see cache/ssd_format.py)."""
    return encode_header(relpath, data, sig) + relpath + data


def check_encoder(store: SsdStore, src: Path, relpath: bytes) -> None:
    """Write one entry with store.put and insist that encode_entry produces the same file."""
    data = (src / os.fsdecode(relpath)).read_bytes()
    sig = Signature.of(os.stat(src / os.fsdecode(relpath)))
    if not store.put(relpath, data, sig):
        raise RuntimeError(f"SsdStore.put refused {relpath!r}: is the disk full?")
    path = store.key_path(relpath)
    if path.name != entry_name(relpath) or path.parent.name != path.name[:3]:
        raise RuntimeError(f"entry naming changed in ssd_store.py: {path}")
    if path.read_bytes() != encode_entry(relpath, data, sig):
        raise RuntimeError("the entry format changed in ssd_format.py: update encode_entry")
    if store.get(relpath, sig) != data:
        raise RuntimeError("SsdStore.get does not return what was put")
