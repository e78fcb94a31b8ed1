"""`shadefs stat --watch`: rates from two snapshots, the live view, the plain line, endings."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from shadefs.common import EXIT_NOT_SHADEFS, QuietError
from shadefs.ops import watch
from shadefs.stats import RestoreStats, Stats
from tests.conftest import drop_kernel_pages, make_tree
from tests.sample_stats import full, minimal, with_counters

BEFORE = replace(minimal(), uptime_s=3700)
BEFORE = replace(
    with_counters(BEFORE, hits=100, misses=50, bytes_served=10 << 20),
    source=replace(BEFORE.source, bytes_read=5 << 20, healthy=True, timeouts=0, errors=0),
    cache=replace(BEFORE.cache, ram=replace(BEFORE.cache.ram, bytes=4 << 30, capacity=16 << 30)),
)


def after(s: Stats = BEFORE) -> Stats:
    s = with_counters(s, hits=300, misses=70, bytes_served=110 << 20)
    return replace(s, source=replace(s.source, bytes_read=25 << 20))


def text(prev: Stats | None, cur: Stats, dt: float) -> str:
    """The live view as the plain text a terminal would show, lines stripped."""
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(watch.view(prev, cur, dt))
    return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines())


def test_the_view_computes_rates_over_the_interval() -> None:
    t = text(BEFORE, after(), 2.0)
    assert re.search(r"opens\s+110\.0/s\s+370", t)
    assert re.search(r"hits\s+100\.0/s\s+300", t)
    assert re.search(r"misses\s+10\.0/s\s+70", t)
    # 200 hits of 220 opens in the interval; 300 of 370 overall.
    assert re.search(r"hit ratio\s+0\.909\s+0\.811", t)
    assert re.search(r"served\s+50\.0 MiB/s\s+110\.0 MiB", t)
    assert re.search(r"from source\s+10\.0 MiB/s\s+25\.0 MiB", t)
    assert re.search(r"ram\s+4\.0 GiB\s+16\.0 GiB\s+\S+\s+25\.0%\s+3\s+0\.0", t)
    assert "source    healthy   timeouts 0  errors 0" in t
    assert "up 1h01m  policy lru" in t
    for absent in ("ssd", "restore", "prefetch", "sampler"):
        assert absent not in t


def test_kernel_hits_count_as_hits_and_tier_hits_stay_on_their_own() -> None:
    # 220 opens in the interval: 200 tier hits, 20 misses of which the kernel served 15
    # from its pages (deferred opens released unread).
    cur = with_counters(after(), kernel_hits=15)
    t = text(BEFORE, cur, 2.0)
    assert re.search(r"hits\s+100\.0/s\s+300", t)  # the tiers' hits, as before
    assert re.search(r"kernel hits\s+7\.5/s\s+15", t)
    assert re.search(r"hit ratio\s+0\.977\s+0\.851", t)  # 215/220; 315/370
    assert cur.hit_ratio == 315 / 370 and cur.to_json()["hit_ratio"] == 315 / 370
    # Released after the interval that opened them: never above 1.
    late = with_counters(after(), misses=50, kernel_hits=30)
    assert "hit 1.000" in watch.render_line(BEFORE, late, 2.0)


def test_the_view_shows_every_section_the_mount_has() -> None:
    prev = full()
    ssd = prev.cache.ssd
    assert ssd is not None
    cur = replace(
        with_counters(full(), hits=230, misses=30),
        source=replace(prev.source, timeouts=7),
        cache=replace(
            prev.cache,
            ram=replace(prev.cache.ram, hits=220),
            ssd=replace(ssd, hits=12, restore=RestoreStats(done=False, entries=500, seconds=0)),
        ),
    )
    t = text(prev, cur, 2.0)
    assert re.search(r"ram\s+1000 B\s+4\.0 KiB .* 24\.4%\s+3\s+100\.0", t)
    assert re.search(r"ssd\s+8\.8 KiB\s+87\.9 KiB .* 10\.0%\s+8\s+1\.0", t)
    assert "NOT ANSWERING   timeouts 7, 4 this interval" in t
    assert "restore   in progress, 500 entries" in t
    assert "prefetch  plans 1  staged 5 (500 B)  inflight 2  fetched 40 (0 B/s)" in t
    assert "sampler   100 samples  epoch 3  replay 2.5 (auto)" in t
    assert re.search(r"pid:4242\s+sweep\s+3\s+0\.0\s+0\.750\s+156\.2 KiB\s+2 s", t)


def test_the_view_shows_each_jobs_rate() -> None:
    prev = full()
    (job,) = prev.jobs
    cur = replace(prev, jobs=(replace(job, hits=job.hits + 20),))
    assert re.search(r"pid:4242\s+sweep\s+3\s+10\.0\s+0\.889", text(prev, cur, 2.0))
    assert "pid:4242" not in text(prev, replace(cur, jobs=()), 2.0)  # an expired job


def test_a_section_new_since_the_last_frame_has_no_rate_yet() -> None:
    t = text(BEFORE, full(), 1.0)
    assert re.search(r"ssd\s+8\.8 KiB\s+87\.9 KiB .* 8\s+-$", t, re.M)
    assert "fetched 40 (-)" in t


def test_a_first_frame_or_a_counter_that_went_back_shows_no_rate() -> None:
    assert re.search(r"opens\s+-/s", text(None, BEFORE, 0.0))
    went_back = with_counters(after(), hits=10)  # a restarted daemon with the same pid
    assert re.search(r"hits\s+-/s", text(BEFORE, went_back, 1.0))
    assert watch.render_line(None, BEFORE, 0.0).startswith(
        "opens/s -  hits/s -  kernel hits/s -  hit - (all 0.667)"
    )


def test_render_line_is_one_plain_line() -> None:
    cur = after()
    cur = replace(cur, source=replace(cur.source, healthy=False))
    line = watch.render_line(BEFORE, cur, 2.0)
    assert line == (
        "opens/s 110.0  hits/s 100.0  kernel hits/s 0.0  hit 0.909 (all 0.811)  served 50.0 MiB/s  "
        "source 10.0 MiB/s  ram 25%  source NOT ANSWERING"
    )
    ssd = full().cache.ssd
    assert ssd is not None
    restoring = replace(ssd, restore=RestoreStats(done=False, entries=12, seconds=0))
    s = replace(full(), cache=replace(full().cache, ssd=restoring))
    assert watch.render_line(None, s, 0.0).endswith(
        "ram 24%  ssd 10%  source NOT ANSWERING  restoring 12"
    )


def test_every_field_the_view_reads_is_in_the_schema() -> None:
    # The view reads the typed object (checked by mypy); drawing every section of a full
    # snapshot against another runs every accessor, so a field the schema lacks fails here.
    for prev, cur in ((full(), full()), (minimal(), full()), (full(), minimal())):
        assert text(prev, cur, 1.0)
        assert watch.render_line(prev, cur, 1.0)


def fake_mount(root: Path, stats: Stats) -> Path:
    """A directory whose .shadefs/stats.json is `stats`: enough for the watch loop."""
    return make_tree(root, {".shadefs/stats.json": json.dumps(stats.to_json()).encode()})


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_view_is_live(tmp_path: Path) -> None:
    out = Tty()
    assert watch.watch(str(fake_mount(tmp_path, BEFORE)), 0.01, iterations=2, out=out) == 0
    t = out.getvalue()
    # Two frames, the second with rates (0 over the interval: the file does not change).
    assert t.count("hit ratio") >= 2  # stopping the live view draws the last frame again
    assert re.search(r"opens\s+-/s", t) and re.search(r"opens\s+0\.0/s", t)
    assert "opens/s" not in t  # not the plain line


def test_off_a_terminal_each_frame_is_one_plain_line(tmp_path: Path) -> None:
    out = io.StringIO()
    assert watch.watch(str(fake_mount(tmp_path, BEFORE)), 0.01, iterations=3, out=out) == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and chr(27) not in out.getvalue()  # no terminal escapes
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d opens/s -  hits/s -", lines[0])
    assert "opens/s 0.0  hits/s 0.0" in lines[2]


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


def test_stats_of_another_format_is_exit_7(tmp_path: Path) -> None:
    old = {k: v for k, v in BEFORE.to_json().items() if k != "tiers"}
    mnt = make_tree(tmp_path, {".shadefs/stats.json": json.dumps(old).encode()})
    with pytest.raises(QuietError) as e:
        watch.watch(str(mnt), 0.01, iterations=1, out=io.StringIO())
    assert e.value.exitcode == EXIT_NOT_SHADEFS
    assert "not in the format" in str(e.value) and "tiers" in str(e.value)


def test_the_daemon_does_not_import_rich() -> None:
    code = (
        "import sys, shadefs.daemon, shadefs.control.files, shadefs.ops.prom, shadefs.stats; "
        "sys.exit('rich' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.mount
def test_watch_a_real_mount_then_lose_it(tmp_path: Path, mounter) -> None:
    src = make_tree(tmp_path / "src", {"a.bin": b"a" * 1000, "b.bin": b"b" * 2000})
    m = mounter(src, "--ram", "1M")
    for name in ("a.bin", "b.bin", "a.bin"):
        drop_kernel_pages()  # (with kernel hits, the kernel would serve the third read)
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
