"""Several nodes, one job: partitioned caching with locality-aware shares against N
independent caches, through N shadefs mounts over one emulated slow remote.

    python tools/bench/bench_nodes.py [--nodes 2] [--ranks-per-node 1] [--files 2000]
        [--size 20000] [--fraction 0.2] [--epochs 4] [--replay 1] [--loader-workers K]
        [--no-prefetch] [--partitioned-only] [--verbose] [--keep-stats DIR]
    python tools/bench/bench_nodes.py --order-only [--samples 1281167] [--nodes 8] [--gloo]
        [--mount DIR]

Each "node" is a shadefs mount (policy `shade` unless --policy, RAM for `fraction` of the
bytes) over one slow-remote emulator (``python -m shadefs.demo.slowfs``: per-open latency
and one shared bandwidth cap); the ranks are processes of a gloo world
(torch.multiprocessing), each reading through its node's mount with ShadeSampler and
reporting per-sample losses (a fixed synthetic difficulty per sample); with
``--loader-workers K`` a rank reads its share through a DataLoader with K workers, as a
training job does. The mounts prefetch, as a new user's do (``--no-prefetch``: not). Before
the job, node
k reads the k-th 1/N of the data, so the caches start out holding different files. Two runs
over fresh mounts:

- ``partitioned``: this version (one global order from every node's residency, owners by
  rendezvous hash, each rank's share led by its node's cached samples);
- ``independent``: the same job with the multi-node step switched off, which is what the
  ranks did before: one order, DistributedSampler-style strides, every node caching
  whatever it reads.

Reported per run: the aggregate hit ratio per epoch (all mounts' hits over all opens) and
over epochs 2..E; the bytes the remote delivered per epoch (in datasets) against the bound
(1 - aggregate hit) x data, which a node that fetched anything beyond its own ranks' misses
would pass; per node, the prefetcher's opens served / files fetched (stats.json
``prefetch``); a check that every node installed one global order, names the same shares
for every rank and lost no entry of it; and epoch times (the slowest rank; 2-core machines
are CPU-bound, so compare the two runs, not absolute times). ``--verbose`` adds every
node's counters per epoch.

``--order-only`` instead times what one epoch's multi-node order costs at ImageNet scale,
in process: packing every node's residency bitmap, the pickling an all-gather does,
encoding the daemon message, unpacking it, building the global order from the union,
ownership and every rank's share; with ``--gloo`` also the all-gather of the bitmaps and
the broadcast of the order over a gloo world of one process per node on this machine;
with ``--mount DIR`` also the daemon's side over FUSE (a mount of N tiny files, the residency
request, rank 0's build, another node's install of the order it broadcasts).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import make_dataset, mounted, slowfs_mounted, slowfs_stats, stats


def order_only(n: int, nodes: int, ranks_per_node: int, repeats: int) -> None:
    from shadefs.sampling import pads, placement, wire, wire_nodes

    if ranks_per_node < 1 or nodes < 1:
        raise SystemExit("need at least one node and one rank per node")

    rng = np.random.default_rng(0)
    scores = rng.random(n)
    world = nodes * ranks_per_node
    ids = tuple(placement.node_id(f"node{k}", "/mnt/shade") for k in range(nodes))
    t0 = time.perf_counter()
    owner = placement.owners(ids, n)
    first_owners = time.perf_counter() - t0
    holds = [(owner == k) & (rng.random(n) < 0.2 * nodes) for k in range(nodes)]
    rank_node = np.repeat(np.arange(nodes), ranks_per_node)
    phases: dict[str, list[float]] = {}

    def timed(name: str, t: float) -> float:
        now = time.perf_counter()
        phases.setdefault(name, []).append(now - t)
        return now

    keys = rng.permutation(n * 2)[:n].astype(np.uint64)  # cache keys are inode numbers
    cached = keys[holds[0]]
    for epoch in range(repeats):
        t = time.perf_counter()
        np.packbits(np.isin(keys, cached))  # the daemon's Service.resident_bitmap
        t = timed("residency bitmap in one daemon", t)
        bitmaps = [wire_nodes.encode_resident(h)[16:] for h in holds]
        t = timed("pack bitmaps (every node's, in one process)", t)
        gathered = pickle.loads(pickle.dumps(bitmaps))  # what all_gather_object does
        t = timed("all-gather pickling", t)
        msg = wire_nodes.encode_node_order(epoch, 1, 0, ids, rank_node, gathered, n)
        node = wire_nodes.decode_node_order(msg, n)
        t = timed("daemon message encode + decode", t)
        params = pads.OrderParams(epoch=epoch, seed=1, world_size=world, rank=0, replay=1.0)
        order = pads.build_global_order(scores, np.any(node.resident, axis=0), params)
        t = timed("global order from the union (rank 0)", t)
        response = wire.encode_order_response(epoch, order)
        wire.decode_order_response(response, n)
        box = pickle.loads(pickle.dumps([order]))  # what broadcast_object_list does
        t = timed("order response + broadcast pickling", t)
        shares = placement.locality_shares(box[0], node.resident, node.rank_node, owner)
        t = timed("ownership + every rank's share (per node)", t)
        assert sum(len(s) for s in shares) >= n
    total = 0.0
    print(f"multi-node order, N={n}, {nodes} nodes x {ranks_per_node} ranks, replay 1:")
    for name, times in phases.items():
        med = statistics.median(times)
        total += med
        print(f"  {name:<45} {med * 1e3:8.1f} ms")
    print(f"  {'total per epoch (median of ' + str(repeats) + ')':<45} {total * 1e3:8.1f} ms")
    print(f"  (first epoch only: ownership hash {first_owners * 1e3:.0f} ms, then cached)")
    print(f"  bitmap per node {wire_nodes.bitmap_bytes(n) / 1e3:.0f} kB; goal < 1 s")


def order_through_mount(n: int, nodes: int, ranks_per_node: int, repeats: int, root: Path) -> None:
    """The daemon's side of the step over FUSE, as the sampler drives it: the residency
    request, rank 0's build (order + shares), and another node's install of that order."""
    from bench_namespace import build_tree

    from shadefs.sampling import placement, wire, wire_nodes
    from shadefs.torch.client import ControlClient

    src = root / f"{n}x200" / "src"
    rels = build_tree(root / f"{n}x200", n, 200)
    rng = np.random.default_rng(0)
    ids = tuple(placement.node_id(f"node{k}", "/mnt/shade") for k in range(nodes))
    rank_node = np.repeat(np.arange(nodes), ranks_per_node)
    holds = [wire_nodes.encode_resident(rng.random(n) < 0.2)[16:] for _ in range(nodes)]
    phases: dict[str, list[float]] = {}
    mnt = root / "mnt-nodes"
    mnt.mkdir(exist_ok=True)
    with mounted(src, mnt, "--ram", "64M", "--log", "none"):
        client = ControlClient(mnt)
        client.register(wire.encode_dataset(rels))
        for epoch in range(repeats):
            t = time.perf_counter()
            raw = client.order(wire_nodes.encode_resident_request(n))
            holds[0] = wire_nodes.decode_resident(raw, n)
            phases.setdefault("residency request (node 0's daemon)", []).append(
                time.perf_counter() - t
            )
            t = time.perf_counter()
            msg = wire_nodes.encode_node_order(epoch, 1, 0, ids, rank_node, holds, n)
            order = wire.decode_order_response(client.order(msg), n)[1]
            phases.setdefault("rank 0: build the order and its node's shares", []).append(
                time.perf_counter() - t
            )
            t = time.perf_counter()
            msg = wire_nodes.encode_node_order(epoch, 1, 1, ids, rank_node, holds, n, order)
            client.order(msg)
            phases.setdefault("another node: install that order", []).append(
                time.perf_counter() - t
            )
    print(f"through a mount, N={n} registered, {nodes} nodes x {ranks_per_node} ranks:")
    for name, times in phases.items():
        print(f"  {name:<45} {statistics.median(times) * 1e3:8.1f} ms")


def _gloo_main(rank: int, world: int, n: int, repeats: int, rdv: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world)
    try:
        rng = np.random.default_rng(rank)
        bitmap = np.packbits(rng.random(n) < 0.2).tobytes()
        order = rng.permutation(n).astype(np.int32) if rank == 0 else None  # as the sampler
        gather, bcast = [], []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            got: list[Any] = [None] * world
            dist.all_gather_object(got, bitmap)
            t1 = time.perf_counter()
            box = [order]
            dist.broadcast_object_list(box, src=0)
            t2 = time.perf_counter()
            gather.append(t1 - t0)
            bcast.append(t2 - t1)
        if rank == world - 1:
            Path(out).write_text(json.dumps([gather, bcast]))
    finally:
        dist.destroy_process_group()


def gloo_collectives(n: int, world: int, repeats: int) -> None:
    """The two collectives of the step over a real gloo world on this machine (loopback)."""
    import torch.multiprocessing as tmp_mp

    with tempfile.TemporaryDirectory() as tmpdir:
        out = os.path.join(tmpdir, "times.json")
        rdv = os.path.join(tmpdir, "rdv")
        tmp_mp.spawn(_gloo_main, args=(world, n, repeats, rdv, out), nprocs=world, join=True)
        gather, bcast = json.loads(Path(out).read_text())
    print(
        f"gloo over loopback, {world} processes: all-gather of the bitmaps "
        f"{statistics.median(gather) * 1e3:.1f} ms, broadcast of the order "
        f"(int32, {4 * n / 1e6:.0f} MB) {statistics.median(bcast) * 1e3:.1f} ms "
        f"(medians of {repeats})"
    )


# --- the mounted job ------------------------------------------------------------------------


def _node_counters(mnt: str) -> dict[str, int]:
    """The counters of one node's stats.json that the report reads (cumulative)."""
    doc = stats(Path(mnt))
    pf = doc.get("prefetch") or {}
    keys = ("hits", "misses", "bytes_from_source", "source_fetches", "refetches", "refused")
    out = {k: int(doc.get(k, 0)) for k in keys}
    out.update({f"prefetch_{k}": int(v) for k, v in pf.items() if isinstance(v, int)})
    return out


def _read(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        # As a dataset larger than the page cache: the daemon sees the miss.
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        f.read()


def _read_batch(paths: list[str], idx: list[int]) -> np.ndarray:
    for i in idx:
        _read(paths[i])
    return np.asarray(idx)


class _Files:
    """A map-style dataset of the files (a DataLoader's workers read them): the index."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> int:
        _read(self.paths[i])
        return i


def _rank_main(rank: int, world: int, cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import shadefs.torch.sampler as sampler_mod
    from shadefs.torch import ShadeSampler

    installed: list[Any] = [None]  # the global order this rank's daemon installed
    if not cfg["partitioned"]:
        sampler_mod.install_epoch = lambda *a, **k: None  # type: ignore[assignment]
    else:
        install = sampler_mod.install_epoch

        def keep(*a: Any, **k: Any) -> Any:
            installed[0] = install(*a, **k)
            return installed[0]

        sampler_mod.install_epoch = keep  # type: ignore[assignment]
    dist.init_process_group("gloo", init_method=f"file://{cfg['rdv']}", rank=rank, world_size=world)
    try:
        node = rank // cfg["ranks_per_node"]
        mnt = cfg["mounts"][node]
        paths = [os.path.join(mnt, r) for r in cfg["rels"]]
        sampler = ShadeSampler(paths, mountpoint=mnt, seed=1, replay=cfg["replay"])
        times = []
        for epoch in range(cfg["epochs"]):
            sampler.set_epoch(epoch)
            installed[0] = None
            order = list(sampler)
            # Every rank's share, every sender's global order and what its daemon hands
            # out for every rank (as tests/test_nodes_mount.py asks), for rank 0 to check.
            named = None
            if cfg["partitioned"]:
                named = [sampler.order(epoch, r).tolist() for r in range(world)]
            views: list[Any] = [None] * world
            dist.all_gather_object(views, (order, installed[0], named))
            dist.barrier()
            t0 = time.perf_counter()
            if cfg["workers"]:
                # As a training job reads: DataLoader workers, each a batch ahead, their
                # opens out of order around the sampler's position.
                loader = DataLoader(_Files(paths), batch_size=32, sampler=order,
                                    num_workers=cfg["workers"])  # fmt: skip
                batches: Any = (np.asarray(b) for b in loader)
            else:
                batches = (
                    _read_batch(paths, order[start : start + 32])
                    for start in range(0, len(order), 32)
                )
            for idx in batches:
                loss = ((idx * 7919) % 101 / 10.0).astype(np.float32)
                sampler.record(torch.from_numpy(loss))
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(float(elapsed))
            sampler.report(train_loss=1.0 / (epoch + 1))
            dist.barrier()
            if rank == 0:
                snap = [_node_counters(m) for m in cfg["mounts"]]
                remote = slowfs_stats(Path(cfg["remote"]))
                shares = [v[0] for v in views]
                globals_ = [np.asarray(v[1]) for v in views if v[1] is not None]
                named = [v[2] for v in views if v[2] is not None]
                row = {
                    "epoch": epoch,
                    "seconds": times[-1],
                    "nodes": snap,
                    "remote": remote["bytes"],
                    "entries": sum(len(s) for s in shares),
                    "check": _check_order(shares, globals_, named) if cfg["partitioned"] else "",
                }
                with open(cfg["log"], "a") as out:
                    out.write(json.dumps(row) + "\n")
            dist.barrier()
        sampler.close()
    finally:
        dist.destroy_process_group()


def _check_order(
    shares: list[list[int]], orders: list[np.ndarray], named: list[list[list[int]]]
) -> str:
    """Whether every node installed one global order, every node's daemon names the
    shares the ranks trained, and those hold each entry of the order (DistributedSampler's
    padding aside): "ok", else what is wrong."""
    if not orders or any(not np.array_equal(o, orders[0]) for o in orders):
        return "the nodes installed different global orders"
    if any(view != shares for view in named):
        return "the nodes' daemons name different shares"
    order = orders[0]
    got = np.bincount(np.concatenate([np.asarray(s, dtype=np.int64) for s in shares]))
    want = np.bincount(order, minlength=len(got))
    got = np.pad(got, (0, max(0, len(want) - len(got))))
    lost = int(np.clip(want - got, 0, None).sum())
    extra = int(np.clip(got - want, 0, None).sum())
    padding = sum(len(s) for s in shares) - len(order)
    if lost or extra != padding:
        return f"{lost} entries of the global order lost, {extra - padding} extra"
    return "ok"


def run_job(args: argparse.Namespace, tmp: Path, remote: Path, rels: list[str], ram: int,
            partitioned: bool) -> list[dict[str, Any]]:  # fmt: skip
    import torch.multiprocessing as tmp_mp

    tag = "partitioned" if partitioned else "independent"
    mounts = [tmp / f"{tag}-node{k}" for k in range(args.nodes)]
    log = tmp / f"{tag}.log"
    opts = ["--ram", str(ram), "--policy", args.policy]
    if not args.prefetch:
        opts.append("--no-prefetch")
    with contextlib.ExitStack() as stack:
        for m in mounts:
            stack.enter_context(mounted(remote, m, *opts))
        # Node k first reads part k: the caches start out holding different files.
        for k, m in enumerate(mounts):
            part = rels[k * len(rels) // args.nodes : (k + 1) * len(rels) // args.nodes]
            for rel in part:
                (m / rel).read_bytes()
        base = [_node_counters(str(m)) for m in mounts]
        remote0 = slowfs_stats(remote)["bytes"]
        cfg = {
            "partitioned": partitioned,
            "rdv": str(tmp / f"{tag}.rdv"),
            "mounts": [str(m) for m in mounts],
            "remote": str(remote),
            "rels": rels,
            "ranks_per_node": args.ranks_per_node,
            "replay": args.replay,
            "epochs": args.epochs,
            "workers": args.loader_workers,
            "log": str(log),
        }
        world = args.nodes * args.ranks_per_node
        tmp_mp.spawn(_rank_main, args=(world, cfg), nprocs=world, join=True)
        if args.keep_stats:
            for k, m in enumerate(mounts):
                (args.keep_stats / f"{tag}-node{k}.json").write_text(json.dumps(stats(m)))
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    # Per-epoch deltas from the cumulative counters.
    out = []
    prev, prev_bytes = base, remote0
    for row in rows:
        delta = [
            {k: v - p.get(k, 0) for k, v in now.items()}
            for now, p in zip(row["nodes"], prev, strict=True)
        ]
        out.append({**row, "nodes": delta, "remote": row["remote"] - prev_bytes})
        prev, prev_bytes = row["nodes"], row["remote"]
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def report(
    tag: str, rows: list[dict[str, Any]], total: int, epochs: int, verbose: bool = False
) -> dict[str, float]:
    """Print one run's figures; returns its steady-state ones (epochs 2..E)."""
    hit, moved, bound, seconds = [], [], [], []
    for row in rows:
        nodes = row["nodes"]
        hits = sum(n["hits"] for n in nodes)
        opens = sum(n["hits"] + n["misses"] for n in nodes)
        hit.append(_ratio(hits, opens))
        moved.append(row["remote"] / total)
        bound.append(1.0 - hit[-1])  # (1 - aggregate hit) x data, in datasets
        seconds.append(row["seconds"])
    steady = slice(1, None) if len(rows) > 1 else slice(None)
    worst = max(_ratio(m, b) for m, b in zip(moved[steady], bound[steady], strict=True))
    print(
        f"{tag:>12}: aggregate hit ratio epochs 2-{epochs} {statistics.mean(hit[steady]):.3f}"
        "  per epoch " + " ".join(f"{r:.3f}" for r in hit)
    )
    print(
        "              remote bytes per epoch (datasets) "
        + " ".join(f"{m:.3f}" for m in moved)
        + "\n              bound (1 - aggregate hit) x data "
        + " ".join(f"{b:.3f}" for b in bound)
        + f"\n              remote / bound, worst of epochs 2-{epochs}: {worst:.3f}"
    )
    served_ratio = []
    for k in range(len(rows[0]["nodes"])):
        per = [(r["nodes"][k].get("prefetch_served", 0), r["nodes"][k].get("prefetch_fetched", 0))
               for r in rows]  # fmt: skip
        s = sum(sv for sv, _ in per[steady])
        f = sum(fv for _, fv in per[steady])
        served_ratio.append(_ratio(s, f))
        wasted = sum(
            r["nodes"][k].get("prefetch_wasted", 0) + r["nodes"][k].get("prefetch_unused", 0)
            for r in rows[steady]
        )
        print(
            f"              node {k}: prefetch served/fetched per epoch "
            + " ".join(f"{sv}/{fv}" for sv, fv in per)
            + f"; epochs 2-{epochs} {s}/{f} = {served_ratio[-1]:.3f}, dropped unread {wasted}"
        )
        # Files from the source against this node's misses: above 1, the node fetched what
        # its ranks did not read, or a file twice (hits count opens and the bound bytes, so
        # remote / bound also moves with which sizes hit).
        fetches = sum(r["nodes"][k]["source_fetches"] for r in rows[steady])
        misses = sum(r["nodes"][k]["misses"] for r in rows[steady])
        print(
            f"              node {k}: source fetches / misses, epochs 2-{epochs} "
            f"{fetches}/{misses} = {_ratio(fetches, misses):.3f}, refetches "
            f"{sum(r['nodes'][k]['refetches'] for r in rows[steady])}"
        )
    checks = {r["check"] for r in rows}
    if checks != {""}:
        bad = [f"epoch {r['epoch'] + 1}: {r['check']}" for r in rows if r["check"] != "ok"]
        print(
            "              global order: "
            + ("the same on every node, no entry lost" if not bad else "; ".join(bad))
        )
    print("              epoch time s (slowest rank) " + " ".join(f"{s:.1f}" for s in seconds))
    if verbose:
        for row in rows:
            for k, node in enumerate(row["nodes"]):
                moved_ = {c: v for c, v in node.items() if v}
                print(f"              epoch {row['epoch'] + 1} node {k}: {moved_}")
    return {
        "hit": statistics.mean(hit[steady]),
        "remote_over_bound": worst,
        "served_over_fetched": min(served_ratio),
        "order_ok": float(all(r["check"] == "ok" for r in rows)),
    }


def targets(got: dict[str, float], prefetch: bool, bound: float) -> None:
    """The partitioned run against issue 39's targets, epochs 2..E."""
    rows = [
        ("remote <= 1.05 x (1 - hit) x data", got["remote_over_bound"] <= 1.05,
         f"worst {got['remote_over_bound']:.3f}x"),
        ("aggregate hit >= 0.95 x min(1, N*f)", got["hit"] >= 0.95 * bound,
         f"{got['hit']:.3f} against {bound:.2f}"),
        ("one global order, no entry lost", bool(got["order_ok"]), ""),
    ]  # fmt: skip
    if prefetch:
        ratio = got["served_over_fetched"]
        rows.append(("prefetch served / fetched >= 0.95", ratio >= 0.95, f"lowest {ratio:.3f}"))
    print("targets (partitioned, epochs 2..E):")
    for name, ok, text in rows:
        print(f"  {name:<40} {'PASS' if ok else 'FAIL'}  {text}".rstrip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--size", type=int, default=20_000)
    ap.add_argument("--fraction", type=float, default=0.2, help="RAM per node / dataset")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--replay", type=float, default=1.0)
    ap.add_argument(
        "--loader-workers",
        type=int,
        default=0,
        metavar="K",
        help="each rank reads through a DataLoader with K workers (0: in the rank, in order)",
    )
    ap.add_argument("--policy", default="shade", help="every mount's policy")
    ap.add_argument(
        "--no-prefetch",
        dest="prefetch",
        action="store_false",
        help="mount with --no-prefetch (prefetching is on by default, as for a new user)",
    )
    ap.add_argument(
        "--keep-stats", type=Path, metavar="DIR", help="write each mount's final stats.json here"
    )
    ap.add_argument(
        "--partitioned-only", action="store_true", help="skip the independent-caches run"
    )
    ap.add_argument("--open-latency", type=float, default=2.0, help="slowfs ms per open")
    ap.add_argument("--bandwidth", type=float, default=200.0, help="slowfs MB/s")
    ap.add_argument("--order-only", action="store_true", help="time the order step only")
    ap.add_argument("--samples", type=int, default=1_281_167, help="--order-only: N")
    ap.add_argument("--repeats", type=int, default=5, help="--order-only: epochs timed")
    ap.add_argument(
        "--gloo",
        action="store_true",
        help="--order-only: also time the collectives (one process per node, gloo over loopback)",
    )
    ap.add_argument(
        "--mount",
        type=Path,
        metavar="DIR",
        help="--order-only: also time the daemon's side through a mount of a tree of N tiny "
        "files built (once) under DIR, as bench_namespace builds it",
    )
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--verbose", action="store_true", help="every node's counters per epoch")
    args = ap.parse_args()
    if args.order_only:
        order_only(args.samples, args.nodes, args.ranks_per_node, args.repeats)
        if args.gloo:
            gloo_collectives(args.samples, args.nodes, args.repeats)
        if args.mount:
            order_through_mount(
                args.samples, args.nodes, args.ranks_per_node, args.repeats, args.mount
            )
        return

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmpdir:
        tmp = Path(tmpdir)
        src = tmp / "src"
        rels = make_dataset(src, args.files, args.size, jitter=0.5, seed=0)
        total = sum((src / r).stat().st_size for r in rels)
        ram = int(total * args.fraction)
        print(
            f"{args.nodes} nodes x {args.ranks_per_node} ranks, {args.files} files, "
            f"{total / 1e6:.1f} MB, RAM per node {ram / 1e6:.1f} MB (f = {args.fraction}), "
            f"ShadeSampler replay {args.replay:g}, policy {args.policy}, {args.epochs} epochs, "
            f"prefetch {'on' if args.prefetch else 'off'}; remote: slowfs "
            f"{args.open_latency:g} ms/open, {args.bandwidth:g} MB/s shared"
        )
        slow = ["--open-latency", str(args.open_latency), "--bandwidth", str(args.bandwidth)]
        results = {}
        with slowfs_mounted(src, tmp / "remote", slow) as (remote, _):
            for partitioned in (True, False)[: 1 if args.partitioned_only else 2]:
                tag = "partitioned" if partitioned else "independent"
                rows = run_job(args, tmp, remote, rels, ram, partitioned)
                results[tag] = report(tag, rows, total, args.epochs, args.verbose)
        f, r = args.fraction, args.replay
        line = (
            f"hit-ratio bound: min(1, r*N*f) = {min(1.0, r * args.nodes * f):.2f} (partitioned), "
            f"min(1, r*f) = {min(1.0, r * f):.2f} (independent)"
        )
        if "independent" in results:
            gain = results["partitioned"]["hit"] / max(results["independent"]["hit"], 1e-9)
            line += f"; partitioned / independent = {gain:.2f}x"
        print(line)
        targets(results["partitioned"], args.prefetch, min(1.0, args.nodes * f))


if __name__ == "__main__":
    sys.exit(main())
