"""Mount readiness with a huge SSD cache: the index is restored in the background.

    python tools/bench/bench_restore.py [--entries 1000000] [--size 200] [--repeat 3]
                                        [--workdir /var/tmp/shadefs-bench-restore] [--clean]

Builds (or reuses, under --workdir on the local disk) a source tree of N small files in 1000
directories and a valid SSD cache directory holding an entry for every one of them. The
cache is written directly, not through a mount: one process holds the SsdStore (and its
directory lock) and writes the first entry with SsdStore.put; worker processes write the
others with an encoder that must produce that entry byte for byte first.

Then, --repeat times: drop the kernel's caches (as after a reboot; --page-cache warm skips
it, as after a daemon restart), time `shadefs mount SRC MNT --ram 64M --ssd CACHE` (it
returns once the mount answers), read --sample random files through the mount at once
(while the restore runs, if it has not finished), count from stats.json how many were
SSD hits and how many bytes came from the source, poll stats.json until `restore.done`,
and unmount. Prints every run and a summary with medians. Asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchlib import (
    can_drop_caches,
    describe_disk,
    drop_caches,
    median,
    mount,
    raise_on_sigterm,
    read_files,
    stats,
    umount,
    wait_until,
    worker_pool,
)

from shadefs.cache.ssd.format import BLOCK, HSIZE, encode_header, entry_name
from shadefs.cache.ssd.ledger import NBUCKETS
from shadefs.cache.ssd.store import CacheLocked, SsdStore
from shadefs.common import format_size
from shadefs.file_version import Signature

GiB = 1 << 30


@dataclass(frozen=True)
class Layout:
    n: int
    size: int
    dirs: int
    root: Path

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def mnt(self) -> Path:
        return self.root / "mnt"

    @property
    def src_marker(self) -> Path:
        return self.root / "src.done"

    @property
    def cache_marker(self) -> Path:
        return self.root / "cache.done"

    def rel(self, i: int) -> str:
        return f"d{i % self.dirs:03d}/f{i:07d}.bin"

    def entry_disk_bytes(self) -> int:
        return -(-(HSIZE + len(self.rel(0)) + self.size) // BLOCK) * BLOCK


@dataclass
class Run:
    mount_s: float
    sampled: int
    ssd_hits: int
    misses: int
    from_source: int
    sample_s: float
    during_restore: bool
    restore_s: float
    restore_entries: int
    ssd_entries: int
    umount_s: float


# --- SSD entries written without the daemon ----------------------------------------------


def encode_entry(relpath: bytes, data: bytes, sig: Signature) -> bytes:
    """The exact bytes SsdStore.put writes for this entry (see cache/ssd/format.py)."""
    return encode_header(relpath, data, sig) + relpath + data


def check_encoder(store: SsdStore, src: Path, relpath: bytes) -> None:
    """Write one entry with store.put and insist that encode_entry produces the same file."""
    data = (src / os.fsdecode(relpath)).read_bytes()
    sig = Signature.of(os.stat(src / os.fsdecode(relpath)))
    if not store.put(relpath, data, sig):
        raise RuntimeError(f"SsdStore.put refused {relpath!r}: is the disk full?")
    path = store.key_path(relpath)
    if path.name != entry_name(relpath) or path.parent.name != path.name[:3]:
        raise RuntimeError(f"entry naming changed in cache/ssd/store.py: {path}")
    if path.read_bytes() != encode_entry(relpath, data, sig):
        raise RuntimeError("the entry format changed in cache/ssd/store.py: update encode_entry")
    if store.get(relpath, sig) != data:
        raise RuntimeError("SsdStore.get does not return what was put")


# --- building the source tree and the cache (worker processes) ---------------------------


def _make_src_dir(job: tuple[Layout, int]) -> int:
    lay, d = job
    (lay.src / f"d{d:03d}").mkdir(parents=True, exist_ok=True)
    n = 0
    for i in range(d, lay.n, lay.dirs):
        with open(lay.src / lay.rel(i), "wb") as f:
            f.write(os.urandom(lay.size))
        n += 1
    return n


def _make_cache_dir(job: tuple[Layout, int]) -> int:
    """Write the entry of every file of source directory d, as SsdStore.put would."""
    lay, d = job
    data_dir = f"{lay.cache}/data"
    n = 0
    for i in range(d, lay.n, lay.dirs):
        rel = lay.rel(i).encode()
        fd = os.open(lay.src / lay.rel(i), os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            data = os.read(fd, st.st_size + 1)
        finally:
            os.close(fd)
        blob = encode_entry(rel, data, Signature.of(st))
        name = entry_name(rel)
        out = os.open(
            f"{data_dir}/{name[:3]}/{name}",
            os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
            0o600,
        )
        try:
            os.write(out, blob)
        finally:
            os.close(out)
        n += 1
    return n


def _in_parallel(what: str, fn, lay: Layout, jobs: int) -> float:  # type: ignore[no-untyped-def]
    """Run fn over every directory index with `jobs` processes, printing progress; seconds."""
    t0 = time.perf_counter()
    done, step = 0, max(lay.n // 10, 1)
    next_report = step
    with worker_pool(jobs) as pool:
        for n in pool.imap_unordered(fn, [(lay, d) for d in range(lay.dirs)], chunksize=4):
            done += n
            if lay.n >= 100_000 and next_report <= done < lay.n:
                el = time.perf_counter() - t0
                print(f"  {what}: {done}/{lay.n} files, {el:.0f} s, {done / el:.0f}/s", flush=True)
                next_report += step
    return time.perf_counter() - t0


def check_space(lay: Layout, need_src: bool, need_cache: bool) -> None:
    sv = os.statvfs(lay.root)
    free, inodes = sv.f_bavail * sv.f_frsize, sv.f_favail
    need_bytes = GiB  # the daemon's default free-space floor on the cache disk (at most 1 GiB)
    need_inodes = 0
    if need_src:
        need_bytes += lay.n * (-(-lay.size // BLOCK) * BLOCK) + lay.dirs * BLOCK
        need_inodes += lay.n + lay.dirs
    if need_cache:
        need_bytes += lay.n * lay.entry_disk_bytes() + NBUCKETS * BLOCK
        need_inodes += lay.n + NBUCKETS
    print(
        f"disk {describe_disk(lay.root)} at {lay.root}: {format_size(free)} and {inodes} inodes "
        f"free, this run needs {format_size(need_bytes)} and {need_inodes} inodes more"
    )
    if free < need_bytes or (inodes and inodes < need_inodes):
        sys.exit(f"not enough free space under {lay.root}: use --workdir on a larger disk")


def build(lay: Layout, jobs: int, rebuild: bool) -> None:
    lay.root.mkdir(parents=True, exist_ok=True)
    if rebuild:
        lay.src_marker.unlink(missing_ok=True)
    token = lay.src_marker.read_text().strip() if lay.src_marker.exists() else None
    cache_ok = token is not None and lay.cache_marker.exists()
    cache_ok = cache_ok and lay.cache_marker.read_text().strip() == token
    check_space(lay, token is None, not cache_ok)

    if token is None:
        lay.cache_marker.unlink(missing_ok=True)
        shutil.rmtree(lay.src, ignore_errors=True)
        print(f"building the source tree: {lay.n} files of {lay.size} B in {lay.dirs} dirs")
        el = _in_parallel("source", _make_src_dir, lay, jobs)
        token = secrets.token_hex(8)
        lay.src_marker.write_text(token + "\n")
        print(f"source tree built in {el:.1f} s ({lay.n / el:.0f} files/s)")
    else:
        print(f"reusing the source tree at {lay.src}")

    if cache_ok:
        print(f"reusing the SSD cache at {lay.cache}")
        return
    lay.cache_marker.unlink(missing_ok=True)
    if lay.cache.exists():
        t0 = time.perf_counter()
        shutil.rmtree(lay.cache)
        print(f"removed the old cache directory in {time.perf_counter() - t0:.1f} s")
    print(f"building the SSD cache: {lay.n} entries, {jobs} writer processes")
    t0 = time.perf_counter()
    try:
        store = SsdStore(lay.cache, capacity=1 << 62, min_free=0)
    except CacheLocked as exc:
        sys.exit(str(exc))
    with store:
        # The store holds the directory lock for the whole build, and its own put() writes
        # the first entry: the encoder the workers use must reproduce it byte for byte.
        check_encoder(store, lay.src, lay.rel(0).encode())
        for b in range(NBUCKETS):
            os.makedirs(f"{lay.cache}/data/{b:03x}", mode=0o700, exist_ok=True)
        _in_parallel("cache", _make_cache_dir, lay, jobs)
        os.sync()
    el = time.perf_counter() - t0
    lay.cache_marker.write_text(token + "\n")
    print(f"SSD cache built in {el:.1f} s ({lay.n / el:.0f} entries/s)")


# --- mounting -----------------------------------------------------------------------------


def one_run(lay: Layout, args: argparse.Namespace, rep: int, cold: bool) -> Run:
    rng = random.Random(rep)
    sample = [str(lay.mnt / lay.rel(i)) for i in rng.sample(range(lay.n), min(args.sample, lay.n))]
    opts = [
        "--ram",
        "64M",
        "--ssd",
        str(lay.cache) + (f":{args.ssd_size}" if args.ssd_size else ""),
    ]
    opts += ["--log", str(lay.root / "daemon.log")]
    if os.path.ismount(lay.mnt):
        umount(lay.mnt)
    if cold:
        drop_caches()
    mount_s = mount(lay.src, lay.mnt, *opts)
    try:
        t0 = time.perf_counter()
        read_files(sample)
        sample_s = time.perf_counter() - t0
        s1 = stats(lay.mnt)
        s2 = wait_until(lay.mnt, lambda s: s["restore"]["done"], timeout=args.restore_timeout)
        if s2["ssd_capacity"] < s2["ssd_bytes"]:
            print(f"  warning: SSD budget {s2['ssd_capacity']} B is below the cache's size")
    finally:
        umount_s = umount(lay.mnt)
    return Run(
        mount_s=mount_s,
        sampled=len(sample),
        ssd_hits=s1["ssd_hits"],
        misses=s1["misses"],
        from_source=s1["bytes_from_source"],
        sample_s=sample_s,
        during_restore=not s1["restore"]["done"],
        restore_s=s2["restore"]["seconds"],
        restore_entries=s2["restore"]["entries"],
        ssd_entries=s2["ssd_entries"],
        umount_s=umount_s,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--size", type=int, default=200, help="bytes per source file")
    ap.add_argument("--dirs", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sample", type=int, default=1000, help="files read right after mounting")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/shadefs-bench-restore"))
    ap.add_argument("--jobs", type=int, default=2 * (os.cpu_count() or 1))
    ap.add_argument("--ssd-size", help="SSD budget (default: the daemon's default)")
    ap.add_argument("--page-cache", choices=["cold", "warm"], default="cold")
    ap.add_argument("--restore-timeout", type=float, default=3600.0)
    ap.add_argument("--rebuild", action="store_true", help="rebuild source tree and cache")
    ap.add_argument("--clean", action="store_true", help="delete tree and cache afterwards")
    args = ap.parse_args()
    with raise_on_sigterm():
        run(args)


def run(args: argparse.Namespace) -> None:
    cold = args.page_cache == "cold"
    if cold and not can_drop_caches():
        sys.exit("--page-cache cold drops the kernel's caches and needs root (or use warm)")
    dirs = max(1, min(args.dirs, args.entries))
    lay = Layout(args.entries, args.size, dirs, args.workdir.resolve() / f"n{args.entries}")
    try:
        build(lay, args.jobs, args.rebuild)
        how = (
            "kernel caches dropped before each mount (as after a reboot)"
            if cold
            else "kernel caches warm (as after a daemon restart)"
        )
        print(f"mounting {args.repeat} times: --ram 64M --ssd {lay.cache}; {how}")
        runs = []
        for rep in range(args.repeat):
            r = one_run(lay, args, rep, cold)
            runs.append(r)
            when = "during the restore" if r.during_restore else "after the restore had finished"
            print(
                f"  mount {rep + 1}: ready in {r.mount_s:.2f} s; {r.sampled} random files read "
                f"{when} in {r.sample_s:.2f} s: {r.ssd_hits} SSD hits, {r.misses} misses, "
                f"{r.from_source} B from source; restore done after {r.restore_s:.1f} s "
                f"({r.restore_entries} entries restored, {r.ssd_entries} indexed); "
                f"umount {r.umount_s:.2f} s",
                flush=True,
            )
        hits = sum(r.ssd_hits for r in runs)
        sampled = sum(r.sampled for r in runs)
        during = all(r.during_restore for r in runs)
        print(
            f"{lay.n} entries: mount ready in {median([r.mount_s for r in runs]):.2f} s "
            f"(median of {len(runs)}), restore done after "
            f"{median([r.restore_s for r in runs]):.1f} s, {hits}/{sampled} sampled files "
            f"served from SSD {'during the restore' if during else '(some after the restore)'}"
        )
    finally:
        if os.path.ismount(lay.mnt):
            umount(lay.mnt)
        if args.clean:
            shutil.rmtree(lay.root, ignore_errors=True)


if __name__ == "__main__":
    main()
