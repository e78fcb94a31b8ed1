"""``shadefs demo``: mount a real dataset, train on it, and show what the cache does.

This module owns the demo's run: it builds scikit-learn's digits as an ImageFolder in a
work directory, puts it behind ``shadefs.demo.slowfs`` (an emulated slow remote), mounts
shadefs over that with RAM for 20% of the training bytes, and trains the same small CNN
three times: first reading the emulated remote directly (no shadefs: the baseline, what the
user has today), then uniform sampling through shadefs with the default ``epoch`` policy,
then ``ShadeSampler`` through shadefs with the ``shade`` policy. All three go through the
same training loop (``shadefs.demo.digits.train``), which times every epoch itself. It
prints the hit ratio, accuracy and time of every epoch and the summaries
(``shadefs.demo.report``), and writes a PNG with matplotlib (``shadefs.demo.plot``).

Every mount it makes is unmounted on the way out, also on Ctrl-C, SIGTERM or SIGHUP:
``shadefs umount`` first, ``fusermount3 -u -z`` if that fails."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from shadefs.demo import report
from shadefs.demo.plot import Run, write_plot

if TYPE_CHECKING:
    from shadefs.demo.digits import EpochRecord

log = logging.getLogger(__name__)

RAM_FRACTION = 0.2
REPLAY = 3
#: What the emulated remote charges (shadefs.demo.slowfs options); said wherever a time is shown.
#: No metadata latency: with slowfs's zero entry timeouts every path component would pay it
#: again on every open (about 10 ms a file at 0.5 ms), where a real NFS client caches them.
SLOWFS_ARGS = ("--open-latency", "3", "--meta-latency", "0", "--bandwidth", "100")
PLOT_NAME = "shadefs-demo.png"


@dataclass(frozen=True)
class RunSpec:
    """One training run: its key (colour, per-epoch lines), the shadefs policy it mounts with
    (None: it reads the remote directly), its label (legend, summary table) and its short
    name (epoch table, summary lines)."""

    key: str
    policy: str | None
    label: str
    name: str


#: The baseline first: every speed-up the demo prints is against it.
RUNS = (
    RunSpec("remote", None, "remote directly (no shadefs), uniform sampling", "remote directly"),
    RunSpec("uniform", "epoch", "shadefs: uniform sampling, epoch policy", "shadefs uniform"),
    RunSpec(
        "shade", "shade", f"shadefs: ShadeSampler (replay {REPLAY}), shade policy", "ShadeSampler"
    ),
)


@dataclass
class _Mounts:
    """Every mount point the demo made (or was making), innermost last."""

    points: list[tuple[Path, str]] = field(default_factory=list)

    def add(self, path: Path, kind: str) -> None:
        # Recorded before the mount command runs: an interrupt while it runs must still
        # leave a record for the clean-up to check.
        self.points.append((path, kind))

    def release(self, path: Path) -> None:
        for i, (p, kind) in enumerate(self.points):
            if p == path:
                _unmount(p, kind)
                del self.points[i]
                return

    def release_all(self) -> list[str]:
        problems = []
        while self.points:
            path, kind = self.points.pop()
            if not _unmount(path, kind):
                problems.append(str(path))
        return problems


def mounted_under(root: str | os.PathLike[str]) -> list[str]:
    """Mount points at or below ``root`` (from /proc/self/mounts; dead FUSE mounts too)."""
    base = os.path.realpath(root)
    found = []
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split()
        if len(parts) < 2:
            continue
        # /proc/mounts escapes space, tab, newline and backslash as octal.
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[1])
        if point == base or point.startswith(base + os.sep):
            found.append(point)
    return found


def _is_mounted(path: Path) -> bool:
    return os.path.realpath(path) in mounted_under(path)


def _unmount(path: Path, kind: str) -> bool:
    """Unmount ``path`` if it is mounted; True when it is gone."""
    if not _is_mounted(path):
        return True
    if kind == "shadefs":
        cmd = [sys.executable, "-m", "shadefs", "umount", str(path)]
    else:
        cmd = ["fusermount3", "-u", str(path)]
    try:
        subprocess.run(cmd, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        pass
    if _is_mounted(path):
        # A daemon that does not answer: detach lazily so the demo never leaves it behind.
        subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)
    gone = not _is_mounted(path)
    if not gone:
        print(f"shadefs demo: could not unmount {path}", file=sys.stderr)
    return gone


class Interrupted(BaseException):
    """Raised by the demo's signal handlers; unwinds the demo like Ctrl-C would.

    Not KeyboardInterrupt: CPython can remember a KeyboardInterrupt that crossed certain
    frames and then exit by killing itself with SIGINT although the demo handled it
    (seen as exit status -2 instead of 130 in about one run in three).
    """


@contextlib.contextmanager
def _signals_raise(received: list[str]) -> Iterator[None]:
    """Turn SIGINT, SIGTERM and SIGHUP into ``Interrupted`` while the demo runs.

    The signal's name is also appended to ``received``: an exception raised inside an
    import or a descriptor's ``__set_name__`` reaches the caller wrapped in another type
    (torch imports lazily during the first training steps), and the demo must still
    report an interruption, not an error.
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        raise Interrupted(received[-1])

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """A second Ctrl-C must not abort the clean-up half-way."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _mount_shadefs(mounts: _Mounts, source: Path, mnt: Path, log_dir: Path, *args: str) -> None:
    mnt.mkdir(parents=True, exist_ok=True)
    mounts.add(mnt, "shadefs")
    log_file = log_dir / f"{mnt.name}.log"
    cmd = [sys.executable, "-m", "shadefs", "mount", str(source), str(mnt), "--log", str(log_file)]
    res = subprocess.run([*cmd, *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"shadefs mount failed: {res.stderr.strip()} (log: {log_file})")


def _mount_slowfs(mounts: _Mounts, source: Path, mnt: Path, log_dir: Path) -> None:
    mnt.mkdir(parents=True, exist_ok=True)
    mounts.add(mnt, "slowfs")
    log_file = log_dir / "slowfs.log"
    cmd = [sys.executable, "-m", "shadefs.demo.slowfs", str(source), str(mnt), "--daemon"]
    cmd += SLOWFS_ARGS
    res = subprocess.run([*cmd, "--log", str(log_file)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"slowfs failed: {res.stderr.strip()} (log: {log_file})")


def _split_dataset(root: Path) -> tuple[str, str | None]:
    """(train dir relative to root, test dir or None) of a user's ImageFolder tree."""
    if (root / "train").is_dir():
        return "train", ("test" if (root / "test").is_dir() else None)
    return ".", None


def _print_epoch(key: str, rec: EpochRecord) -> None:
    print(report.epoch_line(key, rec), flush=True)


def run_demo(args: argparse.Namespace) -> int:
    """Entry point of ``shadefs demo``; returns the exit code (130 when interrupted)."""
    needed = ("torch", "torchvision", "PIL", "matplotlib")
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    dataset = getattr(args, "dataset", None)
    if dataset is None and importlib.util.find_spec("sklearn") is None:
        missing.append("scikit-learn")
    if missing:
        print(
            f"shadefs demo needs {', '.join(missing)}: pip install 'shadefs[torch]' scikit-learn",
            file=sys.stderr,
        )
        return 1
    epochs = int(getattr(args, "epochs", 5) or 5)
    if epochs < 1:
        print("shadefs demo: --epochs must be at least 1", file=sys.stderr)
        return 2
    own_workdir = getattr(args, "workdir", None) is None
    workdir = Path(tempfile.mkdtemp(prefix="shadefs-demo-") if own_workdir else args.workdir)
    workdir = workdir.resolve()
    plot = (Path.cwd() if own_workdir else workdir) / PLOT_NAME
    mounts = _Mounts()
    started = time.monotonic()
    received: list[str] = []
    try:
        with _signals_raise(received):
            _run(args, dataset, epochs, workdir, mounts, plot)
        print(f"demo finished in {time.monotonic() - started:.0f} s")
        return 0
    except BaseException as exc:
        # After a signal, whatever came out of the unwinding is the interruption.
        if received or isinstance(exc, KeyboardInterrupt):
            print("\nshadefs demo: interrupted; unmounting", file=sys.stderr)
            return 130
        if isinstance(exc, (RuntimeError, OSError)):
            print(f"shadefs demo: error: {exc}", file=sys.stderr)
            return 1
        raise  # a bug: its traceback shows, after the clean-up below
    finally:
        with _signals_ignored():
            left = mounts.release_all()
            if own_workdir and not left:
                shutil.rmtree(workdir, ignore_errors=True)
        if left:
            print(f"shadefs demo: still mounted: {', '.join(left)}", file=sys.stderr)


def _run(
    args: argparse.Namespace,
    dataset: str | None,
    epochs: int,
    workdir: Path,
    mounts: _Mounts,
    plot: Path,
) -> None:
    import torch

    from shadefs.demo import digits

    log_dir = workdir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    test_rel: str | None
    if dataset is None:
        print("building scikit-learn's digits as an ImageFolder ...", flush=True)
        data = digits.build_digits(workdir / "digits")
        train_rel, test_rel = "train", "test"
    else:
        data = Path(dataset).resolve()
        train_rel, test_rel = _split_dataset(data)
    train_bytes = digits.tree_bytes(data / train_rel)
    ram = max(1, int(train_bytes * RAM_FRACTION))

    source = workdir / "remote"
    _mount_slowfs(mounts, data, source, log_dir)
    what = "slowfs " + " ".join(SLOWFS_ARGS)
    print(f"source: {data} behind shadefs.demo.slowfs ({what}: an emulated slow remote)")
    print(
        f"training data {train_bytes / 1e6:.1f} MB; shadefs RAM {ram / 1e6:.2f} MB "
        f"({RAM_FRACTION:.0%}); {epochs} epochs per run",
        flush=True,
    )

    # Leave a core to the daemon: on a small machine it and the model share the CPUs.
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    runs: list[Run] = []
    for spec in RUNS:
        if spec.policy is None:
            # The baseline: the same loop over the remote's own mount, nothing in between.
            mnt = None
            train_dir = source / train_rel
        else:
            mnt = workdir / f"mnt-{spec.key}"
            kernel_hits = getattr(args, "kernel_hits", "off")
            opts = ("--ram", str(ram), "--policy", spec.policy, "--kernel-hits", kernel_hits)
            _mount_shadefs(mounts, source, mnt, log_dir, *opts)
            train_dir = mnt / train_rel
        print(f"{spec.label}:", flush=True)
        records = digits.train(
            train_dir,
            # Evaluation reads the dataset directly, so it does not touch the cache.
            data / test_rel if test_rel else None,
            sampler="shade" if spec.key == "shade" else "uniform",
            epochs=epochs,
            replay=REPLAY if spec.key == "shade" else None,
            on_epoch=functools.partial(_print_epoch, spec.key),
        )
        runs.append(Run(spec.key, spec.label, records, spec.name))
        if mnt is not None:
            mounts.release(mnt)

    print()
    tables = [*report.epoch_table(runs), "", *report.summary_table(runs)]
    for line in [*tables, *report.summary_lines(runs)]:
        print(line)
    name = "digits" if dataset is None else data.name
    title = f"shadefs demo: {name}, RAM {RAM_FRACTION:.0%} of the training bytes, source {what}"
    try:
        write_plot(runs, plot, title)
    except OSError as exc:
        print(f"could not write the plot {plot}: {exc.strerror or exc}", file=sys.stderr)
    else:
        print(f"plot: {plot}")
