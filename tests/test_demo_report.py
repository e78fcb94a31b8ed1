"""What ``shadefs demo`` prints about its runs (``shadefs.demo.report``), without a mount.

The baseline (the training reading the remote directly) is the first run: it has no hit
ratio, and every speed-up is against its own time.
"""

from __future__ import annotations

from dataclasses import dataclass

from shadefs.demo.plot import Run
from shadefs.demo.report import epoch_line, epoch_table, summary_lines, summary_table


@dataclass
class FakeEpoch:
    """An epoch record without torch (shadefs.demo.digits.EpochRecord imports it)."""

    epoch: int
    hit_ratio: float | None
    test_accuracy: float
    epoch_time: float
    hits: int | None = None
    misses: int | None = None
    kernel_hits: int | None = None


def _runs(times: tuple[list[float], list[float], list[float]]) -> list[Run]:
    remote, uniform, shade = times
    return [
        Run(
            "remote",
            "remote directly (no shadefs), uniform sampling",
            [FakeEpoch(i, None, 0.8 + i / 100, t) for i, t in enumerate(remote)],
            "remote directly",
        ),
        Run(
            "uniform",
            "shadefs: uniform sampling, epoch policy",
            [FakeEpoch(i, 0.2, 0.8 + i / 100, t, 20, 80) for i, t in enumerate(uniform)],
            "shadefs uniform",
        ),
        Run(
            "shade",
            "shadefs: ShadeSampler (replay 3), shade policy",
            [FakeEpoch(i, 0.6, 0.9, t, 60, 40) for i, t in enumerate(shade)],
            "ShadeSampler",
        ),
    ]


def test_the_baseline_is_the_first_group_of_the_epoch_table_without_a_hit_ratio() -> None:
    lines = epoch_table(_runs(([9.1, 8.2], [4.3, 3.4], [2.5, 1.6])))
    names, head, _rule, *rows = lines
    assert [n.strip() for n in names.split("|")] == [
        "remote directly",
        "shadefs uniform",
        "ShadeSampler",
    ]
    groups = [g.split() for g in head.removeprefix("epoch").split("|")]
    assert groups[0] == ["accuracy", "time", "(s)"]
    assert groups[1] == groups[2] == ["hit", "ratio", "accuracy", "time", "(s)"]
    # Every run's cells are its own epochs' figures, not another run's.
    cells = [[g.split() for g in row[6:].split("|")] for row in rows]
    assert [c[0] for c in cells] == [["0.800", "9.1"], ["0.810", "8.2"]]
    assert [c[1][2] for c in cells] == ["4.3", "3.4"]
    assert [c[2][2] for c in cells] == ["2.5", "1.6"]


def test_the_summary_says_n_a_for_the_baselines_hit_ratios() -> None:
    head1, head2, remote, uniform, shade = summary_table(_runs(([9.0, 8.0], [4, 4], [2, 2])))
    assert remote.split()[-4:] == ["n/a", "n/a", "0.810", "8.5"]
    assert uniform.split()[-4:] == ["0.200", "0.200", "0.810", "4.0"]
    assert shade.split()[-4:] == ["0.600", "0.600", "0.900", "2.0"]


def test_speed_ups_are_against_the_baselines_own_time() -> None:
    lines = summary_lines(_runs(([20.0, 8.0, 8.0], [9.0, 4.0, 4.0], [9.0, 2.0, 2.0])))
    assert lines == [
        "hit ratio after the first epoch: ShadeSampler 3.0x uniform",
        "time per epoch after the first: remote directly 8.0 s, "
        "shadefs uniform 4.0 s (2.0x faster), ShadeSampler 2.0 s (4.0x faster)",
    ]
    # A run slower than the remote is said to be slower, not "0.5x faster".
    slow = summary_lines(_runs(([1.0, 2.0], [1.0, 4.0], [1.0, 1.0])))[-1]
    assert slow.endswith("shadefs uniform 4.0 s (2.0x slower), ShadeSampler 1.0 s (2.0x faster)")


def test_the_baselines_epoch_line_has_no_hit_ratio_and_no_misses() -> None:
    line = epoch_line("remote", FakeEpoch(0, None, 0.797, 7.34))
    assert line == (
        "  remote   epoch  1: hit ratio   n/a  accuracy  0.797  time   7.3 s  misses   n/a"
    )
    line = epoch_line("shade", FakeEpoch(1, 0.601, float("nan"), 1.2, 861, 573))
    assert "hit ratio 0.601  accuracy    n/a" in line and line.endswith("misses   573")
