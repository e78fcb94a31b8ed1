"""Real random-access clients through the mount: time against direct, source bytes against asked.

    python tools/bench/bench_clients.py [--clients preads,lmdb,h5py,memmap,parquet,fio]
        [--remote local,slow] [--setups direct,ram,ssd] [--epochs 2] [--data 40M]

Clients (each reads a dataset of about `--data` bytes, written once into a temp source):

- preads: 1,000 random 4 KiB preads over 4 x 12 MiB files held open (the issue's case,
  with `--ram 14M` rather than a fraction of the data);
- lmdb: random gets of 4 KiB values (`lmdb`, readonly, lock=False);
- lmdbpages: as training loaders open LMDB (readahead=False: a page per fault), 4,000
  values of 6-14 KB (a ~48 MB data.mdb), 3,000 random gets then a full cursor scan;
- h5py: random chunks (16 rows of a chunked 2-D float32 dataset, 64 KiB each);
- memmap: random 4 KiB rows of a `.npy` through `np.load(mmap_mode="r")`;
- parquet: `pq.read_table` of 4 files (footer first, then the column chunks, reopened);
- fio: random 4k reads (`--io_size` a tenth of the data), then a sequential 1M read;
- reread: 40 files read whole in a shuffled order each epoch, as a training loop does:
  from epoch 2 the kernel holds the pages of the files that RAM evicted (cache/deferred.py);
- tar, sha256sum: `tar cf -` and `sha256sum` of an ImageFolder tree (1,500 files, 28 MiB):
  sequential tools, whose first pass shows what the SSD tier's write-behind costs.

A client whose package (or `fio`) is missing is skipped with a printed line. Setups, each
over a local source (files in the page cache) and over the slow-remote emulator
(`shadefs.demo.slowfs`, defaults: 100 MB/s, 5 ms per open):

- direct: the client reads the source (the local tree or the emulator's mount);
- ram: shadefs with RAM 30% of the data (the preads case: 14M);
- ssd: the same RAM plus an SSD tier that holds the data;
- through: the same RAM, large files read through (`--passthrough-above 1`).

Printed too: source calls per client read by type (the emulator's reads, opens and
metadata calls; client reads are gets, rows, chunks or preads), and the daemon's own
counts (FUSE reads; block hits, piece hits, extent loads). `--rounds N` alternates the
setups N times; `--mount-opts` adds shadefs options.

Before each epoch the kernel's pages of the emulator's mount are dropped (fadvise; it opens
its files without keep_cache anyway), so that direct reads reach the "remote". The mount's
own pages are left alone: opening every file to drop them would be an open of each through
shadefs, and shadefs keeps the kernel's pages only of files it holds. Printed per
epoch: seconds, the ratio to direct's same epoch, MiB from the source (shadefs's
bytes_from_source; direct over the emulator: its bytes read), and MiB the client asked for;
under a shadefs row, the daemon's CPU during the epoch (all its threads, from /proc) per
client read (a file, for tar and sha256sum); the SSD write-behind's work left when the
epoch ends is not in it.
Wall times are noisy on a shared machine; byte counts are exact.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from benchlib import (
    drop_page_cache,
    make_dataset,
    mounted,
    process_cpu,
    slowfs_mounted,
    slowfs_stats,
    stats,
)

from shadefs.common import parse_size

MiB = 1 << 20
CLIENTS = (
    "preads", "lmdb", "lmdbpages", "h5py", "memmap", "parquet", "fio", "reread", "tar", "sha256sum"
)  # fmt: skip
Client = Callable[[Path, int], tuple[int, int]]  # (root, epoch) -> (bytes asked, client reads)
# The emulator's counters that are source calls, by type (shadefs/demo/slowfs_ops.py).
CALLS = ("reads", "opens", "getattrs", "lookups", "readdirs")
_COUNTED = {*CALLS, "bytes"}


def _have(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


# --- datasets -------------------------------------------------------------------------------


def make_data(root: Path, client: str, size: int) -> None:
    d = root / client
    d.mkdir(parents=True)
    rng = random.Random(1)
    if client == "preads":
        for i in range(4):
            (d / f"f{i}.bin").write_bytes(rng.randbytes(12 * MiB))
    elif client == "lmdb":
        import lmdb

        env = lmdb.open(str(d), map_size=4 * size, subdir=True)
        with env.begin(write=True) as txn:
            for k in range(size // 4096):
                txn.put(b"%08d" % k, rng.randbytes(4000))
        env.close()
        (d / "lock.mdb").unlink(missing_ok=True)
    elif client == "lmdbpages":
        import lmdb

        # The training loaders' case: 4,000 values of 6-14 KB (overflow pages), ~48 MB.
        env = lmdb.open(str(d), map_size=4 * size, subdir=True)
        with env.begin(write=True) as txn:
            for k in range(4000):
                txn.put(b"%08d" % k, rng.randbytes(rng.randrange(6000, 14000)))
        env.close()
        (d / "lock.mdb").unlink(missing_ok=True)
    elif client == "h5py":
        import h5py
        import numpy as np

        rows = size // 4096
        with h5py.File(d / "data.h5", "w") as f:
            ds = f.create_dataset("x", (rows, 1024), dtype="float32", chunks=(16, 1024))
            ds[:] = np.random.default_rng(1).random((rows, 1024), dtype=np.float32)
    elif client == "memmap":
        import numpy as np

        arr = np.random.default_rng(1).random((size // 4096, 1024), dtype=np.float32)
        np.save(d / "data.npy", arr)
    elif client == "parquet":
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        g = np.random.default_rng(1)
        for i in range(4):
            n = size // 4 // 32
            cols = {f"c{j}": g.random(n) for j in range(4)}
            pq.write_table(pa.table(cols), d / f"part{i}.parquet", compression=None)
    elif client == "fio":
        for i in range(4):
            (d / f"f{i}.bin").write_bytes(rng.randbytes(size // 4))
    elif client in ("tar", "sha256sum"):  # an ImageFolder tree: 1,500 files, 28 MiB
        make_dataset(d, 1500, 28 * MiB // 1500, jitter=0.5, seed=3)
    elif client == "reread":
        for i in range(40):
            (d / f"f{i:02}.bin").write_bytes(rng.randbytes(size // 40))


# --- clients --------------------------------------------------------------------------------


def run_preads(root: Path, epoch: int) -> tuple[int, int]:
    rng = random.Random(100 + epoch)
    paths = sorted((root / "preads").glob("*.bin"))
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        for _ in range(1000):
            i = rng.randrange(len(fds))
            os.pread(fds[i], 4096, rng.randrange(12 * MiB // 4096) * 4096)
    finally:
        for fd in fds:
            os.close(fd)
    return 1000 * 4096, 1000


def run_lmdb(root: Path, epoch: int) -> tuple[int, int]:
    import lmdb

    rng = random.Random(200 + epoch)
    env = lmdb.open(str(root / "lmdb"), readonly=True, lock=False, subdir=True)
    asked = 0
    try:
        n = env.stat()["entries"]
        with env.begin() as txn:
            for _ in range(2000):
                v = txn.get(b"%08d" % rng.randrange(n))
                asked += len(v) if v is not None else 0
    finally:
        env.close()
    return asked, 2000


def run_lmdbpages(root: Path, epoch: int) -> tuple[int, int]:
    """As training loaders open LMDB (no read-ahead: each page fault reads one page): 3,000
    random gets, then a full cursor scan. Client reads: one per get and per value scanned."""
    import lmdb

    rng = random.Random(250 + epoch)
    env = lmdb.open(
        str(root / "lmdbpages"), readonly=True, lock=False, readahead=False, subdir=True
    )
    asked = reads = 0
    try:
        n = env.stat()["entries"]
        with env.begin() as txn:
            for _ in range(3000):
                v = txn.get(b"%08d" % rng.randrange(n))
                asked += len(v) if v is not None else 0
            reads = 3000
            for _, v in txn.cursor():
                asked += len(v)
                reads += 1
    finally:
        env.close()
    return asked, reads


def run_h5py(root: Path, epoch: int) -> tuple[int, int]:
    import h5py

    rng = random.Random(300 + epoch)
    asked = 0
    with h5py.File(root / "h5py" / "data.h5", "r") as f:
        ds = f["x"]
        for _ in range(300):  # one random chunk (16 rows) each
            r = rng.randrange(ds.shape[0] // 16) * 16
            asked += ds[r : r + 16].nbytes
    return asked, 300


def run_memmap(root: Path, epoch: int) -> tuple[int, int]:
    import numpy as np

    rng = random.Random(400 + epoch)
    arr = np.load(root / "memmap" / "data.npy", mmap_mode="r")
    asked = 0
    for _ in range(1000):
        asked += int(np.asarray(arr[rng.randrange(arr.shape[0])]).sum() != -1) * arr.shape[1] * 4
    del arr
    return asked, 1000


def run_parquet(root: Path, epoch: int) -> tuple[int, int]:
    import pyarrow.parquet as pq

    asked = reads = 0
    for p in sorted((root / "parquet").glob("*.parquet")):
        asked += pq.read_table(p).nbytes
        reads += 1
    return asked, reads


def run_fio(root: Path, epoch: int) -> tuple[int, int]:
    d = root / "fio"
    names = ":".join(str(p) for p in sorted(d.glob("*.bin")))
    size = sum(p.stat().st_size for p in d.glob("*.bin"))
    common = ["fio", "--name=r", f"--filename={names}", "--readonly", "--ioengine=psync"]
    io = max(size // 10 // 4096 * 4096, 4096)
    subprocess.run(
        [*common, "--rw=randread", "--bs=4k", f"--io_size={io}", f"--randseed={epoch + 1}"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    subprocess.run([*common, "--rw=read", "--bs=1M"], check=True, stdout=subprocess.DEVNULL)
    return io + size, io // 4096 + -(-size // MiB)


def run_reread(root: Path, epoch: int) -> tuple[int, int]:
    paths = sorted((root / "reread").glob("*.bin"))
    random.Random(500 + epoch).shuffle(paths)
    return sum(len(p.read_bytes()) for p in paths), len(paths)


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def run_tar(root: Path, epoch: int) -> tuple[int, int]:
    """`tar cf - .` of the tree (into a pipe: tar skips reading files for /dev/null)."""
    d = root / "tar"
    out = subprocess.run(["tar", "cf", "-", "."], cwd=d, check=True, stdout=subprocess.PIPE)
    return len(out.stdout), len(_tree(d))


def run_sha256sum(root: Path, epoch: int) -> tuple[int, int]:
    d = root / "sha256sum"
    files = _tree(d)
    subprocess.run(["sha256sum", *files], cwd=d, check=True, stdout=subprocess.DEVNULL)
    return sum((d / f).stat().st_size for f in files), len(files)


RUNNERS: dict[str, Client] = {
    "preads": run_preads,
    "lmdb": run_lmdb,
    "lmdbpages": run_lmdbpages,
    "h5py": run_h5py,
    "memmap": run_memmap,
    "parquet": run_parquet,
    "fio": run_fio,
    "reread": run_reread,
    "tar": run_tar,
    "sha256sum": run_sha256sum,
}
PACKAGES = {
    "lmdb": "lmdb",
    "lmdbpages": "lmdb",
    "h5py": "h5py",
    "parquet": "pyarrow",
    "memmap": "numpy",
}


# --- the runs -------------------------------------------------------------------------------


class Epoch(NamedTuple):
    secs: float
    source_bytes: int
    calls: dict[str, int]  # source calls by type (the emulator's counters; {} locally)
    asked: int
    reads: int  # client reads (gets, rows, chunks, preads)
    served: int  # bytes the daemon served (-1: direct)
    daemon: dict[str, int]  # the daemon's counts (DAEMON; {} direct)
    cpu: float  # the daemon's CPU seconds during the epoch (-1: direct)


Counter = Callable[[], dict[str, int]]


def _epochs(
    client: str, root: Path, epochs: int, drop: list[Path], counter: Counter
) -> list[Epoch]:
    out = []
    shade = _is_shadefs(root)
    served = (lambda: int(stats(root)["bytes_served"])) if shade else (lambda: 0)
    pid = int(stats(root)["pid"]) if shade else None
    cpu = (lambda: process_cpu(pid) or 0.0) if pid is not None else (lambda: 0.0)
    for e in range(epochs):
        for d in drop:
            drop_page_cache(d)
        before, s0, c0 = counter(), served(), cpu()
        t0 = time.perf_counter()
        asked, reads = RUNNERS[client](root, e)
        secs = time.perf_counter() - t0
        spent = cpu() - c0 if shade else -1.0
        after = counter()
        diff = {k: after[k] - before.get(k, 0) for k in after}
        calls = {k: diff[k] for k in CALLS if k in diff}
        # The remote's own count over the emulator (the daemon's reads may be served by
        # the kernel's pages of the emulator's mount); the daemon's, over a local source.
        src_bytes = diff.get("bytes", diff.get("shadefs_bytes", 0))
        own = {k: diff[k] for k in DAEMON if k in diff}
        got = served() - s0 if shade else -1
        out.append(Epoch(secs, src_bytes, calls, asked, reads, got, own, spent))
    return out


def _is_shadefs(root: Path) -> bool:
    return (root / ".shadefs" / "stats.json").exists()


# The daemon's own counts (stats.json): FUSE reads, and how block-cached files were served.
DAEMON = ("fuse_reads", "piece_hits", "extent_hits", "range_loads", "hits", "source_loads")


def _fetched(mnt: Path, remote: Counter) -> Counter:
    """The source bytes and the reads as shadefs counts them, and the emulator's counters."""

    def count() -> dict[str, int]:
        s = stats(mnt)
        blocks = s.get("blocks") or {}
        own = {k: int(blocks.get(k, 0)) for k in DAEMON[1:]}
        own["fuse_reads"] = int(s.get("requests", {}).get("read", 0))
        return {**remote(), **own, "shadefs_bytes": int(s["bytes_from_source"])}

    return count


def _per_read(ep: Epoch) -> str:
    """Source calls per client read, by type (r reads, o opens, m metadata)."""
    if not ep.calls:
        return ""
    c, n = ep.calls, max(ep.reads, 1)
    meta = c.get("getattrs", 0) + c.get("lookups", 0) + c.get("readdirs", 0)
    total = sum(c.values())
    return (
        f"  calls/read {total / n:5.2f} (r {c.get('reads', 0) / n:.2f}"
        f" o {c.get('opens', 0) / n:.3f} m {meta / n:.3f})"
    )


def bench(client: str, args: argparse.Namespace, work: Path) -> None:
    src = work / "src"
    data = sum(p.stat().st_size for p in (src / client).rglob("*") if p.is_file())
    ram = 14 * MiB if client == "preads" else max(int(data * 0.3), 1 * MiB)
    for remote in args.remote:
        for _ in range(args.rounds):  # alternated: each round's ratios are to its direct run
            direct: list[Epoch] = []
            for setup in args.setups:
                res = _setup(client, remote, setup, args, work, ram)
                if setup == "direct":
                    direct = res
                _print(client, remote, setup, res, direct, data, ram)


def _setup(
    client: str, remote: str, setup: str, args: argparse.Namespace, work: Path, ram: int
) -> list[Epoch]:
    with _source(remote, work / "src", work) as (root, remote_counter):
        drop = [root] if remote == "slow" else []
        if setup == "direct":
            return _epochs(client, root, args.epochs, drop, remote_counter)
        opts = ["--ram", str(ram), *args.mount_opts.split()]
        if setup == "through":  # the same RAM, every file above --max-entry read through
            opts += ["--passthrough-above", "1"]
        if setup == "ssd":
            ssd = work / "ssd"
            shutil.rmtree(ssd, ignore_errors=True)
            opts += ["--ssd", f"{ssd}:{max(4 * args.data, 256 * MiB)}"]
        mnt = work / "mnt"
        with mounted(root, mnt, *opts):
            res = _epochs(client, mnt, args.epochs, drop, _fetched(mnt, remote_counter))
            if setup == "ssd":  # let the write-behind land before unmounting
                time.sleep(0.5)
        return res


def _print(
    client: str, remote: str, setup: str, res: list[Epoch], direct: list[Epoch], data: int, ram: int
) -> None:
    for e, ep in enumerate(res):
        ref = direct[e].secs if e < len(direct) else float("nan")
        print(
            f"{client:9} {remote:5} {setup:6} epoch {e + 1}: {ep.secs:7.2f} s"
            f"  x{ep.secs / ref:5.2f} direct  source {ep.source_bytes / MiB:8.1f} MiB"
            f"  asked {ep.asked / MiB:7.1f} MiB"
            + (f"  served {ep.served / MiB:7.1f} MiB" if ep.served >= 0 else "")
            + _per_read(ep)
            + f"  (data {data / MiB:.0f} MiB, RAM {ram / MiB:.0f} MiB)",
            flush=True,
        )
        if ep.daemon:
            per = ep.cpu / max(ep.reads, 1) * 1e6
            print(
                "    daemon: "
                + ", ".join(f"{k} {v}" for k, v in ep.daemon.items())
                + f"; CPU {ep.cpu:.2f} s ({per:.0f} µs per client read)"
            )


class _source:
    """The source root for a remote kind: the local tree, or the emulator mounted over it."""

    def __init__(self, remote: str, src: Path, work: Path) -> None:
        self.remote, self.src, self.work = remote, src, work
        self._cm = None

    def __enter__(self) -> tuple[Path, Counter]:
        if self.remote == "local":
            return self.src, dict
        # Page-cached, so that mmap clients (lmdb, np.memmap) can map its files.
        self._cm = slowfs_mounted(self.src, self.work / "remote", ["--no-direct-io"])
        mnt, _ = self._cm.__enter__()  # type: ignore[attr-defined]
        return mnt, lambda: {k: int(v) for k, v in slowfs_stats(mnt).items() if k in _COUNTED}

    def __exit__(self, *exc: object) -> None:
        if self._cm is not None:
            self._cm.__exit__(*exc)  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--remote", default="local,slow")
    ap.add_argument("--setups", default="direct,ram,ssd")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--data", type=parse_size, default=40 * MiB)
    ap.add_argument("--rounds", type=int, default=1, help="direct and shadefs alternated")
    ap.add_argument("--mount-opts", default="", help="more shadefs mount options")
    args = ap.parse_args()
    args.remote = args.remote.split(",")
    args.setups = args.setups.split(",")
    clients = []
    for c in args.clients.split(","):
        if c not in RUNNERS:
            sys.exit(f"unknown client {c!r}; known: {', '.join(CLIENTS)}")
        pkg = PACKAGES.get(c)
        if pkg is not None and not _have(pkg):
            print(f"skipping {c}: the {pkg} package is not installed")
            continue
        if c == "fio" and shutil.which("fio") is None:
            print("skipping fio: the fio command is not installed (apt-get install fio)")
            continue
        clients.append(c)
    with tempfile.TemporaryDirectory(prefix="bench-clients-") as tmp:
        work = Path(tmp)
        for c in clients:
            make_data(work / "src", c, args.data)
        for c in clients:
            bench(c, args, work)


if __name__ == "__main__":
    main()
