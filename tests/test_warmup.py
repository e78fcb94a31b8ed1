"""`shadefs warmup`: file selection, reading through a real mount, failures, and --check."""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path

import pytest

from shadefs.common import EXIT_NOT_SHADEFS, EXIT_USAGE, QuietError
from shadefs.ops import warmup
from tests.conftest import make_tree

FILES = {
    "top.txt": b"top\n",
    "a/1.bin": b"1" * 1000,
    "a/2.bin": b"2" * 2000,
    "a/deep/3.bin": b"3" * 3000,
    "b/4.bin": b"4" * 4000,
    "b/5.bin": b"",
    "c/6.bin": b"6" * 600,
    "c/7.bin": b"7" * 700,
}


def main(*argv: str) -> int:
    """`shadefs warmup ARGV` in-process, with QuietError turned into its exit code."""
    parser = argparse.ArgumentParser()
    warmup.add_arguments(parser)
    try:
        return warmup.run(parser.parse_args(list(argv)))
    except QuietError as exc:
        print(f"shadefs: error: {exc}", file=sys.stderr)
        return exc.exitcode


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "src", FILES)


# --- selection (no mount needed: a plain directory stands in for MNT) -----------------------


def rel(root: Path, sel: warmup.Selection) -> list[str]:
    return [os.path.relpath(p, root) for p, _ in sel.files]


def test_the_walk_is_sorted_and_skips_control_links_and_special_files(src: Path) -> None:
    (src / ".shadefs").mkdir()
    (src / ".shadefs" / "stats").write_text("not data")
    (src / "link").symlink_to("a/1.bin")
    (src / "dirlink").symlink_to("a")
    os.mkfifo(src / "fifo")
    sel = warmup.select(str(src), [])
    assert rel(src, sel) == [
        "a/1.bin",
        "a/2.bin",
        "a/deep/3.bin",
        "b/4.bin",
        "b/5.bin",
        "c/6.bin",
        "c/7.bin",
        "top.txt",
    ]
    assert all(size == -1 for _, size in sel.files)  # no stat per file unless asked
    assert sel.errors == []


def test_paths_and_lists_select_files_once_in_order(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(src / "a")
    listing = tmp_path / "list.txt"
    listing.write_bytes(f"c/7.bin\n\n{src}/b/4.bin\na/1.bin\n".encode())
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"top.txt\n")))
    sel = warmup.select(str(src), ["deep", "../c/6.bin"], [str(listing), "-"], sizes=True)
    assert rel(src, sel) == ["a/deep/3.bin", "c/6.bin", "c/7.bin", "b/4.bin", "a/1.bin", "top.txt"]
    assert [size for _, size in sel.files] == [3000, 600, 700, 4000, 1000, 4]


def test_paths_outside_the_mount_are_usage_errors(src: Path, tmp_path: Path) -> None:
    with pytest.raises(QuietError) as e:
        warmup.select(str(src), [str(tmp_path)])
    assert e.value.exitcode == EXIT_USAGE
    listing = tmp_path / "list.txt"
    listing.write_text("a/../../escape\n")
    with pytest.raises(QuietError) as e:
        warmup.select(str(src), [], [str(listing)])
    assert e.value.exitcode == EXIT_USAGE
    with pytest.raises(QuietError) as e:
        warmup.select(str(src), [str(src / ".shadefs")])
    assert e.value.exitcode == EXIT_USAGE
    with pytest.raises(QuietError) as e:
        warmup.select(str(src), [], [str(tmp_path / "no-such-list")])
    assert e.value.exitcode == EXIT_USAGE


def test_a_plain_directory_is_not_a_shadefs_mount(src: Path, capsys) -> None:
    assert main(str(src)) == EXIT_NOT_SHADEFS
    assert "not a shadefs mount" in capsys.readouterr().err


def test_jobs_must_be_positive() -> None:
    parser = argparse.ArgumentParser()
    warmup.add_arguments(parser)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["/mnt", "-j", "0"])
    assert e.value.code == EXIT_USAGE
    assert parser.parse_args(["/mnt"]).jobs == warmup.DEFAULT_JOBS


def test_progress_redraws_one_line_in_place() -> None:
    out = io.StringIO()
    p = warmup.Progress(out)
    p.reading(3, 12, 3 << 20, 1.5)
    text = out.getvalue()
    assert text.startswith("\r") and text.endswith("\x1b[K")
    assert "3/12 files" in text and "3.0 MiB" in text and "2 files/s" in text
    assert "ETA 0:04" in text and "\n" not in text
    p.clear()
    assert out.getvalue().endswith("\r\x1b[K")


# --- warm-up through a real mount -------------------------------------------------------


@pytest.mark.mount
def test_warmup_reads_every_file_then_hits(src: Path, mounter, capsys) -> None:
    m = mounter(src, "--ram", "10M")
    assert main(str(m.mnt), "-j", "4") == 0
    out = capsys.readouterr().out
    assert f"warmed {len(FILES)} files" in out and "0 failed" in out
    s = m.stats()
    assert (s["misses"], s["hits"]) == (len(FILES), 0)
    assert s["files_cached"] == len(FILES)
    assert main(str(m.mnt), "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["files"] == len(FILES)
    assert result["bytes"] == sum(len(d) for d in FILES.values())
    s = m.stats()
    assert (s["misses"], s["hits"]) == (len(FILES), len(FILES))


@pytest.mark.mount
def test_warmup_of_chosen_paths_reads_only_those(
    src: Path, tmp_path: Path, mounter, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = mounter(src, "--ram", "10M")
    monkeypatch.chdir(m.mnt)
    listing = tmp_path / "list.txt"
    listing.write_text(f"c/6.bin\n{m.mnt}/top.txt\n")
    assert main(str(m.mnt), "a", str(m.mnt / "b" / "4.bin"), "--from-file", str(listing)) == 0
    assert "warmed 6 files" in capsys.readouterr().out
    assert m.stats()["misses"] == 6


@pytest.mark.mount
def test_unreadable_files_are_counted_listed_and_exit_3(src: Path, mounter, capsys) -> None:
    m = mounter(src, "--ram", "10M")
    os.listdir(m.mnt / "b")  # the daemon now lists 4.bin ...
    (src / "b" / "4.bin").unlink()  # ... which is gone from the source before it is read
    rc = main(str(m.mnt), str(m.mnt / "b"), str(m.mnt / "no-such-file"), "--json")
    assert rc == warmup.EXIT_UNREADABLE
    cap = capsys.readouterr()
    result = json.loads(cap.out)
    assert (result["files"], result["failed"]) == (1, 2)
    failed = {f["path"] for f in result["failures"]}
    assert failed == {str(m.mnt / "b" / "4.bin"), str(m.mnt / "no-such-file")}
    assert f"failed: {m.mnt / 'b' / '4.bin'}" in cap.err


# --- --check -------------------------------------------------------------------------------


class FakeResidency:
    """The daemon's side of `residency`, checking the client keeps to the protocol."""

    def __init__(self, answers: dict[bytes, str], extra: bytes = b"") -> None:
        self.answers = answers
        self.writes: list[bytes] = []
        self.extra = extra

    def write(self, data: bytes) -> int:
        assert len(data) <= warmup.MAX_WRITE and data.endswith(b"\n")
        self.writes.append(data)
        return len(data)

    def read_all(self) -> bytes:
        lines = b"".join(self.writes).splitlines()
        return b"".join(self.answers.get(p, "missing").encode() + b"\n" for p in lines) + self.extra


def test_query_residency_writes_whole_lines_in_64k_chunks() -> None:
    paths = [f"train/class{i % 7}/image-{i:08d}.jpeg".encode() for i in range(5000)]
    answers = {p: ("ram", "ssd", "none")[i % 3] for i, p in enumerate(paths)}
    fake = FakeResidency(answers)
    got = warmup.query_residency(fake, paths)
    assert got == [answers[p] for p in paths]
    assert len(fake.writes) > 1
    assert b"".join(fake.writes) == b"".join(p + b"\n" for p in paths)


def test_query_residency_refuses_an_answer_of_the_wrong_length() -> None:
    with pytest.raises(QuietError) as e:
        warmup.query_residency(FakeResidency({}, extra=b"ram\n"), [b"a", b"b"])
    assert e.value.exitcode == EXIT_NOT_SHADEFS


def test_check_report_counts_files_and_bytes_per_tier(tmp_path: Path) -> None:
    mnt = str(tmp_path)
    files = [(f"{mnt}/r{i}", 100) for i in range(2)]
    files += [(f"{mnt}/s{i}", 300) for i in range(6)]
    files += [(f"{mnt}/n0", 200), (f"{mnt}/gone", 0)]
    fake = FakeResidency(
        {b"r0": "ram", b"r1": "ram", b"n0": "none"} | {b"s%d" % i: "ssd" for i in range(6)}
    )
    report = warmup.check(mnt, files, fake)
    assert report.text().splitlines() == [
        "10 files, 2.1 KiB: ram 2 (20.0%), ssd 6 (60.0%), not cached 1, missing 1",
        "bytes: ram 200 B (9.1%), ssd 1.8 KiB (81.8%), not cached 200 B",
        "cached: 80.0% of files, 90.9% of bytes",
    ]
    d = report.as_dict()
    assert d["files"] == 10 and d["bytes"] == 2200
    assert d["tiers"]["ssd"] == {"files": 6, "bytes": 1800}
    assert d["tiers"]["missing"] == {"files": 1, "bytes": 0}
    assert d["cached_files_fraction"] == 0.8


@pytest.mark.mount
def test_check_on_a_real_mount(src: Path, mounter, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    m = mounter(src, "--ram", "10M")
    monkeypatch.chdir(m.mnt)
    assert main(str(m.mnt), "a") == 0
    capsys.readouterr()
    before = m.stats()
    assert main(str(m.mnt), "a", "b", "c/6.bin", "--check", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tiers"]["ram"] == {"files": 3, "bytes": 6000}
    assert d["tiers"]["none"] == {"files": 3, "bytes": 4600}
    assert d["files"] == 6 and d["tiers"]["missing"]["files"] == 0
    after = m.stats()
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])  # read nothing
    (src / "c" / "7.bin").unlink()
    assert main(str(m.mnt), "c/7.bin", "c/6.bin", "--check") == warmup.EXIT_UNREADABLE
    assert capsys.readouterr().out.startswith("2 files, 600 B: ram 0 (0.0%), ssd 0 (0.0%), ")
