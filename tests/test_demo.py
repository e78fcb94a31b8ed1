"""``shadefs demo`` end to end: it runs, prints its table, writes its plot, and never leaves
a mount behind, whether it finishes or is interrupted (Ctrl-C, SIGTERM) half-way.

The demo runs as a real subprocess through the CLI, with a short setting. Its first run,
the baseline, reads the emulated remote directly; its time must be measured by the training
loop as it reads the remote, never copied from another run or made up.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import poll, require_fuse
from tests.test_demo_report import FakeEpoch

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    pytest.importorskip("sklearn")

from shadefs.demo.plot import SIZE, mean_epoch_time  # noqa: E402
from shadefs.demo.run import PLOT_NAME, SLOWFS_ARGS, mounted_under  # noqa: E402

pytestmark = [pytest.mark.mount, pytest.mark.torch]


@pytest.fixture(scope="module")
def digits_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shadefs.demo.digits import build_digits

    return build_digits(tmp_path_factory.mktemp("digits") / "digits")


def small_dataset(digits_tree: Path, dest: Path, per_class: int) -> Path:
    """A user's ImageFolder (train/ and test/) with ``per_class`` images of each digit."""
    for split in ("train", "test"):
        for cls in sorted((digits_tree / split).iterdir()):
            (dest / split / cls.name).mkdir(parents=True)
            for png in sorted(cls.iterdir())[:per_class]:
                shutil.copy(png, dest / split / cls.name / png.name)
    return dest


def open_latency_s() -> float:
    return float(SLOWFS_ARGS[SLOWFS_ARGS.index("--open-latency") + 1]) / 1e3


def table_columns(out: str) -> dict[str, list[list[str]]]:
    """The printed epoch table: run name -> one list of cells per epoch."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("epoch ") and "|" in line)
    names = [n.strip() for n in lines[at - 1].split("|")]
    columns: dict[str, list[list[str]]] = {n: [] for n in names}
    for row in lines[at + 2 :]:
        if not row.strip():
            break
        for name, group in zip(names, row[6:].split("|"), strict=True):
            columns[name].append(group.split())
    return columns


def workdir_with_digits(tmp_path: Path, digits_tree: Path) -> Path:
    """A work directory that already holds the digits tree (the demo reuses it)."""
    work = tmp_path / "work"
    shutil.copytree(digits_tree, work / "digits")
    return work


def demo_cmd(work: Path, epochs: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "shadefs",
        "demo",
        "--epochs",
        str(epochs),
        "--workdir",
        str(work),
    ]


def test_plot_is_written_headless_without_pyplot(tmp_path: Path) -> None:
    # In a fresh interpreter: pyplot would pick a GUI backend and keep global state.
    script = (
        "import sys, math\n"
        "from pathlib import Path\n"
        "from shadefs.demo.plot import Run, write_plot\n"
        "from types import SimpleNamespace as E\n"
        "def ep(i, h, a, t):\n"
        "    n = None if h is None else 1\n"
        "    return E(epoch=i, hit_ratio=h, test_accuracy=a, epoch_time=t, hits=n, misses=n,\n"
        "             kernel_hits=None)\n"
        "runs = [Run('remote', 'remote', [ep(0, None, 0.5, 9.0), ep(1, None, 0.9, 9.0)]),\n"
        "        Run('uniform', 'uniform', [ep(0, 0.0, 0.5, 8.0), ep(1, 0.2, 0.9, 7.0)]),\n"
        "        Run('shade', 'shade', [ep(0, 0.0, math.nan, 8.0), ep(1, None, 0.9, 1.0)])]\n"
        "write_plot(runs, Path(sys.argv[1]), 'title')\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
    )
    out = tmp_path / "plot.png"
    env = {**os.environ, "DISPLAY": "", "MPLBACKEND": ""}
    res = subprocess.run([sys.executable, "-c", script, str(out)], env=env, capture_output=True)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    from PIL import Image

    with Image.open(out) as img:
        assert img.format == "PNG" and img.size == SIZE


def test_mean_epoch_time_leaves_out_the_cold_first_epoch() -> None:
    epochs = [FakeEpoch(0, 0.0, 0.5, 9.0), FakeEpoch(1, 0.2, 0.9, 2.0), FakeEpoch(2, 0.2, 0.9, 4.0)]
    assert mean_epoch_time(epochs) == 3.0
    assert mean_epoch_time(epochs[:1]) == 9.0


def test_demo_runs_and_leaves_no_mount(tmp_path: Path, digits_tree: Path) -> None:
    require_fuse()
    work = workdir_with_digits(tmp_path, digits_tree)
    try:
        res = subprocess.run(demo_cmd(work, 2), capture_output=True, text=True, timeout=400)
        out = res.stdout
        assert res.returncode == 0, res.stderr[-3000:]
        assert "source:" in out
        for label in (
            "remote directly (no shadefs), uniform sampling",
            "shadefs: uniform sampling, epoch policy",
            "shadefs: ShadeSampler (replay 3), shade policy",
        ):
            assert out.count(label) == 2, out  # its epochs, and its line of the summary
        assert "  remote   epoch  2: hit ratio   n/a" in out, out
        assert "  shade    epoch  2: hit ratio" in out, out
        assert "hit ratio after the first epoch" in out, out
        assert "time per epoch after the first: remote directly " in out, out
        columns = table_columns(out)
        assert list(columns) == ["remote directly", "shadefs uniform", "ShadeSampler"]
        # The baseline's row: accuracy and time, no hit ratio.
        assert [len(cells) for cells in columns["remote directly"]] == [2, 2]
        # Measured while reading the remote: a serial reader that opened every training file
        # on a remote charging a fixed sleep per open cannot have been faster than that sum
        # (a lower bound: a loaded machine only makes the epoch longer).
        files = sum(1 for _ in (work / "digits" / "train").rglob("*.png"))
        for cells in columns["remote directly"]:
            assert float(cells[1]) >= round(files * open_latency_s(), 1), out
        from PIL import Image

        with Image.open(work / PLOT_NAME) as img:
            assert img.format == "PNG" and img.size == SIZE
    finally:
        left = mounted_under(work)
        for m in left:
            subprocess.run(["fusermount3", "-u", "-z", m], capture_output=True)
    assert left == []


#: The demo with its training loop wrapped: each run's records come back with a distinct
#: offset added to their measured times, so that the printed figures tell whose they are.
_WRAPPED_DEMO = """
import json, sys
from shadefs.cli import main
from shadefs.demo import digits
from shadefs.torch import find_mount

real_train, calls = digits.train, []

def train(train_dir, test_dir, **kwargs):
    records = real_train(train_dir, test_dir, **kwargs)
    offset = 1000.0 * (len(calls) + 1)
    calls.append({
        "train_dir": str(train_dir), "test_dir": str(test_dir),
        "on_shadefs": find_mount(train_dir) is not None,
        "kwargs": {k: v for k, v in kwargs.items() if k != "on_epoch"},
        "measured": [r.epoch_time for r in records], "offset": offset,
    })
    for r in records:
        r.epoch_time += offset
    return records

digits.train = train
rc = main(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    json.dump(calls, f)
sys.exit(rc)
"""


def test_the_baselines_time_is_its_own_training_loops(tmp_path: Path, digits_tree: Path) -> None:
    """A user's dataset gets the three runs, and each printed time is the one that the
    training loop measured for that run: the baseline's, read from the remote directly,
    is neither another run's nor a constant (each run's carries a different offset)."""
    require_fuse()
    data = small_dataset(digits_tree, tmp_path / "mydata", per_class=8)
    work = tmp_path / "work"
    calls_file = tmp_path / "calls.json"
    cmd = [sys.executable, "-c", _WRAPPED_DEMO, str(calls_file)]
    cmd += ["demo", "--dataset", str(data), "--epochs", "2", "--workdir", str(work)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
        out = res.stdout
        assert res.returncode == 0, res.stderr[-3000:]
    finally:
        left = mounted_under(work)
        for m in left:
            subprocess.run(["fusermount3", "-u", "-z", m], capture_output=True)
    assert left == []
    remote, uniform, shade = json.loads(calls_file.read_text())
    # The baseline read the remote's own mount, the other two a shadefs mount above it; the
    # same loop, sampler, epochs and test set as the uniform run.
    assert not remote["on_shadefs"] and uniform["on_shadefs"] and shade["on_shadefs"]
    assert Path(remote["train_dir"]) == work.resolve() / "remote" / "train"
    assert remote["kwargs"] == uniform["kwargs"] and remote["test_dir"] == uniform["test_dir"]
    files = sum(1 for _ in (data / "train").rglob("*.png"))
    assert min(remote["measured"]) >= files * open_latency_s()

    def shown(call: dict[str, Any]) -> list[str]:
        return [f"{t + call['offset']:.1f}" for t in call["measured"]]

    columns = table_columns(out)
    assert [cells[-1] for cells in columns["remote directly"]] == shown(remote), out
    assert [cells[-1] for cells in columns["shadefs uniform"]] == shown(uniform), out
    assert [cells[-1] for cells in columns["ShadeSampler"]] == shown(shade), out
    # The line printed as each epoch ended has the loop's own figure (before the offset).
    for epoch, t in enumerate(remote["measured"]):
        assert f"  remote   epoch {epoch + 1:2d}: hit ratio   n/a" in out
        assert f"time {t:5.1f} s  misses   n/a" in out, out
    # The summary's baseline: epoch 2's time (the only one after the first).
    base = remote["measured"][1] + remote["offset"]
    assert f"after the first: remote directly {base:.1f} s, shadefs uniform" in out, out


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_demo_unmounts_when_interrupted(
    tmp_path: Path, digits_tree: Path, signum: signal.Signals
) -> None:
    require_fuse()
    work = workdir_with_digits(tmp_path, digits_tree)
    # Its own session, so the signal goes to the demo's process group like a Ctrl-C from
    # its terminal, and nothing else.
    proc = subprocess.Popen(
        # Two epochs: long enough to be interrupted in the uniform run, which comes after
        # the baseline's (reading the remote directly, every epoch at the remote's pace).
        demo_cmd(work, 2),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        # Wait until it is training on its first shadefs mount (slowfs is under it).
        mounted = lambda: any(p.endswith("mnt-uniform") for p in mounted_under(work))  # noqa: E731
        poll(mounted, "the demo never mounted", 120, interval=0.2, alive=proc)
        time.sleep(1.0)
        assert len(mounted_under(work)) >= 1
        os.killpg(proc.pid, signum)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err[-3000:]
        assert "interrupted" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        left = mounted_under(work)
        for m in left:
            subprocess.run(["fusermount3", "-u", "-z", m], capture_output=True)
    assert left == []
