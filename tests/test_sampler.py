"""ShadeSampler without a mount: the control channel is replaced by a fake that records.

What is checked here is the sampler's own logic: where the losses land (the released SHADE
code scored the wrong indices), how many writes the buffering makes, which ctl lines go out,
how the mount is found and which paths are registered.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
from torch.utils.data import BatchSampler, DataLoader, Dataset  # noqa: E402

import shadefs.torch.sampler as st  # noqa: E402
from shadefs.sampling import pads, wire  # noqa: E402

pytestmark = pytest.mark.torch


class FakeChannel:
    """Stands in for ControlClient: records every message, serves PADS orders."""

    instances: list[FakeChannel] = []

    def __init__(self, mountpoint: str) -> None:
        self.mountpoint = mountpoint
        self.ctl_lines: list[str] = []
        self.datasets: list[list[str]] = []
        self.loss_messages: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.requests: list[wire.OrderRequest] = []
        self.orders: list[np.ndarray] = []
        FakeChannel.instances.append(self)

    def ctl(self, text: str) -> str:
        self.ctl_lines.append(text)
        return "ok"

    def register(self, message: bytes) -> None:
        self.datasets.append(wire.decode_dataset(message))

    def send_losses(self, message: bytes) -> None:
        n = len(self.datasets[-1])
        self.loss_messages.append(wire.decode_losses(message, n))

    def order(self, request: bytes) -> bytes:
        req = wire.decode_order_request(request)
        self.requests.append(req)
        n = len(self.datasets[-1])
        # A realistic order: a third of the samples resident and replayed, so the order
        # holds repeated indices (attribution by position, not by value, must still work).
        resident = np.arange(n) % 3 == 0
        params = pads.OrderParams(req.epoch, req.seed, req.world_size, req.rank, replay=3.0)
        share = pads.build_order(np.full(n, 0.5), resident, params)
        self.orders.append(share)
        return wire.encode_order_response(req.epoch, share)

    def sent(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All losses sent so far: (indices, losses, batch lengths), concatenated."""
        if not self.loss_messages:
            return np.empty(0, np.int64), np.empty(0, np.float32), np.empty(0, np.uint32)
        return tuple(np.concatenate(parts) for parts in zip(*self.loss_messages, strict=True))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> type[FakeChannel]:
    FakeChannel.instances = []
    monkeypatch.setattr(st, "ControlClient", FakeChannel)
    return FakeChannel


def fake_mount(root: Path, n: int, sub: str = "train") -> list[str]:
    """A directory that looks like a mount root to the sampler, with n sample paths."""
    (root / ".shadefs").mkdir(parents=True)
    (root / ".shadefs" / "ctl").write_text("")
    return [str(root / sub / f"c{i % 3}" / f"{i:04d}.png") for i in range(n)]


class IndexDataset(Dataset):
    """Returns each sample's own index, so a test can see where every loss came from."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def loss_of(index: torch.Tensor) -> torch.Tensor:
    return index.double() * 0.5 + 0.25


def test_losses_land_on_the_indices_handed_out(tmp_path: Path, fake: type[FakeChannel]) -> None:
    n, batch = 50, 7  # 7 does not divide the epoch length
    sampler = st.ShadeSampler(fake_mount(tmp_path, n), seed=3, flush_every=4)
    loader = DataLoader(IndexDataset(n), batch_size=batch, sampler=sampler, num_workers=2)
    trained = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for idx in loader:
            trained.append(idx)
            sampler.record(loss_of(idx).requires_grad_())  # loader order, no indices
    sampler.close()
    chan = fake.instances[0]
    handed = np.concatenate(chan.orders)
    assert len(chan.orders) == 2 and len(handed) == 2 * n
    assert len(set(handed.tolist())) < len(handed)  # replayed indices were handed out
    indices, losses, lengths = chan.sent()
    # Every loss is attributed to the index whose sample produced it, in loader order.
    np.testing.assert_array_equal(indices, np.concatenate([t.numpy() for t in trained]))
    np.testing.assert_array_equal(indices, handed)
    np.testing.assert_allclose(losses, loss_of(torch.from_numpy(indices)).numpy(), rtol=1e-6)
    assert lengths.tolist() == [batch] * 7 + [1] + [batch] * 7 + [1]


def test_drop_last_and_batch_sampler_keep_attribution(
    tmp_path: Path, fake: type[FakeChannel]
) -> None:
    n = 50
    sampler = st.ShadeSampler(fake_mount(tmp_path, n), seed=1)
    loader = DataLoader(
        IndexDataset(n),
        batch_sampler=BatchSampler(sampler, batch_size=8, drop_last=True),
        num_workers=2,
    )
    got = []
    for idx in loader:
        got.append(idx)
        sampler.record(loss_of(idx))
    sampler.close()
    indices, losses, _ = fake.instances[0].sent()
    assert len(indices) == 48  # the 2 dropped samples are never recorded
    np.testing.assert_array_equal(indices, torch.cat(got).numpy())
    np.testing.assert_allclose(losses, loss_of(torch.from_numpy(indices)).numpy(), rtol=1e-6)


def test_explicit_indices_win(tmp_path: Path, fake: type[FakeChannel]) -> None:
    sampler = st.ShadeSampler(fake_mount(tmp_path, 20))
    order = list(sampler)
    explicit = torch.tensor([5, 6, 7])
    assert explicit.tolist() != order[:3]
    sampler.record(torch.tensor([1.0, 2.0, 3.0]), indices=explicit)
    sampler.record(torch.tensor([4.0, 5.0]))  # the cursor did not move: order[0:2]
    sampler.close()
    indices, losses, lengths = fake.instances[0].sent()
    assert indices.tolist() == [5, 6, 7, *order[:2]]
    assert losses.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert lengths.tolist() == [3, 2]
    with pytest.raises(ValueError, match="indices"):
        sampler.record(torch.ones(2), indices=[0, 20])
    with pytest.raises(ValueError, match="2 indices but 3 losses"):
        sampler.record(torch.ones(3), indices=[0, 1])


def test_misuse_is_an_error_not_a_misattribution(tmp_path: Path, fake: type[FakeChannel]) -> None:
    sampler = st.ShadeSampler(fake_mount(tmp_path, 10))
    with pytest.raises(ValueError, match="reduction='none'"):
        sampler.record(torch.tensor(1.5))  # a mean loss, not per-sample
    list(sampler)
    sampler.record(torch.ones(8))
    with pytest.raises(RuntimeError, match="only 2 indices"):
        sampler.record(torch.ones(3))


@pytest.mark.parametrize("batches,flush_every", [(21, 8), (64, 64), (1, 64), (130, 1)])
def test_buffering_sends_one_message_per_flush_every_batches(
    tmp_path: Path, fake: type[FakeChannel], batches: int, flush_every: int
) -> None:
    n = 16
    sampler = st.ShadeSampler(fake_mount(tmp_path, n), flush_every=flush_every)
    chan = fake.instances[0]
    rng = np.random.default_rng(0)
    sizes = []
    for _ in range(batches):
        size = int(rng.integers(1, 5))
        sizes.append(size)
        sampler.record(rng.random(size), indices=rng.integers(0, n, size))
    assert len(chan.loss_messages) == batches // flush_every  # nothing sent early
    sampler.close()
    assert len(chan.loss_messages) == math.ceil(batches / flush_every)
    assert all(len(m[2]) <= flush_every for m in chan.loss_messages)
    assert chan.sent()[2].tolist() == sizes  # batch boundaries survive the buffering
    sampler.close()  # idempotent: nothing more is sent
    assert len(chan.loss_messages) == math.ceil(batches / flush_every)


def test_non_finite_batch_is_dropped_but_counted(tmp_path: Path, fake: type[FakeChannel]) -> None:
    sampler = st.ShadeSampler(fake_mount(tmp_path, 10), flush_every=2)
    sampler.record([1.0, float("nan")], indices=[0, 1])
    sampler.record([2.0], indices=[2])  # the second record() triggers the flush
    chan = fake.instances[0]
    assert len(chan.loss_messages) == 1
    assert chan.sent()[0].tolist() == [2]


def test_control_lines_and_epochs(tmp_path: Path, fake: type[FakeChannel]) -> None:
    paths = fake_mount(tmp_path, 10)
    st.ShadeSampler(paths)
    fixed = st.ShadeSampler(paths, replay=3, seed=9)
    assert fake.instances[0].ctl_lines == ["replay auto"]
    assert fake.instances[1].ctl_lines == ["replay 3"]
    fixed.set_epoch(4)
    assert len(list(fixed)) == 10
    fixed.record(torch.ones(10))
    fixed.report(train_loss=0.5, val_accuracy=0.875)
    list(fixed)  # no set_epoch: the sampler moves on to epoch 5 by itself
    fixed.set_epoch(7)
    list(fixed)
    chan = fake.instances[1]
    assert chan.ctl_lines[1:] == [
        "epoch 4",
        "report epoch=4 train_loss=0.5 val_accuracy=0.875",
        "epoch 7",
    ]
    assert [(r.epoch, r.seed, r.rank, r.world_size) for r in chan.requests] == [
        (4, 9, 0, 1),
        (5, 9, 0, 1),
        (7, 9, 0, 1),
    ]
    assert len(chan.loss_messages) == 1  # report flushed the epoch's losses first
    with pytest.raises(ValueError, match="replay"):
        st.ShadeSampler(paths, replay=0.5)


def test_ranks_and_length(tmp_path: Path, fake: type[FakeChannel]) -> None:
    paths = fake_mount(tmp_path, 11)
    shares = []
    for rank in range(3):
        s = st.ShadeSampler(paths, num_replicas=3, rank=rank, seed=2)
        assert len(s) == 4  # ceil(11 / 3), DistributedSampler-style padding
        shares.append(list(s))
        assert len(s) == 4
    req = fake.instances[2].requests[0]
    assert (req.rank, req.world_size, req.seed) == (2, 3, 2)
    # The fake serves pads.build_order: the shares interleave back into the global list.
    merged = [shares[i % 3][i // 3] for i in range(12)]
    params = pads.OrderParams(0, 2, 3, 0, replay=3.0)
    glob = pads.build_global_order(np.full(11, 0.5), np.arange(11) % 3 == 0, params)
    assert merged[:11] == glob.tolist()
    with pytest.raises(ValueError, match="rank"):
        st.ShadeSampler(paths, num_replicas=2, rank=2)


def test_mount_discovery_and_relative_paths(tmp_path: Path, fake: type[FakeChannel]) -> None:
    root = tmp_path / "mnt"
    paths = fake_mount(root, 6)
    st.ShadeSampler(paths)
    chan = fake.instances[0]
    assert chan.mountpoint == str(root)
    assert chan.datasets[0] == [os.path.relpath(p, root) for p in paths]
    assert chan.datasets[0][1] == os.path.join("train", "c1", "0001.png")

    class Folder:  # what ImageFolder exposes
        samples = [(p, i % 3) for i, p in enumerate(paths)]

    st.ShadeSampler(Folder())
    assert fake.instances[1].datasets[0] == chan.datasets[0]
    # An explicit mountpoint wins over the search.
    st.ShadeSampler(paths, mountpoint=tmp_path)
    assert fake.instances[2].datasets[0][0] == os.path.join("mnt", "train", "c0", "0000.png")

    with pytest.raises(ValueError, match="outside the shadefs mount"):
        st.ShadeSampler([*paths, str(tmp_path / "elsewhere.png")])
    with pytest.raises(ValueError, match="no shadefs mount above"):
        st.ShadeSampler([str(tmp_path / "elsewhere.png")])
    with pytest.raises(ValueError, match="non-empty"):
        st.ShadeSampler([])
    with pytest.raises(TypeError, match="samples"):
        st.ShadeSampler(object())


def test_real_channel_names_the_file_when_the_daemon_lacks_it(tmp_path: Path) -> None:
    # A directory with .shadefs/ctl but no sampler entries: an old daemon, or not a mount.
    paths = fake_mount(tmp_path, 3)
    with pytest.raises(RuntimeError, match=r"\.shadefs/dataset does not exist"):
        st.ShadeSampler(paths)


def test_only_the_sampler_and_the_demo_import_torch() -> None:
    import shadefs

    pkg = Path(shadefs.__file__).parent
    offenders = [
        str(p.relative_to(pkg))
        for p in pkg.rglob("*.py")
        if p.relative_to(pkg).parts[0] != "demo"
        # The sampler and its multi-node half.
        and str(p.relative_to(pkg)) not in ("torch/sampler.py", "torch/distributed.py")
        and any(
            line.strip().startswith(("import torch", "from torch"))
            for line in p.read_text().splitlines()
        )
    ]
    assert offenders == []


def test_the_client_works_without_torch() -> None:
    # The CLI imports the client; torch is an optional extra.
    code = (
        "import sys; import shadefs.torch.client; from shadefs.torch import find_mount\n"
        "assert 'torch' not in {m.split('.')[0] for m in sys.modules}, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
