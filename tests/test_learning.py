"""Learning test: ShadeSampler over the shade policy trains as well as uniform sampling.

scikit-learn's digits as an ImageFolder behind real mounts (RAM = 20% of the training
bytes), the same CNN, optimiser, schedule and number of epochs; the final test accuracy,
averaged over 3 seeds, must be within 1.5 points of uniform sampling's.  Each run gets a
fresh mount so one seed's importance table cannot leak into the next.

About 1-2 minutes on two cores: 3 seeds x 2 samplers x 4 epochs of 1437 images.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import require_fuse

torch = pytest.importorskip("torch") if not os.environ.get("CI") else __import__("torch")
if not os.environ.get("CI"):
    pytest.importorskip("torchvision")
    pytest.importorskip("sklearn")

from shadefs.demo.digits import build_digits, train, tree_bytes  # noqa: E402

pytestmark = [pytest.mark.mount, pytest.mark.torch]

SEEDS = (0, 1, 2)
EPOCHS = 4
TOLERANCE = 0.015


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_digits(tmp_path_factory.mktemp("digits") / "src")


def run(mounter, src: Path, sampler: str, seed: int) -> float:
    policy = "shade" if sampler == "shade" else "epoch"
    ram = tree_bytes(src / "train") // 5
    m = mounter(src, "--policy", policy, "--ram", str(ram), name=f"{sampler}{seed}")
    records = train(
        m.mnt / "train",
        src / "test",  # evaluation reads the source: it must not touch the cache
        sampler=sampler,
        epochs=EPOCHS,
        seed=seed,
        replay=3 if sampler == "shade" else None,
    )
    assert len(records) == EPOCHS and all(r.samples == 1437 for r in records)
    if sampler == "shade":
        stats = m.stats()["sampler"]
        # The run really went through the sampler channel.
        assert stats["samples"] == 1437 and stats["losses_ingested"] == EPOCHS * 1437
        assert stats["reports"] == EPOCHS
    m.unmount()
    return records[-1].test_accuracy


def test_shade_sampler_learns_as_well_as_uniform(digits: Path, mounter) -> None:
    require_fuse()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the other core serves the daemon
    try:
        uniform = [run(mounter, digits, "uniform", s) for s in SEEDS]
        shade = [run(mounter, digits, "shade", s) for s in SEEDS]
    finally:
        torch.set_num_threads(threads)
    mean_u, mean_s = sum(uniform) / len(SEEDS), sum(shade) / len(SEEDS)
    print(f"uniform {uniform} mean {mean_u:.4f}; shade {shade} mean {mean_s:.4f}")
    assert mean_u > 0.9, "the uniform baseline did not learn: the test proves nothing"
    assert mean_s >= mean_u - TOLERANCE
