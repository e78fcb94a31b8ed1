"""Unchanged torchvision code over the mount: same dataset, byte-identical samples."""

from __future__ import annotations

import io
import os
import random
from pathlib import Path

import pytest

from tests.conftest import drop_kernel_pages, require_fuse

torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
torchvision = (
    pytest.importorskip("torchvision") if not os.environ.get("CI") else __import__("torchvision")
)
from PIL import Image  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchvision.datasets import ImageFolder  # noqa: E402

pytestmark = [pytest.mark.mount, pytest.mark.torch]


def raw_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def collate_bytes(batch):
    return batch


def make_image_folder(root: Path, classes: int = 3, per_class: int = 40) -> Path:
    rng = random.Random(3)
    for c in range(classes):
        d = root / f"class_{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            img = Image.new("RGB", (24, 24), (rng.randrange(256), c * 80, i * 6))
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            (d / f"img_{i:03d}.png").write_bytes(buf.getvalue())
    return root


def test_imagefolder_and_dataloader_see_the_same_data(tmp_path: Path, mounter) -> None:
    require_fuse()
    src = make_image_folder(tmp_path / "src")
    total = sum(p.stat().st_size for p in src.rglob("*.png"))
    m = mounter(src, "--ram", str(total // 5))
    direct = ImageFolder(str(src), loader=raw_bytes)
    mounted = ImageFolder(str(m.mnt), loader=raw_bytes)
    assert mounted.classes == direct.classes
    assert mounted.class_to_idx == direct.class_to_idx
    assert mounted.targets == direct.targets
    assert [os.path.relpath(p, m.mnt) for p, _ in mounted.samples] == [
        os.path.relpath(p, src) for p, _ in direct.samples
    ]
    loader = DataLoader(
        mounted, batch_size=8, shuffle=True, num_workers=2, collate_fn=collate_bytes
    )
    # Every sample's bytes, with the target torchvision assigned it on the source side.
    expected = {raw_bytes(p): t for p, t in direct.samples}
    assert len(expected) == len(direct)
    for _epoch in range(2):
        drop_kernel_pages()  # a dataset larger than memory (kernel hits: see the daemon's)
        got = [(data, target) for batch in loader for data, target in batch]
        assert len(got) == len(direct)
        assert {data for data, _ in got} == set(expected)
        assert all(expected[data] == target for data, target in got)
    # Decoded images too: the standard PIL loader through the mount.
    decoded = ImageFolder(str(m.mnt), transform=torchvision.transforms.PILToTensor())
    ref = ImageFolder(str(src), transform=torchvision.transforms.PILToTensor())
    for i in range(0, len(ref), 17):
        assert torch.equal(decoded[i][0], ref[i][0])
    stats = m.stats()
    assert stats["hits"] > 0 and stats["ram_bytes"] <= stats["ram_capacity"]
