"""`shadefs warmup`: file selection, reading through a real mount, failures, and --check."""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path

import pytest
from rich.console import Console

from shadefs.common import EXIT_NOT_SHADEFS, EXIT_USAGE, QuietError
from shadefs.ops import progress, residency_check, warmup
from shadefs.torch import client
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
    monkeypatch.chdir(src / "a")  # the current directory plays no part
    listing = tmp_path / "list.txt"
    listing.write_bytes(f"c/7.bin\n\n{src}/b/4.bin\na/1.bin\n".encode())
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"top.txt\n")))
    sel = warmup.select(str(src), ["a/deep", "c/6.bin"], [str(listing), "-"], sizes=True)
    assert rel(src, sel) == ["a/deep/3.bin", "c/6.bin", "c/7.bin", "b/4.bin", "a/1.bin", "top.txt"]
    assert [size for _, size in sel.files] == [3000, 600, 700, 4000, 1000, 4]


@pytest.mark.parametrize("form", ["positional", "list"])
def test_one_rule_for_paths_relative_to_mnt_or_absolute_under_it(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    monkeypatch.chdir(tmp_path)  # "a" here would be tmp_path/a: it must be MNT/a

    def select(*paths: str) -> list[str]:
        if form == "positional":
            return rel(src, warmup.select(str(src), paths))
        listing = tmp_path / "list.txt"
        listing.write_text("".join(p + "\n" for p in paths))
        return rel(src, warmup.select(str(src), [], [str(listing)]))

    assert select("a") == ["a/1.bin", "a/2.bin", "a/deep/3.bin"]
    assert select("./c/../b/4.bin") == ["b/4.bin"]
    assert select(str(src / "c"), str(src / "top.txt")) == ["c/6.bin", "c/7.bin", "top.txt"]
    # The mount spelt through a symbolic link is still the mount.
    (tmp_path / "alias").symlink_to(src)
    assert select(str(tmp_path / "alias" / "c" / "7.bin")) == ["c/7.bin"]
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x")
    for bad in (str(outside), "../outside.bin", "a/../../outside.bin", str(src) + "-other"):
        with pytest.raises(QuietError, match="is not under the mount") as e:
            select(bad)
        assert e.value.exitcode == EXIT_USAGE


def test_paths_outside_the_mount_are_usage_errors(src: Path, tmp_path: Path) -> None:
    with pytest.raises(QuietError) as e:
        warmup.select(str(src), [str(tmp_path)])
    assert e.value.exitcode == EXIT_USAGE
    listing = tmp_path / "list.txt"
    listing.write_text("a/../../escape\n")
    with pytest.raises(QuietError, match=r"list\.txt:1: a/\.\./\.\./escape") as e:
        warmup.select(str(src), [], [str(listing)])
    assert e.value.exitcode == EXIT_USAGE
    for control in (str(src / ".shadefs"), ".shadefs/stats"):
        with pytest.raises(QuietError, match="control directory") as e:
            warmup.select(str(src), [control])
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


def test_progress_on_a_terminal_is_a_rich_bar() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with progress.RichProgress(console) as p:
        p.listing(7)
        p.reading(3, 12, 3 << 20, 1.5)
    text = out.getvalue()
    assert "3/12" in text and "3.0 MiB" in text and "2.0 MiB/s" in text


def test_progress_elsewhere_is_plain_lines_now_and_then() -> None:
    out = io.StringIO()
    now = [0.0]
    p = progress.PlainProgress(out, every=10.0, clock=lambda: now[0])
    p.listing(5)
    p.reading(1, 12, 1 << 20, 1.0)
    assert out.getvalue() == ""  # a short run prints nothing
    now[0] = 10.0
    p.listing(9)
    now[0] = 25.0
    p.reading(3, 12, 3 << 20, 1.5)
    p.reading(4, 12, 4 << 20, 2.0)  # too soon after the last line
    assert out.getvalue().splitlines() == [
        "listing: 9 files found",
        "3/12 files, 3.0 MiB, 2 files/s, ETA 0:04",
    ]
    assert "\x1b" not in out.getvalue() and "\r" not in out.getvalue()


def test_the_display_follows_the_output() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    with progress.progress_for(Tty()) as p:
        assert isinstance(p, progress.RichProgress)
    assert isinstance(progress.progress_for(io.StringIO()), progress.PlainProgress)


# --- warm-up through a real mount -------------------------------------------------------


@pytest.mark.mount
def test_warmup_reads_every_file_then_hits(src: Path, mounter, capsys) -> None:
    m = mounter(src, "--ram", "10M")
    assert main(str(m.mnt), "-j", "4") == 0
    out = capsys.readouterr().out
    assert f"warmed {len(FILES)} files" in out and "0 failed" in out
    s = m.stats()
    # (With kernel hits an empty file is never read: the kernel knows it has no bytes.)
    n = sum(1 for data in FILES.values() if data or not m.no_open)
    assert (s["misses"], s["hits"]) == (n, 0)
    assert s["files_cached"] == n
    assert main(str(m.mnt), "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["files"] == len(FILES)
    assert result["bytes"] == sum(len(d) for d in FILES.values())
    s = m.stats()
    assert (s["misses"], s["hits"]) == (n, n)
    # Dropped from RAM while the kernel keeps the pages: a warm-up still caches them.
    m.ctl("drop")
    assert main(str(m.mnt), "-j", "4") == 0
    assert m.stats()["files_cached"] == n


@pytest.mark.mount
def test_warmup_of_chosen_paths_reads_only_those(
    src: Path, tmp_path: Path, mounter, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = mounter(src, "--ram", "10M")
    monkeypatch.chdir(tmp_path)  # relative PATHs are taken from MNT, not from here
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
        assert len(data) <= client.MAX_RESIDENCY_WRITE and data.endswith(b"\n")
        self.writes.append(data)
        return len(data)

    def read_all(self) -> bytes:
        lines = b"".join(self.writes).splitlines()
        return b"".join(self.answers.get(p, "missing").encode() + b"\n" for p in lines) + self.extra


def test_query_residency_writes_whole_lines_in_64k_chunks() -> None:
    paths = [f"train/class{i % 7}/image-{i:08d}.jpeg".encode() for i in range(5000)]
    answers = {p: ("ram", "ssd", "none")[i % 3] for i, p in enumerate(paths)}
    fake = FakeResidency(answers)
    got = client.query_residency(fake, paths)
    assert got == [answers[p] for p in paths]
    assert len(fake.writes) > 1
    assert b"".join(fake.writes) == b"".join(p + b"\n" for p in paths)


def test_query_residency_refuses_an_answer_of_the_wrong_length() -> None:
    with pytest.raises(QuietError) as e:
        client.query_residency(FakeResidency({}, extra=b"ram\n"), [b"a", b"b"])
    assert e.value.exitcode == EXIT_NOT_SHADEFS
    with pytest.raises(ValueError, match="newline"):
        client.query_residency(FakeResidency({}), [b"a\nb"])


def test_check_report_counts_files_and_bytes_per_tier(tmp_path: Path) -> None:
    mnt = str(tmp_path)
    files = [(f"{mnt}/r{i}", 100) for i in range(2)]
    files += [(f"{mnt}/s{i}", 300) for i in range(6)]
    files += [(f"{mnt}/n0", 200), (f"{mnt}/gone", 0)]
    fake = FakeResidency(
        {b"r0": "ram", b"r1": "ram", b"n0": "none"} | {b"s%d" % i: "ssd" for i in range(6)}
    )
    report = residency_check.check(mnt, files, lambda rels: client.query_residency(fake, rels))
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
    # A name with a newline cannot be asked about in the line protocol: it is `unknown`.
    odd = [(f"{mnt}/new\nline", 50), (f"{mnt}/r0", 100)]
    fresh = FakeResidency({b"r0": "ram"})
    report = residency_check.check(mnt, odd, lambda rels: client.query_residency(fresh, rels))
    assert report.files == {"unknown": 1, "ram": 1}


@pytest.mark.mount
def test_check_on_a_real_mount(src: Path, mounter, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    m = mounter(src, "--ram", "10M")
    monkeypatch.chdir(src / "b")
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


def test_a_named_symlink_is_followed_only_inside_the_mount(src: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"not for warmup")
    (src / "out").symlink_to(secret)
    (src / "outdir").symlink_to(tmp_path)
    (src / "in").symlink_to("a/1.bin")
    (src / "indir").symlink_to("c")
    sel = warmup.select(str(src), ["out", "outdir/secret", "outdir", "in", "indir"])
    assert rel(src, sel) == ["a/1.bin", "c/6.bin", "c/7.bin"]
    assert [os.path.relpath(p, src) for p, _ in sel.errors] == ["out", "outdir/secret", "outdir"]
    assert all("leads out of the mount" in why for _, why in sel.errors)


def test_reads_never_pass_a_symlink_swapped_in_after_the_selection(
    src: Path, tmp_path: Path
) -> None:
    outside = make_tree(tmp_path / "outside", {"1.bin": b"secret"})
    chosen = [str(src / "a" / "1.bin"), str(src / "b" / "4.bin")]
    (src / "a").rename(tmp_path / "a-moved")
    (src / "a").symlink_to(outside)  # as a writer of SRC could, between select and read
    result = warmup.warm(chosen, jobs=1, root=str(src))
    assert (result.files, result.bytes, result.failed) == (1, 4000, 1)
    assert result.failures[0][0] == chosen[0]


def test_warmup_of_a_link_out_of_the_mount_reads_nothing(
    src: Path, tmp_path: Path, mounter, capsys
) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"root's file")
    (src / "link").symlink_to(secret)
    m = mounter(src)
    assert main(str(m.mnt), "link", "top.txt") == warmup.EXIT_UNREADABLE
    out, err = capsys.readouterr()
    assert "warmed 1 files" in out
    assert f"{m.mnt}/link: a symbolic link that leads out of the mount" in err
