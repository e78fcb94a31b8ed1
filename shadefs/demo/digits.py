"""A small real dataset and training loop for the demo, the example and the learning tests.

This module owns three things that the demo (``shadefs.demo.run``), ``examples/digits.py``
and ``tests/test_learning.py`` share, so they measure the same thing:

- ``build_digits``: scikit-learn's bundled ``digits`` (1797 8x8 images, no download) written
  as an ImageFolder tree ``ROOT/train/<digit>/*.png`` and ``ROOT/test/<digit>/*.png``, the
  images upscaled to 64x64 with a little noise so each PNG is a few kB like a real sample;
- ``SmallCNN``: a two-layer CNN that trains in seconds per epoch on two CPU cores;
- ``train``: a train/eval loop over uniform sampling (``RandomSampler``) or ``ShadeSampler``
  that returns one ``EpochRecord`` per epoch, with the mount's hit ratio for that epoch
  taken from ``stats.json`` deltas.

It imports torch (through ``shadefs.torch.sampler``), so import it only where torch is installed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from shadefs.torch import ShadeSampler, find_mount
from shadefs.torch.client import CONTROL_DIR

log = logging.getLogger(__name__)

#: Side of the stored PNGs and of the network's input.
STORED_SIZE = 64
INPUT_SIZE = 16
_MARKER = ".digits-complete"


@dataclass
class EpochRecord:
    """One epoch of a run; hit figures are None when the data is not on a shadefs mount."""

    epoch: int
    test_accuracy: float
    train_loss: float
    epoch_time: float
    samples: int
    hit_ratio: float | None = None
    hits: int | None = None
    misses: int | None = None
    kernel_hits: int | None = None  # misses the kernel served from its pages (stats.json)
    bytes_from_source: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_digits(
    root: str | os.PathLike[str], *, test_fraction: float = 0.2, seed: int = 0
) -> Path:
    """Write the digits ImageFolder under ``root`` (kept if already complete); returns root."""
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    root = Path(root)
    if (root / _MARKER).exists():
        return root
    digits = load_digits()
    images = (digits.images * (255.0 / 16.0)).astype(np.float32)
    ids = np.arange(len(images))
    train_ids, test_ids = train_test_split(
        ids, test_size=test_fraction, random_state=seed, stratify=digits.target
    )
    rng = np.random.default_rng(seed)
    for split, chosen in (("train", train_ids), ("test", test_ids)):
        for i in sorted(chosen.tolist()):
            img = Image.fromarray(images[i].astype(np.uint8), mode="L")
            big = np.asarray(
                img.resize((STORED_SIZE, STORED_SIZE), Image.Resampling.BILINEAR), np.int16
            )
            # Sensor-like noise: keeps the label and makes the PNG a few kB instead of 300 B.
            noisy = np.clip(big + rng.integers(-12, 13, big.shape), 0, 255).astype(np.uint8)
            d = root / split / str(int(digits.target[i]))
            d.mkdir(parents=True, exist_ok=True)
            Image.fromarray(noisy, mode="L").save(d / f"{i:04d}.png")
    (root / _MARKER).write_text("ok\n")
    return root


def tree_bytes(root: str | os.PathLike[str]) -> int:
    """Total size of the regular files under ``root``."""
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


def load_gray(path: str) -> Any:
    """ImageFolder loader: the file decoded as 8-bit grey (torchvision's default makes RGB)."""
    from PIL import Image

    with open(path, "rb") as f:
        # The kernel's pages of the file go first: this dataset fits in memory, the one the
        # demo stands for does not, and a miss the kernel serves itself would never reach
        # the cache (shadefs answers a miss before its fetch: cache/deferred.py).
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        img = Image.open(f)
        return img.convert("L")


def transform(img: Any) -> torch.Tensor:
    """PIL image -> normalised 1x16x16 tensor.

    Plain PIL and numpy rather than a torchvision Compose: a third of the cost per sample,
    which matters when two CPU cores run the daemon, the loader and the model.
    """
    from PIL import Image

    small = img.convert("L").resize((INPUT_SIZE, INPUT_SIZE), Image.Resampling.BILINEAR)
    x = torch.from_numpy(np.asarray(small, dtype=np.float32))
    return x.div_(127.5).sub_(1.0).unsqueeze_(0)


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head: ~97% on digits after a few epochs on a CPU."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        side = INPUT_SIZE // 4
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * side * side, 64), nn.ReLU(), nn.Linear(64, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.features(x))
        return out


def load_tensors(folder: str | os.PathLike[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """An ImageFolder decoded once into (images, targets), for evaluation."""
    from torchvision.datasets import ImageFolder

    ds = ImageFolder(os.fspath(folder), transform=transform, loader=load_gray)
    xs = torch.stack([ds[i][0] for i in range(len(ds))])
    return xs, torch.tensor(ds.targets)


def evaluate(model: nn.Module, xs: torch.Tensor, ys: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        pred = model(xs).argmax(dim=1)
    model.train()
    return float((pred == ys).float().mean())


def mount_stats(mountpoint: str | None) -> dict[str, Any] | None:
    if mountpoint is None:
        return None
    with open(os.path.join(mountpoint, CONTROL_DIR, "stats.json"), "rb") as f:
        stats: dict[str, Any] = json.loads(f.read())
    return stats


def train(
    train_dir: str | os.PathLike[str],
    test_dir: str | os.PathLike[str] | None,
    *,
    sampler: str = "uniform",
    epochs: int = 5,
    seed: int = 0,
    batch_size: int = 32,
    lr: float = 2e-3,
    num_workers: int = 0,
    replay: float | None = None,
    on_epoch: Callable[[EpochRecord], None] | None = None,
) -> list[EpochRecord]:
    """Train ``SmallCNN`` on the ImageFolder ``train_dir``; one record per epoch.

    ``sampler`` is ``"uniform"`` (RandomSampler seeded with ``seed``) or ``"shade"``
    (ShadeSampler, which needs ``train_dir`` on a shadefs mount).  ``test_dir`` is decoded
    once up front: keep it off the mount (the source tree) so evaluation does not pollute
    the cache and its statistics.  Without it the accuracy is NaN and not reported.
    """
    from torchvision.datasets import ImageFolder

    if sampler not in ("uniform", "shade"):
        raise ValueError(f"sampler must be 'uniform' or 'shade', got {sampler!r}")
    torch.manual_seed(seed)
    test = load_tensors(test_dir) if test_dir is not None else None
    train_set = ImageFolder(os.fspath(train_dir), transform=transform, loader=load_gray)
    model = SmallCNN(len(train_set.classes))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    # Annealing the rate to ~0 by the last epoch makes the final accuracy a stable figure
    # (not a draw from the noise of the last few steps), so runs can be compared with it.
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    mountpoint = find_mount(os.fspath(train_dir))

    shade: ShadeSampler | None = None
    if sampler == "shade":
        shade = ShadeSampler(train_set, seed=seed, replay=replay)
        order: Any = shade
    else:
        order = RandomSampler(train_set, generator=torch.Generator().manual_seed(seed))
    loader = DataLoader(
        train_set,
        batch_size=batch_size,
        sampler=order,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )
    records: list[EpochRecord] = []
    try:
        for epoch in range(epochs):
            if shade is not None:
                shade.set_epoch(epoch)
            before = mount_stats(mountpoint)
            t0 = time.perf_counter()
            total, seen = 0.0, 0
            for x, y in loader:
                losses = loss_fn(model(x), y)
                opt.zero_grad()
                losses.mean().backward()
                opt.step()
                if shade is not None:
                    shade.record(losses)
                total += float(losses.detach().sum())
                seen += len(y)
            elapsed = time.perf_counter() - t0
            schedule.step()
            after = mount_stats(mountpoint)
            accuracy = evaluate(model, *test) if test is not None else math.nan
            rec = EpochRecord(epoch, accuracy, total / max(seen, 1), elapsed, seen)
            if before is not None and after is not None:
                rec.hits = int(after["hits"]) - int(before["hits"])
                rec.misses = int(after["misses"]) - int(before["misses"])
                rec.kernel_hits = int(after["kernel_hits"]) - int(before["kernel_hits"])
                opens = rec.hits + rec.misses
                # Served without a fetch: the tiers' hits and the kernel's (a kernel hit is
                # counted at its release, which may fall after the epoch's last stats read).
                rec.hit_ratio = min(1.0, (rec.hits + rec.kernel_hits) / opens) if opens else 0.0
                rec.bytes_from_source = int(after["bytes_from_source"]) - int(
                    before["bytes_from_source"]
                )
            if shade is not None:
                shade.report(
                    train_loss=rec.train_loss, val_accuracy=None if test is None else accuracy
                )
            records.append(rec)
            if on_epoch is not None:
                on_epoch(rec)
    finally:
        if shade is not None:
            shade.close()
    return records


def hit_ratio(records: list[EpochRecord], first: int = 1) -> float:
    """Hits (the tiers' and the kernel's) over opens of epochs ``first..`` (0-based), cold
    misses included."""
    hits = sum((r.hits or 0) + (r.kernel_hits or 0) for r in records[first:])
    opens = sum((r.hits or 0) + (r.misses or 0) for r in records[first:])
    return hits / opens if opens else 0.0
