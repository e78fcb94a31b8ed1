"""Several nodes, one job: a node's daemon prefetches the shares of its own ranks only.

Any rank may ask its daemon for every rank's share of an installed epoch (the shares are
the same on every node; tests/test_nodes_mount.py checks that so). A prefetch plan made
for a share that another node's rank reads fetched that node's misses here too: in
bench_nodes (800 x 25 KB, 2 nodes, replay 1) the remote then served 0.68-0.89 datasets per
epoch against a bound of 0.60 (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from shadefs.options import MountOptions
from shadefs.sampling import wire, wire_nodes
from shadefs.service import Service
from tests.conftest import make_tree, poll

N = 40


def _service(tmp_path: Path) -> Service:
    make_tree(tmp_path / "src", {f"c/f{i:02d}": b"x" * (100 + i) for i in range(N)})
    opts = MountOptions(source=str(tmp_path / "src"), mountpoint="/unused", ram=1 << 20)
    return Service(opts)


def test_a_node_plans_only_the_shares_its_own_ranks_read(tmp_path: Path) -> None:
    service = _service(tmp_path)
    pf = service.prefetcher
    assert pf is not None
    # Ranks 0 and 1 read through node 0 (this daemon), ranks 2 and 3 through node 1.
    rank_node = [0, 0, 1, 1]
    bitmaps = [wire_nodes.encode_resident(np.zeros(N, bool))[16:]] * 2

    async def run() -> None:
        await service.register_dataset([f"c/f{i:02d}" for i in range(N)])
        for epoch in (0, 1):
            msg = wire_nodes.encode_node_order(epoch, 5, 0, (11, 22), rank_node, bitmaps, N)
            await service.install_order(wire_nodes.decode_node_order(msg, N))
            shares = [
                await service.order(wire.OrderRequest(epoch, rank, 4, seed=5)) for rank in range(4)
            ]
            assert sorted(np.concatenate(shares).tolist()) == list(range(N))
            names = sorted(pf.plans)
            assert names == ["order:seed=5:world=4:rank=0", "order:seed=5:world=4:rank=1"]
            planned = np.concatenate([pf.plans[n].keys for n in names])
            here = np.concatenate(shares[:2])
            assert sorted(planned.tolist()) == sorted(service.sampling.keys[here].tolist())
        assert service.stats().sampler.orders_elsewhere == 4

    trio.run(run)


def test_a_single_node_job_plans_every_rank_it_is_asked_for(tmp_path: Path) -> None:
    # Without an installed multi-node epoch every rank reads through this mount (ranks
    # of one node sharing it): each one's share is planned.
    service = _service(tmp_path)
    pf = service.prefetcher
    assert pf is not None

    async def run() -> None:
        await service.register_dataset([f"c/f{i:02d}" for i in range(N)])
        for rank in range(2):
            await service.order(wire.OrderRequest(0, rank, 2, seed=5))
        assert len(pf.plans) == 2
        assert service.stats().sampler.orders_elsewhere == 0

    trio.run(run)


# --- two mounted nodes, one gloo world --------------------------------------------------------

FILES = 200  # of 4 KiB; each RAM tier holds 20% of them
EPOCHS = 3


def _node_stats(mnt: str) -> dict[str, Any]:
    with open(os.path.join(mnt, ".shadefs", "stats.json"), "rb") as f:
        doc: dict[str, Any] = json.loads(f.read())
    return doc


def _idle(mnt: str) -> dict[str, Any]:
    """The node's stats once its prefetcher has nothing in flight."""

    def idle() -> dict[str, Any] | None:
        doc = _node_stats(mnt)
        return doc if doc["prefetch"]["inflight"] == 0 else None

    return poll(idle, "the node's prefetcher kept fetches in flight")


def _rank_main(rank: int, world: int, rdv: str, mounts: list[str], out: str) -> None:
    import torch
    import torch.distributed as dist

    from shadefs.torch import ShadeSampler

    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world)
    try:
        mnt = mounts[rank]
        paths = sorted(str(p) for p in Path(mnt, "train").rglob("*.bin"))
        sampler = ShadeSampler(paths, mountpoint=mnt, seed=3, replay=1, flush_every=4)
        snaps = []
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            order = list(sampler)
            # Every rank's share, from this rank's daemon (as a job checking that the nodes
            # agree asks): only this node's own share may be fetched here.
            named = [sampler.order(epoch, r).tolist() for r in range(world)]
            for start in range(0, len(order), 10):
                idx = np.asarray(order[start : start + 10])
                for i in idx:
                    with open(paths[i], "rb") as f:
                        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                        f.read()
                sampler.record(torch.from_numpy((idx % 7 / 3.0).astype(np.float32)))
            sampler.report(train_loss=1.0 / (epoch + 1))
            dist.barrier()
            snaps.append({"stats": _idle(mnt), "order": order, "named": named})
            dist.barrier()
        sampler.close()
        Path(out, f"rank{rank}.json").write_text(json.dumps(snaps))
    finally:
        dist.destroy_process_group()


@pytest.mark.mount
@pytest.mark.torch
def test_each_node_fetches_only_what_its_ranks_read_once_per_epoch(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch.multiprocessing as tmp_mp

    from tests.conftest import require_fuse, start_mount

    require_fuse()
    rng = np.random.default_rng(9)
    for i in range(FILES):
        path = tmp_path / "src" / "train" / f"class_{i % 4}" / f"{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.bytes(4096))
    # Prefetching and speculation on, as a new user mounts.
    nodes = [start_mount(tmp_path / "src", tmp_path / f"node{k}", "--policy", "shade",
                         "--ram", "160K") for k in range(2)]  # fmt: skip
    try:
        out = tmp_path / "out"
        out.mkdir()
        mounts = [str(m.mnt) for m in nodes]
        tmp_mp.spawn(_rank_main, args=(2, str(tmp_path / "rdv"), mounts, str(out)), nprocs=2)
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    finally:
        for m in nodes:
            m.unmount()
    for k in range(2):
        before = {"source_fetches": 0, "misses": 0, "refetches": 0}
        for epoch, snap in enumerate(ranks[k]):
            s = snap["stats"]
            assert snap["named"] == [ranks[r][epoch]["order"] for r in range(2)]
            fetched = s["source_fetches"] - before["source_fetches"]
            misses = s["misses"] - before["misses"]
            # Nothing but this node's rank's misses crossed the link, each file once.
            assert 0 < fetched <= misses, f"node {k} epoch {epoch}: {fetched} for {misses}"
            assert s["refetches"] == before["refetches"], f"node {k} epoch {epoch}"
            before = s
        pf = ranks[k][-1]["stats"]["prefetch"]
        assert pf["fetched"] > 0 and pf["wasted"] == pf["unused"] == 0
        assert ranks[k][-1]["stats"]["sampler"]["orders_elsewhere"] == EPOCHS
