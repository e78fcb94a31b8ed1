"""Helpers for tools/bench_e2e.py: the JPEG dataset, the mounts, the transform and the model.

Everything here is deterministic (seeded) and cleans up after itself: every mount is a
context manager that unmounts in ``finally``, whatever ended the block (an exception,
Ctrl-C, or SIGTERM once ``raise_on_sigterm`` is installed).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

TOOLS = Path(__file__).resolve().parent
SLOWFS = TOOLS / "slowfs.py"
MOUNT_DEADLINE = 60.0


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


def drop_page_cache(root: Path) -> None:
    """Ask the kernel to drop the cached pages of every file under ``root`` (no root needed)."""
    for path in root.rglob("*.jpg"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- mounts --------------------------------------------------------------------------------


def is_mounted(path: Path) -> bool:
    """From /proc/self/mounts, so that a dead FUSE mount (ENOTCONN) still counts."""
    target = os.path.abspath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 1 and _unescape(fields[1]) == target:
                return True
    return False


def _unescape(field: str) -> str:
    return (
        field.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
    )


def _wait(condition: Any, what: str, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + MOUNT_DEADLINE
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)


def lazy_unmount(mnt: Path) -> None:
    if is_mounted(mnt):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)


def _stop(pid: int, grace: float = 10.0) -> None:
    """SIGTERM the process ``pid`` (one we started), SIGKILL it after ``grace`` seconds."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


@contextlib.contextmanager
def slowfs_mount(
    src: Path, mnt: Path, options: list[str], script: Path = SLOWFS
) -> Iterator[tuple[Path, int]]:
    """tools/slowfs.py in the foreground, as our child, in its own session; (mnt, pid).

    Its own session: Ctrl-C must not unmount the remote under a shadefs mount that still
    serves it; the ``finally`` below stops it after the mounts above it are gone.
    """
    mnt.mkdir(parents=True, exist_ok=True)
    lazy_unmount(mnt)  # a leftover of an earlier, killed run
    cmd = [sys.executable, str(script), str(src), str(mnt), *options]
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        _wait(lambda: is_mounted(mnt), f"slowfs on {mnt}", proc)
        yield mnt, proc.pid
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        lazy_unmount(mnt)


@contextlib.contextmanager
def shadefs_mount(src: Path, mnt: Path, options: list[str]) -> Iterator[Path]:
    """``shadefs mount`` (a background daemon); ``shadefs umount``, then the fallbacks."""
    mnt.mkdir(parents=True, exist_ok=True)
    lazy_unmount(mnt)
    shadefs = [sys.executable, "-m", "shadefs"]
    pid: int | None = None
    try:
        # Inside the try: a Ctrl-C during start-up must still unmount what got mounted.
        subprocess.run([*shadefs, "mount", str(src), str(mnt), *options], check=True)
        pid = int(read_json(mnt / ".shadefs" / "stats.json")["pid"])
        yield mnt
    finally:
        if is_mounted(mnt):
            subprocess.run([*shadefs, "umount", "--timeout", "20", str(mnt)], check=False)
        lazy_unmount(mnt)
        if pid is not None and _alive(pid):
            _stop(pid)


_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, every core counted."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / _TICK, sum(values) / _TICK


def read_json(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return json.loads(f.read())


def slowfs_stats(mnt: Path) -> dict[str, Any]:
    return json.loads(os.getxattr(mnt, "user.slowfs.stats"))


def shadefs_mount_help() -> str:
    out = subprocess.run(
        [sys.executable, "-m", "shadefs", "mount", "--help"], capture_output=True, text=True
    )
    return out.stdout


@contextlib.contextmanager
def raise_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into KeyboardInterrupt in this process, so ``finally`` runs.

    Forked DataLoader workers inherit the handler; it only raises in the process that
    installed it, the others keep the default action.
    """
    me = os.getpid()

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != me:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt(signal.Signals(signum).name)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


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
