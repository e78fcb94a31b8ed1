"""Four training jobs on one mount over the emulated slow remote, end to end.

    python tools/bench/bench_jobs_e2e.py [--images 2000] [--file-kb 110] [--jobs 4]
                                         [--epochs 3] [--workers 2] [--ram-fraction 0.2]

The jobs are unchanged torchvision code (ImageFolder, RandomSampler with its own seed,
DataLoader with worker processes, the tiny CNN of bench_e2e.py), each in its own process,
all started together. Three configurations:

- `alone`: one job over a shadefs mount of the remote;
- `shared`: `jobs` jobs over one shadefs mount of the remote (the sweep setting);
- `remote`: `jobs` jobs reading the remote directly.

It reports each job's epoch times, the shadefs hit ratio, and the bytes the remote
delivered per epoch as a multiple of the dataset. The remote is emulated
(python -m shadefs.demo.slowfs: per-open latency and a bandwidth cap in front of a local
tree), so the figures depend on its settings; on a machine with few cores the jobs are
CPU-bound on JPEG decoding, and the epoch times say more about the CPU than the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchlib import mounted, slowfs_mounted, slowfs_stats, stats
from e2e_workload import DatasetSpec, build_dataset


def train(root: Path, epochs: int, seed: int, workers: int, gate: Path, out: Path) -> None:
    """One unchanged training job; writes its epoch times to `out`."""
    import torch
    import torch.nn.functional as F
    from e2e_workload import make_transform, tiny_model, worker_init
    from torch.utils.data import DataLoader, RandomSampler
    from torchvision.datasets import ImageFolder

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    data = ImageFolder(str(root), transform=make_transform())
    model = tiny_model(len(data.classes))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    sampler = RandomSampler(data, generator=torch.Generator().manual_seed(seed))
    loader = DataLoader(
        data,
        batch_size=64,
        sampler=sampler,
        num_workers=workers,
        persistent_workers=workers > 0,
        worker_init_fn=worker_init,
    )
    (gate.parent / f"ready-{os.getpid()}").touch()
    while not gate.exists():
        time.sleep(0.01)
    times = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - t0)
    out.write_text(json.dumps({"pid": os.getpid(), "epochs": times}))


def run_jobs(root: Path, tmp: Path, tag: str, jobs: int, args: argparse.Namespace) -> list[dict]:
    gates = tmp / f"gates-{tag}"
    gates.mkdir()
    outs = [gates / f"job{i}.json" for i in range(jobs)]
    procs = []
    for i, out in enumerate(outs):
        cmd = [sys.executable, __file__, "--train", str(root), str(args.epochs), str(10 + i)]
        cmd += [str(args.workers), str(gates / "go"), str(out)]
        procs.append(subprocess.Popen(cmd))
    while len(list(gates.glob("ready-*"))) < jobs:
        if any(p.poll() not in (None, 0) for p in procs):
            raise SystemExit("a training job failed to start")
        time.sleep(0.05)
    (gates / "go").touch()
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a training job failed with {p.returncode}")
    return [json.loads(out.read_text()) for out in outs]


def report(tag: str, results: list[dict], remote_bytes: int, total: int, epochs: int) -> None:
    for r in results:
        times = " ".join(f"{t:.1f}" for t in r["epochs"])
        print(f"  {tag:>6} job {r['pid']}: epoch seconds {times}")
    steady = [t for r in results for t in r["epochs"][1:]] or [
        t for r in results for t in r["epochs"]
    ]
    print(
        f"  {tag:>6}: mean epoch (2..{epochs}) {sum(steady) / len(steady):.1f} s per job, "
        f"remote bytes per epoch {remote_bytes / total / epochs:.2f}x the dataset"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--train":
        root, epochs, seed, workers, gate, out = sys.argv[2:8]
        train(Path(root), int(epochs), int(seed), int(workers), Path(gate), Path(out))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--file-kb", type=float, default=110.0)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--ram-fraction", type=float, default=0.2)
    ap.add_argument("--open-latency", type=float, default=5.0, metavar="MS")
    ap.add_argument("--bandwidth", type=float, default=100.0, metavar="MB/S")
    ap.add_argument("--configs", default="alone,shared,remote")
    ap.add_argument(
        "--workdir",
        type=Path,
        default=Path(os.environ.get("SHADEFS_BENCH_DIR", "/var/tmp/shadefs-bench-e2e")),
    )
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    spec = DatasetSpec(
        images=args.images,
        classes=args.classes,
        width=500,
        height=375,
        quality=90,
        target_bytes=int(args.file_kb * 1000),
        seed=0,
    )
    data, manifest = build_dataset(spec, args.workdir, max(1, os.cpu_count() or 1))
    total = int(manifest["bytes"])
    ram = int(total * args.ram_fraction)
    opts = ["--open-latency", f"{args.open_latency:g}", "--bandwidth", f"{args.bandwidth:g}"]
    print(
        f"{args.images} JPEGs, {total / 1e6:.1f} MB; remote: slowfs open {args.open_latency:g} "
        f"ms, {args.bandwidth:g} MB/s; RAM {args.ram_fraction:.0%}; {args.epochs} epochs, "
        f"{args.workers} loader workers per job; {os.cpu_count()} CPUs"
    )
    tmp = args.workdir / f"jobs-{os.getpid()}"
    tmp.mkdir()
    configs = args.configs.split(",")
    for tag in ("alone", "shared", "remote"):
        if tag not in configs:
            continue
        jobs = 1 if tag == "alone" else args.jobs
        with slowfs_mounted(data, tmp / f"remote-{tag}", opts) as (remote, _):
            before = int(slowfs_stats(remote)["bytes"])
            if tag == "remote":
                results = run_jobs(remote, tmp, tag, jobs, args)
                extra = ""
            else:
                with mounted(remote, tmp / f"shade-{tag}", "--ram", str(ram)) as m:
                    results = run_jobs(m, tmp, tag, jobs, args)
                    s = stats(m)
                extra = f", shadefs hit ratio {s['hit_ratio']:.3f}"
            fetched = int(slowfs_stats(remote)["bytes"]) - before
        print(f"{tag}: {jobs} job(s){extra}")
        report(tag, results, fetched, total, args.epochs)


if __name__ == "__main__":
    main()
