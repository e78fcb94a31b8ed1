"""Real random-access clients through the mount: time against direct, source bytes against asked.

    python tools/bench/bench_clients.py [--clients preads,lmdb,h5py,memmap,parquet,fio]
        [--remote local,slow] [--setups direct,ram,ssd] [--epochs 2] [--data 40M]

Clients (each reads a dataset of about `--data` bytes, written once into a temp source):

- preads: 1,000 random 4 KiB preads over 4 x 12 MiB files held open (the issue's case,
  with `--ram 14M` rather than a fraction of the data);
- lmdb: random gets of 4 KiB values (`lmdb`, readonly, lock=False);
- h5py: random 16-row slices of a chunked 2-D float32 dataset;
- memmap: random 4 KiB rows of a `.npy` through `np.load(mmap_mode="r")`;
- parquet: `pq.read_table` of 4 files (footer first, then the column chunks, reopened);
- fio: random 4k reads (`--io_size` a tenth of the data), then a sequential 1M read;
- reread: 40 files read whole in a shuffled order each epoch, as a training loop does:
  from epoch 2 the kernel holds the pages of the files that RAM evicted (fs/deferred.py).

A client whose package (or `fio`) is missing is skipped with a printed line. Setups, each
over a local source (files in the page cache) and over the slow-remote emulator
(`shadefs.demo.slowfs`, defaults: 100 MB/s, 5 ms per open):

- direct: the client reads the source (the local tree or the emulator's mount);
- ram: shadefs with RAM 30% of the data (the preads case: 14M);
- ssd: the same RAM plus an SSD tier that holds the data.

Before each epoch the kernel's pages of the emulator's mount are dropped (fadvise; it opens
its files without keep_cache anyway), so that direct reads reach the "remote". The mount's
own pages are left alone: opening every file to drop them would be an open of each through
shadefs, and shadefs keeps the kernel's pages only of files it holds. Printed per
epoch: seconds, the ratio to direct's same epoch, MiB from the source (shadefs's
bytes_from_source; direct over the emulator: its bytes read), and MiB the client asked for.
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

from benchlib import drop_page_cache, mounted, slowfs_mounted, slowfs_stats, stats

from shadefs.common import parse_size

MiB = 1 << 20
CLIENTS = ("preads", "lmdb", "h5py", "memmap", "parquet", "fio", "reread")
Client = Callable[[Path, int], int]  # (root, epoch) -> bytes asked


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
    elif client == "reread":
        for i in range(40):
            (d / f"f{i:02}.bin").write_bytes(rng.randbytes(size // 40))


# --- clients --------------------------------------------------------------------------------


def run_preads(root: Path, epoch: int) -> int:
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
    return 1000 * 4096


def run_lmdb(root: Path, epoch: int) -> int:
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
    return asked


def run_h5py(root: Path, epoch: int) -> int:
    import h5py

    rng = random.Random(300 + epoch)
    asked = 0
    with h5py.File(root / "h5py" / "data.h5", "r") as f:
        ds = f["x"]
        for _ in range(300):
            r = rng.randrange(ds.shape[0] - 16)
            asked += ds[r : r + 16].nbytes
    return asked


def run_memmap(root: Path, epoch: int) -> int:
    import numpy as np

    rng = random.Random(400 + epoch)
    arr = np.load(root / "memmap" / "data.npy", mmap_mode="r")
    asked = 0
    for _ in range(1000):
        asked += int(np.asarray(arr[rng.randrange(arr.shape[0])]).sum() != -1) * arr.shape[1] * 4
    del arr
    return asked


def run_parquet(root: Path, epoch: int) -> int:
    import pyarrow.parquet as pq

    asked = 0
    for p in sorted((root / "parquet").glob("*.parquet")):
        asked += pq.read_table(p).nbytes
    return asked


def run_fio(root: Path, epoch: int) -> int:
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
    return io + size


def run_reread(root: Path, epoch: int) -> int:
    paths = sorted((root / "reread").glob("*.bin"))
    random.Random(500 + epoch).shuffle(paths)
    return sum(len(p.read_bytes()) for p in paths)


RUNNERS: dict[str, Client] = {
    "preads": run_preads,
    "lmdb": run_lmdb,
    "h5py": run_h5py,
    "memmap": run_memmap,
    "parquet": run_parquet,
    "fio": run_fio,
    "reread": run_reread,
}
PACKAGES = {"lmdb": "lmdb", "h5py": "h5py", "parquet": "pyarrow", "memmap": "numpy"}


# --- the runs -------------------------------------------------------------------------------


def _epochs(
    client: str, root: Path, epochs: int, drop: list[Path], counter: Callable[[], int]
) -> list[tuple[float, int, int, int]]:
    """Per epoch: seconds, source bytes, bytes asked, bytes the daemon served (-1: none)."""
    out = []
    served = (lambda: int(stats(root)["bytes_served"])) if _is_shadefs(root) else (lambda: 0)
    for e in range(epochs):
        for d in drop:
            drop_page_cache(d)
        before, s0 = counter(), served()
        t0 = time.perf_counter()
        asked = RUNNERS[client](root, e)
        secs = time.perf_counter() - t0
        out.append((secs, counter() - before, asked, served() - s0 if _is_shadefs(root) else -1))
    return out


def _is_shadefs(root: Path) -> bool:
    return (root / ".shadefs" / "stats.json").exists()


def _fetched(mnt: Path) -> Callable[[], int]:
    return lambda: int(stats(mnt)["bytes_from_source"])


def bench(client: str, args: argparse.Namespace, work: Path) -> None:
    src = work / "src"
    size = args.data
    data = sum(p.stat().st_size for p in (src / client).rglob("*") if p.is_file())
    ram = 14 * MiB if client == "preads" else max(int(data * 0.3), 1 * MiB)
    for remote in args.remote:
        direct: list[tuple[float, int, int, int]] = []
        for setup in args.setups:
            with _source(remote, src, work) as (root, remote_counter):
                drop = [root] if remote == "slow" else []
                if setup == "direct":
                    counter = remote_counter if remote == "slow" else (lambda: 0)
                    res = _epochs(client, root, args.epochs, drop, counter)
                    direct = res
                else:
                    opts = ["--ram", str(ram)]
                    if setup == "ssd":
                        ssd = work / "ssd"
                        shutil.rmtree(ssd, ignore_errors=True)
                        opts += ["--ssd", f"{ssd}:{max(4 * size, 256 * MiB)}"]
                    mnt = work / "mnt"
                    with mounted(root, mnt, *opts):
                        res = _epochs(client, mnt, args.epochs, drop, _fetched(mnt))
                        if setup == "ssd":  # let the write-behind land before unmounting
                            time.sleep(0.5)
            for e, (secs, src_bytes, asked, served) in enumerate(res):
                ref = direct[e][0] if e < len(direct) else float("nan")
                print(
                    f"{client:8} {remote:5} {setup:6} epoch {e + 1}: {secs:7.2f} s"
                    f"  x{secs / ref:5.2f} direct  source {src_bytes / MiB:8.1f} MiB"
                    f"  asked {asked / MiB:7.1f} MiB"
                    + (f"  served {served / MiB:7.1f} MiB" if served >= 0 else "")
                    + f"  (data {data / MiB:.0f} MiB, RAM {ram / MiB:.0f} MiB)",
                    flush=True,
                )


class _source:
    """The source root for a remote kind: the local tree, or the emulator mounted over it."""

    def __init__(self, remote: str, src: Path, work: Path) -> None:
        self.remote, self.src, self.work = remote, src, work
        self._cm = None

    def __enter__(self) -> tuple[Path, Callable[[], int]]:
        if self.remote == "local":
            return self.src, lambda: 0
        # Page-cached, so that mmap clients (lmdb, np.memmap) can map its files.
        self._cm = slowfs_mounted(self.src, self.work / "remote", ["--no-direct-io"])
        mnt, _ = self._cm.__enter__()  # type: ignore[attr-defined]
        return mnt, lambda: int(slowfs_stats(mnt)["bytes"])

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
