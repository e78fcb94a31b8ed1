"""ShadeSampler against a real daemon: registration, losses, orders, replay, errors, ranks.

Every test mounts shadefs with the ``mounter`` fixture (FUSE missing is a failure under
CI=true).  The two-rank tests run torch.distributed (gloo, file:// rendezvous) in two
processes started with torch.multiprocessing.spawn.
"""

from __future__ import annotations

import io
import json
import math
import os
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import require_fuse, start_mount

torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
torchvision = (
    pytest.importorskip("torchvision") if not os.environ.get("CI") else __import__("torchvision")
)
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as tmp  # noqa: E402
from PIL import Image  # noqa: E402
from torchvision.datasets import ImageFolder  # noqa: E402

from shadefs.torch.sampler import ShadeSampler  # noqa: E402

pytestmark = [pytest.mark.mount, pytest.mark.torch]


def make_image_folder(root: Path, classes: int = 3, per_class: int = 30) -> Path:
    rng = random.Random(5)
    for c in range(classes):
        d = root / "train" / f"class_{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            img = Image.new("L", (16, 16), rng.randrange(256))
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            (d / f"{i:03d}.png").write_bytes(buf.getvalue())
    return root


def loss_of(indices: np.ndarray) -> np.ndarray:
    """A fixed 'difficulty' per sample, so the table has something to learn."""
    return ((np.asarray(indices) * 7919) % 101 / 10.0).astype(np.float32)


def read_files(paths: list[str]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            f.read()


def residency(mnt: Path, rels: list[str]) -> list[str]:
    fd = os.open(mnt / ".shadefs" / "residency", os.O_RDWR)
    try:
        os.write(fd, "".join(r + "\n" for r in rels).encode())
        os.lseek(fd, 0, os.SEEK_SET)  # the answers start at offset 0
        out = b""
        while chunk := os.read(fd, 1 << 16):
            out += chunk
    finally:
        os.close(fd)
    return out.decode().split()


def test_register_record_and_read_back_the_order(tmp_path: Path, mounter) -> None:
    require_fuse()
    src = make_image_folder(tmp_path / "src")
    m = mounter(src, "--policy", "shade", "--ram", "64M")
    train = ImageFolder(str(m.mnt / "train"))
    n = len(train)
    rels = [os.path.relpath(p, m.mnt) for p, _ in train.samples]
    # A fifth of the samples resident: replay has something to replay.
    read_files([p for p, _ in train.samples[::5]])
    status = residency(m.mnt, rels)
    resident = {i for i, s in enumerate(status) if s == "ram"}
    assert resident == set(range(0, n, 5))

    sampler = ShadeSampler(train, replay=3, seed=4, flush_every=3)
    stats = m.stats()["sampler"]
    assert stats["samples"] == n and stats["replay"] == 3 and stats["replay_mode"] == "fixed"

    sampler.set_epoch(0)
    order = list(sampler)
    assert len(order) == n == len(sampler)
    assert all(0 <= i < n for i in order)
    counts = Counter(order)
    # Replay is visible: resident samples appear up to 3 times, the others at most once.
    assert max(counts.values()) > 1
    assert all(counts[i] <= (3 if i in resident else 1) for i in counts)
    assert {i for i, c in counts.items() if c > 1} <= resident

    batch = 8
    for start in range(0, n, batch):
        idx = np.asarray(order[start : start + batch])
        sampler.record(torch.from_numpy(loss_of(idx)))
    sampler.report(train_loss=1.25, val_accuracy=0.5)
    stats = m.stats()["sampler"]
    assert stats["losses_ingested"] == n
    assert stats["table"]["scored"] == len(counts)
    assert stats["table"]["ingested_batches"] == math.ceil(n / batch)
    assert stats["reports"] == 1 and stats["last_report"] == {
        "train_loss": 1.25,
        "val_accuracy": 0.5,
    }
    batches = math.ceil(n / batch)
    assert sampler.messages_sent == math.ceil(batches / 3)  # one message per 3 batches

    # The order of the next epoch is the daemon's: the same bytes whoever asks.
    sampler.set_epoch(1)
    assert m.stats()["sampler"]["epoch"] == 1
    again = list(sampler)
    assert sampler.order(epoch=1).tolist() == again
    assert len(again) == n
    sampler.close()


def test_daemon_errors_name_the_file_and_the_reason(tmp_path: Path, mounter) -> None:
    require_fuse()
    src = make_image_folder(tmp_path / "src", classes=1, per_class=3)
    m = mounter(src)
    paths = [str(p) for p in sorted((m.mnt / "train").rglob("*.png"))]
    with pytest.raises(RuntimeError, match=r"\.shadefs/dataset.*error") as info:
        ShadeSampler([*paths, str(m.mnt / "train" / "class_0" / "nope.png")])
    assert "nope.png" in str(info.value) or "no such" in str(info.value).lower()
    # The daemon still works after the rejected write.
    ShadeSampler(paths).close()
    assert m.stats()["sampler"]["samples"] == 3


# -- two ranks -------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, rdv: str, scenarios: dict[str, list[str]], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world)
    try:
        results = {}
        for name, mounts in scenarios.items():
            mnt = mounts[rank % len(mounts)]
            train = ImageFolder(os.path.join(mnt, "train"))
            sampler = ShadeSampler(train, seed=11, flush_every=2, replay=3)
            result: dict[str, object] = {"sender": sampler._sender}
            for epoch in range(2):
                sampler.set_epoch(epoch)
                order = list(sampler)
                result[f"order{epoch}"] = order
                for start in range(0, len(order), 4):
                    idx = np.asarray(order[start : start + 4])
                    sampler.record(torch.from_numpy(loss_of(idx)))
                sampler.report(train_loss=float(rank + 1), val_accuracy=0.5)
            sampler.close()
            result["messages_sent"] = sampler.messages_sent
            results[name] = result
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One two-rank job (spawning costs ~15 s of torch imports) over two scenarios.

    ``shared``: both ranks on one mount with a quarter of the files resident.
    ``nodes``: each rank on its own mount ("two nodes"), nothing resident.
    """
    require_fuse()
    base = tmp_path_factory.mktemp("ranks")
    shared_src = make_image_folder(base / "shared_src", per_class=25)  # 75: padding needed
    nodes_src = make_image_folder(base / "nodes_src", per_class=20)
    mounts = []
    try:
        shared = start_mount(shared_src, base / "shared", "--policy", "shade", "--ram", "64M")
        mounts.append(shared)
        shared_set = ImageFolder(str(shared.mnt / "train"))
        read_files([p for p, _ in shared_set.samples[::4]])
        nodes = []
        for i in range(2):
            nodes.append(start_mount(nodes_src, base / f"node{i}", "--policy", "shade"))
            mounts.append(nodes[-1])
        out = base / "out"
        out.mkdir()
        scenarios = {"shared": [str(shared.mnt)], "nodes": [str(m.mnt) for m in nodes]}
        tmp.spawn(_rank_main, args=(2, str(base / "rdv"), scenarios, str(out)), nprocs=2, join=True)
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        yield {
            "shared": shared,
            "shared_resident": set(range(0, len(shared_set), 4)),
            "nodes": nodes,
            "ranks": ranks,
        }
    finally:
        for m in mounts:
            m.unmount()


def interleave(a: list[int], b: list[int]) -> list[int]:
    """Undo rank_slice for two ranks: the padded global list."""
    assert len(a) == len(b)
    return [x for pair in zip(a, b, strict=True) for x in pair]


def _fetch(sampler: ShadeSampler, epoch: int, rank: int) -> list[int]:
    return sampler.order(epoch=epoch, rank=rank).tolist()


def test_two_ranks_share_one_mount(two_ranks: dict[str, Any]) -> None:
    m = two_ranks["shared"]
    resident = two_ranks["shared_resident"]
    ranks = [r["shared"] for r in two_ranks["ranks"]]
    train = ImageFolder(str(m.mnt / "train"))
    n = len(train)

    # One sender per mount, so the daemon ingested every batch once (not once per rank)
    # and saw one report per epoch.
    assert sorted(r["sender"] for r in ranks) == [False, True]
    stats = m.stats()["sampler"]
    share = math.ceil(n / 2)
    assert stats["losses_ingested"] == 2 * 2 * share
    assert stats["reports"] == 2
    assert stats["last_report"] == {"train_loss": 1.5, "val_accuracy": 0.5}  # averaged

    probe = ShadeSampler(train, num_replicas=2, seed=11)
    for epoch in range(2):
        r0, r1 = ranks[0][f"order{epoch}"], ranks[1][f"order{epoch}"]
        # Each rank got its share of the one global list the daemon built for the epoch.
        assert r0 == _fetch(probe, epoch, 0) and r1 == _fetch(probe, epoch, 1)
        merged = interleave(r0, r1)
        glob, pad = merged[:n], merged[n:]
        assert pad == glob[: len(pad)]  # DistributedSampler-style wrap, nothing else
        counts = Counter(glob)
        assert all(0 <= i < n for i in counts)
        assert all(c <= (3 if i in resident else 1) for i, c in counts.items())
        assert any(c > 1 for c in counts.values())  # replay visible in the shares
        # Rank shares are disjoint as positions of the list: a sample is on both ranks
        # only if the global list holds it more than once.
        both = set(r0) & set(r1)
        assert all(counts[i] > 1 or i in pad for i in both)
    probe.close()


def test_two_ranks_on_two_mounts_build_the_same_table(two_ranks: dict[str, Any]) -> None:
    """Two "nodes": each rank talks to its own mount; the all-gather keeps the tables equal."""
    mounts = two_ranks["nodes"]
    ranks = [r["nodes"] for r in two_ranks["ranks"]]
    n = 60
    assert [r["sender"] for r in ranks] == [True, True]
    tables = [m.stats()["sampler"]["table"] for m in mounts]
    # Each daemon ingested both ranks' losses of both epochs: 2 x 2 x 30.
    assert tables[0]["ingested_samples"] == tables[1]["ingested_samples"] == 2 * n
    assert tables[0]["scored"] == tables[1]["scored"] == n
    assert tables[0]["mean_score"] == tables[1]["mean_score"]
    for epoch in range(2):
        r0, r1 = ranks[0][f"order{epoch}"], ranks[1][f"order{epoch}"]
        # Nothing was read, so nothing is resident on either node: the shares are a
        # partition of one permutation of the dataset.
        assert sorted(interleave(r0, r1)) == list(range(n))
    # Each daemon hands out, for each rank, the share that rank trained on.
    probes = [
        ShadeSampler(ImageFolder(str(m.mnt / "train")), num_replicas=2, seed=11) for m in mounts
    ]
    for rank in range(2):
        assert _fetch(probes[0], 1, rank) == _fetch(probes[1], 1, rank) == ranks[rank]["order1"]
    for p in probes:
        p.close()
