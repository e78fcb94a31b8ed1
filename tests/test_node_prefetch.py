"""Several nodes, one job: a node's daemon prefetches the shares of its own ranks only.

Any rank may ask its daemon for every rank's share of an installed epoch (the shares are
the same on every node; tests/test_nodes_mount.py checks that so). A prefetch plan made
for a share that another node's rank reads fetched that node's misses here too: in
bench_nodes (800 x 25 KB, 2 nodes, replay 1) the remote then served 0.68-0.89 datasets per
epoch against a bound of 0.60 (docs/benchmarks.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import trio

from shadefs.options import MountOptions
from shadefs.sampling import wire, wire_nodes
from shadefs.service import Service
from tests.conftest import make_tree

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
