"""``shadefs demo`` end to end: it runs, prints its table, writes its plot, and never leaves
a mount behind, whether it finishes or is interrupted (Ctrl-C, SIGTERM) half-way.

The demo runs as a real subprocess through the CLI, with a one-epoch setting.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import require_fuse

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    pytest.importorskip("sklearn")

from shadefs.demo.plot import SIZE, mean_epoch_time  # noqa: E402
from shadefs.demo.run import PLOT_NAME, mounted_under  # noqa: E402

pytestmark = [pytest.mark.mount, pytest.mark.torch]


@pytest.fixture(scope="module")
def digits_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shadefs.demo.digits import build_digits

    return build_digits(tmp_path_factory.mktemp("digits") / "digits")


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


@dataclass
class _Epoch:
    epoch: int
    hit_ratio: float | None
    test_accuracy: float
    epoch_time: float
    hits: int | None = None
    misses: int | None = None


def test_plot_is_written_headless_without_pyplot(tmp_path: Path) -> None:
    # In a fresh interpreter: pyplot would pick a GUI backend and keep global state.
    script = (
        "import sys, math\n"
        "from pathlib import Path\n"
        "from shadefs.demo.plot import Run, write_plot\n"
        "from types import SimpleNamespace as E\n"
        "def ep(i, h, a, t):\n"
        "    return E(epoch=i, hit_ratio=h, test_accuracy=a, epoch_time=t, hits=1, misses=1)\n"
        "runs = [Run('uniform', 'uniform', [ep(0, 0.0, 0.5, 8.0), ep(1, 0.2, 0.9, 7.0)]),\n"
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
    epochs = [_Epoch(0, 0.0, 0.5, 9.0), _Epoch(1, 0.2, 0.9, 2.0), _Epoch(2, 0.2, 0.9, 4.0)]
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
        for label in ("uniform sampling, epoch policy", "ShadeSampler (replay 3), shade policy"):
            assert out.count(label) == 2, out  # its epochs, and its line of the summary
        assert "epoch  2: hit ratio" in out, out
        assert "hit ratio after the first epoch" in out, out
        assert "time per epoch after the first: uniform" in out, out
        from PIL import Image

        with Image.open(work / PLOT_NAME) as img:
            assert img.format == "PNG" and img.size == SIZE
    finally:
        left = mounted_under(work)
        for m in left:
            subprocess.run(["fusermount3", "-u", "-z", m], capture_output=True)
    assert left == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_demo_unmounts_when_interrupted(
    tmp_path: Path, digits_tree: Path, signum: signal.Signals
) -> None:
    require_fuse()
    work = workdir_with_digits(tmp_path, digits_tree)
    # Its own session, so the signal goes to the demo's process group like a Ctrl-C from
    # its terminal, and nothing else.
    proc = subprocess.Popen(
        demo_cmd(work, 5),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        # Wait until it is training on its first shadefs mount (slowfs is under it).
        while not any(p.endswith("mnt-uniform") for p in mounted_under(work)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the demo never mounted"
            time.sleep(0.2)
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
