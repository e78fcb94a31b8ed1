"""The daemon's memory per file on a large tree, and the start-up costs that scale with it.

    python tools/bench/bench_namespace.py [--files 200000] [--per-dir 200] [--dir /tmp/shadefs-ns]
        [--ls-dirs 50] [--compare-with OTHER_CHECKOUT]

Builds (once; a marker file keeps it for the next run) a tree of FILES tiny files (0-16 B)
in directories of PER_DIR files, mounts it, and reports:

- mount ready: the wall time of `shadefs mount` (it returns when the mount answers);
- find: `find -type f` through the mount and directly on the source, in one run (files/s
  and their ratio), then `os.stat` of every file through the mount;
- the daemon's RSS (VmRSS of the pid in stats.json) before and after listing and stat-ing
  every file, as bytes per file;
- ShadeSampler's start: registering the file list on `.shadefs/dataset` and reading the
  first `order` (as shadefs/torch/client.py does, without torch), and the RSS that adds;
- `find` and `ls -lR` (of the first LS_DIRS directories) through the mount and directly, in
  turns; with --compare-with, a second daemon from another checkout (say the commit before a
  change) is mounted beside this one and measured the same way, so ratios compare in one run;
- `getxattr` of an absent attribute on every file of two directories `ls` did not visit;
- the PADS global order build time for FILES samples, in this process.

Times depend on the machine's load (say whether it was shared); byte counts do not.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from benchlib import mounted, stats

from shadefs.sampling import pads, wire
from shadefs.torch.client import ControlClient


def build_tree(root: Path, files: int, per_dir: int) -> list[str]:
    """The tree's relative paths (sorted as a listing would be); builds it unless marked."""
    dirs = (files + per_dir - 1) // per_dir
    rels = [
        f"d{d:05d}/f{i:04d}" for d in range(dirs) for i in range(min(per_dir, files - d * per_dir))
    ]
    marker = root / f".built-{files}-{per_dir}"
    if marker.exists():
        return rels
    t0 = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    payload = b"0123456789abcdef"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    for d in range(dirs):
        dfd_path = root / f"d{d:05d}"
        dfd_path.mkdir(exist_ok=True)
        dfd = os.open(dfd_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i in range(min(per_dir, files - d * per_dir)):
                fd = os.open(f"f{i:04d}", flags, 0o644, dir_fd=dfd)
                os.write(fd, payload[: (d + i) % 17])
                os.close(fd)
        finally:
            os.close(dfd)
    marker.touch()
    print(f"built {files} files in {dirs} directories in {time.perf_counter() - t0:.1f} s")
    return rels


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def find_files(top: Path) -> tuple[int, float]:
    t0 = time.perf_counter()
    out = subprocess.run(["find", str(top), "-type", "f"], capture_output=True, check=True)
    return out.stdout.count(b"\n"), time.perf_counter() - t0


def ls_lr(tops: list[Path]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["ls", "-lR", *map(str, tops)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def getxattr_us(tops: list[Path]) -> float:
    """Microseconds per getxattr of an absent attribute, over every file of `tops`."""
    files = [str(top / name) for top in tops for name in os.listdir(top)]
    t0 = time.perf_counter()
    for f in files:
        with contextlib.suppress(OSError):
            os.getxattr(f, "user.shadefs-bench", follow_symlinks=False)
    return (time.perf_counter() - t0) / len(files) * 1e6


def _mount(stack: contextlib.ExitStack, src: Path, mnt: Path, pythonpath: str | None) -> int:
    """Mount with the shadefs checkout at `pythonpath` (None: this one); the daemon's pid."""
    old, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    if pythonpath is not None:
        # `python -m` puts the working directory first on sys.path: run from the checkout.
        os.environ["PYTHONPATH"] = pythonpath
        os.chdir(pythonpath)
    try:
        stack.enter_context(mounted(src, mnt, "--ram", "64M", "--no-prefetch"))
    finally:
        os.chdir(cwd)
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    return int(stats(mnt)["pid"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=200_000)
    ap.add_argument("--per-dir", type=int, default=200)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/shadefs-ns"))
    ap.add_argument("--ls-dirs", type=int, default=50, help="directories that ls -lR walks")
    ap.add_argument(
        "--compare-with",
        metavar="CHECKOUT",
        help="another shadefs checkout (a directory holding shadefs/): mount it too, and "
        "time find and ls -lR through both mounts in turn",
    )
    args = ap.parse_args()
    base = args.dir / f"{args.files}x{args.per_dir}"
    src = base / "src"
    rels = build_tree(src, args.files, args.per_dir)
    n = len(rels)
    print(f"tree: {n} files, {args.per_dir} per directory, under {src}")
    checkouts: list[tuple[str, str | None]] = [("this", None)]
    if args.compare_with:
        checkouts.append(("other", os.path.abspath(args.compare_with)))

    with contextlib.ExitStack() as stack:
        mnts, pids = {}, {}
        for label, pythonpath in checkouts:
            mnts[label] = base / f"mnt-{label}"
            t0 = time.perf_counter()
            pids[label] = _mount(stack, src, mnts[label], pythonpath)
            print(f"[{label}] mount ready: {time.perf_counter() - t0:.2f} s")
        rss0 = {label: rss(pid) for label, pid in pids.items()}
        # Direct first, so that the source's dentries are warm for every walk.
        direct_n, direct_t = find_files(src)
        for label, mnt in mnts.items():
            mnt_n, mnt_t = find_files(mnt)
            assert mnt_n == direct_n, (mnt_n, direct_n)
            t1 = time.perf_counter()
            for rel in rels:
                os.stat(mnt / rel)
            stat_t = time.perf_counter() - t1
            rss1 = rss(pids[label])
            print(
                f"[{label}] find -type f: {mnt_n / mnt_t:,.0f} files/s through the mount, "
                f"{direct_n / direct_t:,.0f} files/s direct (shadefs/direct time "
                f"{mnt_t / direct_t:.1f}); os.stat of every file: {stat_t:.2f} s"
            )
            print(
                f"[{label}] daemon RSS: {rss0[label] / 2**20:.1f} MiB at mount, "
                f"{rss1 / 2**20:.1f} MiB after listing and stat-ing: "
                f"{(rss1 - rss0[label]) / n:.0f} B per file"
            )
            client = ControlClient(mnt)
            t1 = time.perf_counter()
            client.register(wire.encode_dataset(rels))
            reply = client.order(wire.encode_order_request(0, 0, 1, 0))
            reg_t = time.perf_counter() - t1
            order = wire.decode_order_response(reply)[1]
            rss2 = rss(pids[label])
            print(
                f"[{label}] sampler register + first order: {reg_t:.2f} s ({len(order)} "
                f"indices); daemon RSS +{(rss2 - rss1) / n:.0f} B per sample; "
                f"{(rss2 - rss0[label]) / n:.0f} B per file in all"
            )
        # Timings in turns (direct, then each mount), twice, so that load hits all alike.
        dirs = sorted({r.split("/")[0] for r in rels})[: args.ls_dirs]
        for rnd in range(2):
            d_find = find_files(src)[1]
            d_ls = ls_lr([src / d for d in dirs])
            for label, mnt in mnts.items():
                m_find = find_files(mnt)[1]
                m_ls = ls_lr([mnt / d for d in dirs])
                print(
                    f"[{label}] round {rnd}: find {m_find:.2f} s vs {d_find:.2f} s direct "
                    f"(ratio {m_find / d_find:.1f}); ls -lR of {len(dirs)} dirs "
                    f"{m_ls:.2f} s vs {d_ls:.2f} s direct (ratio {m_ls / d_ls:.1f})"
                )
        # Directories that ls -lR did not visit: each mount's first getxattr there.
        more = sorted({r.split("/")[0] for r in rels})[args.ls_dirs : args.ls_dirs + 2]
        for label, mnt in mnts.items():
            us = getxattr_us([mnt / d for d in more])
            print(f"[{label}] getxattr of an absent attribute: {us:.0f} us")

    scores = np.ones(n, dtype=np.float64)
    resident = np.zeros(n, dtype=bool)
    resident[: n // 5] = True
    params = pads.OrderParams(epoch=1, seed=0, world_size=1, rank=0, replay=2.0)
    t1 = time.perf_counter()
    full = pads.build_global_order(scores, resident, params)
    print(
        f"PADS global order of {n} samples (20% resident, r=2): "
        f"{time.perf_counter() - t1:.2f} s, {len(full)} entries"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
