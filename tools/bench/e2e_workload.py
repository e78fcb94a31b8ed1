"""The workload of bench_e2e.py: a generated JPEG ImageFolder, its transform and a tiny model.

Everything here is deterministic (seeded), so every configuration of the benchmark reads
the same bytes and trains the same model. The mounts and the measuring helpers are in
benchlib.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing as mp
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

# -- the dataset ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetSpec:
    """What the generated ImageFolder looks like; its hash names the directory it lives in."""

    images: int
    classes: int
    width: int
    height: int
    quality: int
    target_bytes: int
    seed: int

    def key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha1(blob).hexdigest()[:10]


_GRID: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}


def render(spec: DatasetSpec, index: int, noise: float) -> np.ndarray:
    """One RGB image: a smooth class-coloured gradient and a soft wave, plus Gaussian noise.

    The class sets the hue and the gradient's direction (so a small CNN can learn the
    labels); the noise sets the JPEG's size.
    """
    shape = (spec.height, spec.width)
    if shape not in _GRID:
        yy, xx = np.mgrid[0 : spec.height, 0 : spec.width].astype(np.float32)
        _GRID[shape] = (xx / spec.width, yy / spec.height)
    xx, yy = _GRID[shape]
    rng = np.random.default_rng([spec.seed, index])
    k = index % spec.classes
    palette = np.random.default_rng([spec.seed, 10**6 + k]).uniform(40, 215, 3)
    angle = 2 * np.pi * k / spec.classes + rng.normal(0, 0.25)
    ramp = np.cos(angle) * xx + np.sin(angle) * yy - 0.5
    wave = np.sin(2 * np.pi * (rng.uniform(1, 3) * xx + rng.uniform(1, 3) * yy + rng.random()))
    img = np.empty((*shape, 3), np.float32)
    for c in range(3):
        img[..., c] = palette[c] + 90 * ramp * (1 - 0.4 * c) + 25 * wave
    img += rng.normal(0, noise, img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def encode(spec: DatasetSpec, index: int, noise: float) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(render(spec, index, noise)).save(buf, "JPEG", quality=spec.quality)
    return buf.getvalue()


def calibrate_noise(spec: DatasetSpec, probes: int = 4) -> float:
    """The noise level whose JPEGs average ``target_bytes`` (bisection on a few images)."""
    lo, hi = 0.0, 128.0
    for _ in range(14):
        mid = (lo + hi) / 2
        mean = sum(len(encode(spec, i, mid)) for i in range(probes)) / probes
        if mean < spec.target_bytes:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def rel_path(spec: DatasetSpec, index: int) -> str:
    return f"class_{index % spec.classes:02d}/img_{index:06d}.jpg"


def _write_range(job: tuple[DatasetSpec, Path, float, int, int]) -> None:
    spec, root, noise, start, stop = job
    for i in range(start, stop):
        path = root / rel_path(spec, i)
        if path.exists():
            continue
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(encode(spec, i, noise))
        tmp.rename(path)


def build_dataset(spec: DatasetSpec, workdir: Path, processes: int) -> tuple[Path, dict[str, Any]]:
    """The ImageFolder for ``spec`` under ``workdir`` (reused when complete); (root, manifest)."""
    root = workdir / f"jpeg-{spec.key()}"
    manifest_path = workdir / f"jpeg-{spec.key()}.json"
    if manifest_path.exists():
        return root, json.loads(manifest_path.read_text())
    noise = calibrate_noise(spec)
    for k in range(spec.classes):
        (root / f"class_{k:02d}").mkdir(parents=True, exist_ok=True)
    step = max(1, -(-spec.images // (4 * processes)))
    jobs = [(spec, root, noise, s, min(s + step, spec.images)) for s in range(0, spec.images, step)]
    with mp.get_context("fork").Pool(processes) as pool:
        pool.map(_write_range, jobs)
    sizes = [(root / rel_path(spec, i)).stat().st_size for i in range(spec.images)]
    manifest = {**asdict(spec), "noise": noise, "bytes": sum(sizes), "files": len(sizes)}
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    return root, manifest


# -- the training side -----------------------------------------------------------------------

INPUT_SIZE = 64


def make_transform() -> Any:
    """The light train transform: RandomResizedCrop(64) + flip + ToTensor + Normalize."""
    from torchvision import transforms

    return transforms.Compose(
        [
            transforms.RandomResizedCrop(INPUT_SIZE, scale=(0.35, 1.0)),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)),
        ]
    )


def tiny_model(classes: int) -> Any:
    """Pooling, two strided convolutions, a linear head: ~10 ms per batch of 64 on one core."""
    from torch import nn

    return nn.Sequential(
        nn.AvgPool2d(4),
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * (INPUT_SIZE // 16) ** 2, classes),
    )


def worker_init(_: int) -> None:
    import torch

    torch.set_num_threads(1)
