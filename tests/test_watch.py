"""`shadefs stat --watch`: rates from two snapshots, line and terminal output, endings."""

from __future__ import annotations

import copy
import io
import json
import re
from pathlib import Path

import pytest

from shadefs.common import EXIT_NOT_SHADEFS, QuietError
from shadefs.ops import watch
from tests.conftest import make_tree

BEFORE = {
    "pid": 7,
    "source": "/nfs/imagenet",
    "mountpoint": "/mnt/shade",
    "uptime_s": 3700,
    "policy": "epoch",
    "hits": 100,
    "misses": 50,
    "bytes_served": 10 << 20,
    "bytes_from_source": 5 << 20,
    "ram_bytes": 4 << 30,
    "ram_capacity": 16 << 30,
    "files_cached": 1200,
    "source_healthy": True,
    "source_timeouts": 0,
    "source_errors": 0,
}


def after(**changes: object) -> dict:
    d = copy.deepcopy(BEFORE)
    d.update(hits=300, misses=70, bytes_served=110 << 20, bytes_from_source=25 << 20)
    d.update(changes)
    return d


def test_render_computes_rates_over_the_interval() -> None:
    text = watch.render(BEFORE, after(), 2.0)
    assert re.search(r"opens\s+110\.0/s\s+hits\s+100\.0/s\s+misses\s+10\.0/s", text)
    # 200 hits of 220 opens in the interval; 300 of 370 overall.
    assert re.search(r"hit ratio\s+0\.909 now\s+0\.811 overall", text)
    assert re.search(r"served\s+50\.0 MiB/s\s+from source\s+10\.0 MiB/s", text)
    assert re.search(r"ram\s+4\.0 GiB of 16\.0 GiB\s+\[#####\.{15}\]\s+25\.0%\s+1200 files", text)
    assert "source    healthy" in text
    for absent in ("ssd", "restore", "prefetch", "jobs", "sampler"):
        assert absent not in text


def test_render_shows_every_section_the_daemon_reports() -> None:
    cur = after(
        source_healthy=False,
        source_timeouts=4,
        tiers={
            "ram": {"hits": 250, "bytes": 1 << 30, "capacity": 2 << 30, "entries": 10},
            "ssd": {"hits": 50, "bytes": 30 << 30, "capacity": 40 << 30, "entries": 90},
        },
        restore={"done": False, "entries": 500},
        prefetch={"queued": 12, "inflight": 3},
        jobs={"train": {"hits": 30, "misses": 10}, "sweep": {"hits": 270, "misses": 60}},
    )
    prev = copy.deepcopy(BEFORE) | {
        "tiers": {"ram": {"hits": 50}, "ssd": {"hits": 50}},
        "jobs": {"train": {"hits": 10, "misses": 10}},
    }
    text = watch.render(prev, cur, 2.0)
    assert re.search(r"ram\s+1\.0 GiB of 2\.0 GiB .* 50\.0%\s+10 files\s+100\.0 hits/s", text)
    assert re.search(r"ssd\s+30\.0 GiB of 40\.0 GiB .* 75\.0%\s+90 files\s+0\.0 hits/s", text)
    assert "NOT ANSWERING   timeouts 4, 4 this interval" in text
    assert "restore   in progress: 500 entries so far" in text
    assert "prefetch  queued 12  inflight 3" in text
    assert re.search(r"train\s+hits\s+10\.0/s\s+misses\s+0\.0/s\s+hit ratio 1\.000 now", text)
    assert re.search(r"sweep\s+hits\s+-/s", text)  # a job new since the last frame: no rate yet


def test_a_first_frame_or_a_counter_that_went_back_shows_no_rate() -> None:
    assert re.search(r"opens\s+-/s", watch.render(None, BEFORE, 0.0))
    went_back = after(hits=10)  # a restarted daemon with the same pid cannot go negative
    assert re.search(r"hits\s+-/s", watch.render(BEFORE, went_back, 1.0))
    assert watch.render_line(None, BEFORE, 0.0).startswith("opens/s -  hits/s -  hit - (all 0.667)")


def test_render_line_is_one_compact_line() -> None:
    line = watch.render_line(BEFORE, after(source_healthy=False), 2.0)
    assert "\n" not in line
    assert line == (
        "opens/s 110.0  hits/s 100.0  hit 0.909 (all 0.811)  served 50.0 MiB/s  "
        "source 10.0 MiB/s  ram 25%  source NOT ANSWERING"
    )


def fake_mount(root: Path, stats: dict) -> Path:
    """A directory whose .shadefs/stats.json is `stats`: enough for the watch loop."""
    return make_tree(root, {".shadefs/stats.json": json.dumps(stats).encode()})


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_view_is_redrawn_in_place(tmp_path: Path) -> None:
    out = Tty()
    assert watch.watch(str(fake_mount(tmp_path, BEFORE)), 0.01, iterations=2, out=out) == 0
    text = out.getvalue()
    assert text.startswith("\x1b[H\x1b[2J")
    frames = text.split("\x1b[H")[2:]
    assert len(frames) == 2 and all(f.endswith("\x1b[J") for f in frames)
    assert "opens           0.0/s" in frames[1]


def test_ctrl_c_ends_the_watch_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupt(_: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(watch.time, "sleep", interrupt)
    out = io.StringIO()
    assert watch.watch(str(fake_mount(tmp_path, BEFORE)), 5.0, out=out) == 0
    assert len(out.getvalue().splitlines()) == 1


def test_not_a_mount_is_exit_7(tmp_path: Path) -> None:
    with pytest.raises(QuietError) as e:
        watch.watch(str(tmp_path), 0.01, iterations=1, out=io.StringIO())
    assert e.value.exitcode == EXIT_NOT_SHADEFS
    assert "not a shadefs mount" in str(e.value)


@pytest.mark.mount
def test_watch_a_real_mount_then_lose_it(tmp_path: Path, mounter) -> None:
    src = make_tree(tmp_path / "src", {"a.bin": b"a" * 1000, "b.bin": b"b" * 2000})
    m = mounter(src, "--ram", "1M")
    for name in ("a.bin", "b.bin", "a.bin"):
        (m.mnt / name).read_bytes()
    out = io.StringIO()
    assert watch.watch(str(m.mnt), 0.05, iterations=2, out=out) == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert "hits/s -" in lines[0] and "(all 0.333)" in lines[0]
    assert "hits/s 0.0" in lines[1] and "source ok" in lines[1]

    class UnmountAfterFirstLine(io.StringIO):
        def write(self, s: str) -> int:
            n = super().write(s)
            if s.endswith("\n"):
                m.unmount()
            return n

    with pytest.raises(QuietError) as e:
        watch.watch(str(m.mnt), 0.01, out=UnmountAfterFirstLine())
    assert e.value.exitcode == EXIT_NOT_SHADEFS
