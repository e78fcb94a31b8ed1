"""Helpers shared by the benchmarks in tools/bench/: datasets, mounts, stats, timed readers.

Benchmarks report ratios measured in one run (shadefs vs direct read, vs LRU, vs theory);
they are not tests and assert nothing about speed. Every mount made here is unmounted in a
``finally``, whatever ended the block (an exception, Ctrl-C, or SIGTERM and SIGHUP once
``raise_on_sigterm`` is installed), with ``fusermount3 -u -z`` as the last resort.

Run the benchmarks as scripts (``python tools/bench/bench_epochs.py``): the script's own
folder is then first on sys.path, which is how they import this module.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import multiprocessing.pool
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

SHADEFS = [sys.executable, "-m", "shadefs"]
#: The slow-remote emulator (shadefs/demo/slowfs.py) as the benchmarks start it.
SLOWFS = [sys.executable, "-m", "shadefs.demo.slowfs"]
# The floor of a pyfuse3 + trio daemon (bench_cpu, bench_e2e (h)): a tree served from memory.
FLOORFS = Path(__file__).with_name("floorfs.py")
MOUNT_DEADLINE = 60.0


# --- datasets ----------------------------------------------------------------------------


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


# --- mounts ------------------------------------------------------------------------------


def is_mounted(path: Path) -> bool:
    """From /proc/self/mounts, so that a dead FUSE mount (ENOTCONN) still counts."""
    target = os.path.abspath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 1 and _unescape(fields[1]) == target:
                return True
    return False


def _unescape(field: str) -> str:
    return (
        field.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
    )


def lazy_unmount(mnt: Path) -> None:
    if is_mounted(mnt):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)


def mount(src: Path, mnt: Path, *args: str) -> float:
    """`shadefs mount SRC MNT --log none ARGS`; the command's wall time (it returns when ready).

    A `--log` in ARGS overrides the default.
    """
    mnt.mkdir(parents=True, exist_ok=True)
    cmd = [*SHADEFS, "mount", str(src), str(mnt), "--log", "none", *args]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def umount(mnt: Path) -> float:
    """`shadefs umount MNT` (waits for the daemon), else `fusermount3 -u -z`; wall time."""
    t0 = time.perf_counter()
    res = subprocess.run([*SHADEFS, "umount", str(mnt)], check=False)
    if res.returncode != 0 or is_mounted(mnt):
        lazy_unmount(mnt)
    return time.perf_counter() - t0


@contextlib.contextmanager
def mounted(src: Path, mnt: Path, *args: str) -> Iterator[Path]:
    """A shadefs mount for the duration of the block; unmounted and its daemon gone after."""
    lazy_unmount(mnt)  # a leftover of an earlier, killed run
    pid: int | None = None
    try:
        # Inside the try: a Ctrl-C during start-up must still unmount what got mounted.
        mount(src, mnt, *args)
        pid = int(stats(mnt)["pid"])
        yield mnt
    finally:
        if is_mounted(mnt):
            umount(mnt)
        if pid is not None and _alive(pid):
            _stop(pid)


@contextlib.contextmanager
def slowfs_mounted(
    src: Path, mnt: Path, options: Sequence[str], script: Path | None = None
) -> Iterator[tuple[Path, int]]:
    """The emulated slow remote in the foreground, as our child, in its own session.

    Yields (mnt, pid). Its own session: Ctrl-C must not unmount the remote under a shadefs
    mount that still serves it; the ``finally`` stops it after the mounts above it are gone.
    ``script`` runs another emulator script instead of ``shadefs.demo.slowfs``.
    """
    mnt.mkdir(parents=True, exist_ok=True)
    lazy_unmount(mnt)
    emulator = SLOWFS if script is None else [sys.executable, str(script)]
    proc = subprocess.Popen([*emulator, str(src), str(mnt), *options], start_new_session=True)
    try:
        _wait(lambda: is_mounted(mnt), f"slowfs on {mnt}", proc)
        yield mnt, proc.pid
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        lazy_unmount(mnt)


def _wait(condition: Callable[[], bool], what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + MOUNT_DEADLINE
    while not condition():
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _stop(pid: int, grace: float = 10.0) -> None:
    """SIGTERM the process ``pid`` (one we started), SIGKILL it after ``grace`` seconds."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def shadefs_mount_help() -> str:
    out = subprocess.run([*SHADEFS, "mount", "--help"], capture_output=True, text=True)
    return out.stdout


# --- stats -------------------------------------------------------------------------------


def stats(mnt: Path) -> dict[str, Any]:
    """The mount's .shadefs/stats.json."""
    with open(mnt / ".shadefs" / "stats.json", "rb") as f:
        doc: dict[str, Any] = json.loads(f.read())
    return doc


def slowfs_stats(mnt: Path) -> dict[str, Any]:
    """The emulator's counters (opens, reads, bytes, ...) from its stats xattr."""
    doc: dict[str, Any] = json.loads(os.getxattr(mnt, "user.slowfs.stats"))
    return doc


def wait_until(
    mnt: Path, done: Callable[[dict[str, Any]], bool], *, timeout: float, interval: float = 0.2
) -> dict[str, Any]:
    """Poll stats.json until done(stats) holds; the last stats. Raises after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(mnt)
        if done(s):
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(f"stats of {mnt} did not reach the expected state in {timeout} s")
        time.sleep(interval)


# --- signals -----------------------------------------------------------------------------


@contextlib.contextmanager
def raise_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into KeyboardInterrupt in this process, so ``finally`` runs.

    Forked children (DataLoader workers) inherit the handler; it only raises in the process
    that installed it, the others get the default action. worker_pool's workers start with
    the default action anyway.
    """
    me = os.getpid()

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != me:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt(signal.Signals(signum).name)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# --- timed readers -----------------------------------------------------------------------


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


def _noop(_: int) -> None:
    return None


def read_files(paths: Sequence[str]) -> int:
    """Read every path to its end; the bytes read."""
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


# --- the kernel's caches and the machine -------------------------------------------------


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_caches(pages_only: bool = False) -> None:
    """Write back dirty pages, then drop the page cache, and unless `pages_only` also the
    dentries and inodes (needs root)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n" if pages_only else "3\n")


def drop_page_cache(root: Path, pattern: str = "*") -> None:
    """Drop the cached pages of every file under ``root`` (no root needed)."""
    for path in root.rglob(pattern):
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


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


_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int, tid: int | None = None) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads, also those that ended),
    or of its thread ``tid`` only; None if it is gone."""
    stat = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(stat) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, every core counted."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / _TICK, sum(values) / _TICK
