"""The mount options table: flags, `-o` parsing, defaults, the README, and ASCII-only numbers.

No mount: these drive the parser and `from_args` directly, and `main` for exit codes.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from shadefs import options
from shadefs.cli.commands import _parser, main
from shadefs.common import EXIT_USAGE, QuietError, parse_float, parse_int, parse_size
from shadefs.options import OPTIONS, MountOptions, from_args, parse_o, readme_table

ROOT = Path(__file__).resolve().parents[1]

# One sample value per option that takes one, and what it parses to.
SAMPLES: dict[str, tuple[str, object]] = {
    "ram": ("64M", 64 << 20),
    "ssd": ("/var/cache/shadefs", "/var/cache/shadefs"),
    "ssd_min_free": ("1G", 1 << 30),
    "policy": ("lru", "lru"),
    "max_entry": ("1.5M", 3 << 19),
    "source_timeout": ("2.5", 2.5),
    "source_threads": ("8", 8),
    "revalidate": ("600", 600.0),
    "prefetch_window": ("32M", 32 << 20),
    "prefetch_workers": ("4", 4),
    "prefetch_abandon": ("1", 1.0),
    "metrics": ("127.0.0.1:9567", "127.0.0.1:9567"),
    "log": ("/tmp/x.log", "/tmp/x.log"),
    "log_level": ("debug", "debug"),
}
# Digits that Python's int(), float() and re's \d take, and shadefs must not: Arabic-Indic,
# extended Arabic-Indic, Devanagari, full-width, NKo, mathematical bold, Bengali.
UNICODE_DIGITS = ["٣", "۳", "३", "３", "߃", "𝟑", "৩"]


def mount(*args: str) -> MountOptions:
    return from_args(_parser().parse_args(["mount", "/src", "/mnt", *args]))


_MACHINE_DEFAULT_RAM = options.default_ram


@pytest.fixture(autouse=True)
def _steady_default_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default RAM budget is a quarter of the memory available *now*; tests that compare
    # two parses must not see it move between them.
    monkeypatch.setattr(options, "default_ram", lambda: 4 << 30)


def test_readme_table_is_the_rendered_table() -> None:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("| option | `-o` / fstab |")
    end = readme.index("\n\n", start) + 1
    assert readme[start:end] == readme_table(), (
        "README.md's option table differs from shadefs/options.py; paste the output of "
        "python -c 'from shadefs.options import readme_table; print(readme_table(), end=\"\")'"
    )


def test_every_option_has_a_row_flag_and_field() -> None:
    fields = {f.name for f in dataclasses.fields(MountOptions)}
    names = {opt.name for opt in OPTIONS}
    # ssd_size comes from --ssd DIR:SIZE, extra_fuse from code, SRC and MNT are positional.
    assert fields - names == {"source", "mountpoint", "ssd_size", "extra_fuse"}
    assert names <= fields
    table = readme_table()
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    help_text = parser.format_help()
    for opt in OPTIONS:
        assert f"`{opt.flag}" in table and opt.flag in help_text
        if opt.fstab:
            assert f"`{opt.name}" in table


def test_defaults_come_from_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(options, "default_ram", lambda: 12345)
    opts = mount()
    assert opts.ram == 12345
    for opt in OPTIONS:
        if opt.name != "ram":
            assert getattr(opts, opt.name) == opt.default, opt.name
    assert opts == MountOptions("/src", "/mnt", ram=12345)
    assert 0 < _MACHINE_DEFAULT_RAM() < 1 << 50


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_flag_and_o_word_give_the_same_value(name: str) -> None:
    text, expected = SAMPLES[name]
    flag = options.BY_NAME[name].flag
    assert getattr(mount(flag, text), name) == expected
    assert getattr(mount("-o", f"{name}={text}"), name) == expected


def test_switches_and_on_off() -> None:
    assert mount("-o", "allow_other").allow_other is True
    assert mount("--allow-other").allow_other is True
    assert mount("-o", "allow_other=").allow_other is True  # as before: an empty value
    for word, value in [("off", False), ("no", False), ("0", False), ("ON", True), ("yes", True)]:
        assert mount("-o", f"prefetch={word}").prefetch is value
    assert mount("--no-prefetch").prefetch is False
    assert mount("--prefetch", "-o", "prefetch=off").prefetch is True
    assert mount("--systemd").foreground is True
    assert mount("-f").foreground is True and mount("-f").systemd is False


def test_flags_win_over_o_and_later_o_wins() -> None:
    opts = mount("-o", "ram=1G,policy=shade", "--ram", "2G", "-o", "policy=lru")
    assert opts.ram == 2 << 30
    assert opts.policy == "lru"


def test_ssd_dir_and_size() -> None:
    assert (mount("--ssd", "/c:400G").ssd, mount("--ssd", "/c:400G").ssd_size) == ("/c", 400 << 30)
    assert (mount("-o", "ssd=/c:1G").ssd, mount("-o", "ssd=/c:1G").ssd_size) == ("/c", 1 << 30)
    assert options.split_ssd("/a:b:2M") == ("/a:b", 2 << 20)
    assert options.split_ssd(":5G") == (":5G", None)


def test_a_directory_with_a_colon_is_taken_whole_only_if_it_exists(tmp_path: Path) -> None:
    odd = tmp_path / "cache:b"
    odd.mkdir()
    assert (mount("--ssd", str(odd)).ssd, mount("--ssd", str(odd)).ssd_size) == (str(odd), None)
    assert options.split_ssd(f"{odd}:2M") == (str(odd), 2 << 20)
    with pytest.raises(ValueError, match="bad SIZE in DIR:SIZE"):
        options.split_ssd(str(tmp_path / "nope:b"))


@pytest.mark.parametrize("args", [["--ssd", "{d}:-1"], ["--ssd", "{d}:10Q"], ["-o", "ssd={d}:abc"]])
def test_a_bad_ssd_size_exits_2_on_one_line_and_creates_nothing(
    tmp_path: Path, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 36: `--ssd DIR:-1` mounted with a directory named `DIR:-1` and the default budget.
    cache = tmp_path / "cache"
    argv = ["mount", str(tmp_path / "src"), str(tmp_path / "mnt")]
    with pytest.raises(SystemExit) as exit_:
        code = main([*argv, args[0], args[1].format(d=cache)])
        raise SystemExit(code)
    assert exit_.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "bad SIZE in DIR:SIZE: not a size" in err, err
    assert list(tmp_path.iterdir()) == []


def _helper_dropped_words() -> list[str]:
    """The words mount/mount.fuse.shadefs drops, from its `case` patterns."""
    text = (ROOT / "mount" / "mount.fuse.shadefs").read_text()
    words: list[str] = []
    for pattern in re.findall(r"^\s*([^\n()]+)\) ;;$", text, re.MULTILINE):
        words += [w.strip().strip("'") for w in pattern.split("|")]
    return [w for w in words if w and w not in ("s", "n", "v", "t")]


def test_fstab_only_words_are_ignored() -> None:
    # shadefs@.service passes -o straight to shadefs, without the helper: what the helper
    # drops, shadefs must ignore too.
    dropped = _helper_dropped_words()
    assert {"defaults", "_netdev", "nofail", "noauto", "rw", "x-*"} <= set(dropped)
    words = [w.replace("*", "systemd.requires=/mnt/nfs") for w in dropped]
    words += ["x-systemd.automount", "comment=systemd.automount", "sync", "relatime", "", " "]
    assert parse_o([",".join(words)]) == {}
    assert mount("-o", ",".join(words)) == mount()


@pytest.mark.parametrize(
    ("words", "message"),
    [
        ("colour=red", "unknown mount option 'colour' in -o"),
        ("max-entry=1M", "unknown mount option 'max-entry' in -o"),
        ("ssd_size=1G", "unknown mount option 'ssd_size' in -o"),
        ("systemd", "mount option systemd is for the command line (--systemd)"),
        ("foreground", "mount option foreground is for the command line (--foreground)"),
        ("allow_other=yes", "mount option allow_other takes no value"),
        ("ram", "mount option ram needs a value (ram=...)"),
        ("ram=", "mount option ram needs a value (ram=...)"),
        ("ram=lots", "mount option ram: not a size: 'lots'"),
        ("policy=mru", "unknown policy 'mru' (epoch, lru, shade or belady)"),
        ("log_level=loud", "unknown log level 'loud'"),
        ("prefetch=maybe", "mount option prefetch: use on or off, not 'maybe'"),
        ("prefetch_workers=0", "mount option prefetch_workers: 0 is less than 1"),
        ("source_timeout=-1", "mount option source_timeout: not a number: '-1'"),
        ("revalidate=nan", "not a number: 'nan'"),
        ("metrics=host:port", "mount option metrics: bad metrics address"),
    ],
)
def test_bad_o_words_are_usage_errors(words: str, message: str) -> None:
    with pytest.raises(QuietError) as err:
        mount("-o", f"ram=1G,{words}")
    assert message in str(err.value)
    assert err.value.exitcode == EXIT_USAGE


def test_bad_o_word_exits_2_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mount", "/nonexistent", "/mnt", "-o", "colour=red"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err == "shadefs: error: unknown mount option 'colour' in -o\n"


@pytest.mark.parametrize(
    "args",
    [
        ["--ram", "lots"],
        ["--policy", "mru"],
        ["--source-threads", "0"],
        ["--prefetch-workers", "1.5"],
        ["--revalidate", "inf"],
        ["--metrics", "[::1]"],
    ],
)
def test_bad_flags_are_usage_errors(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["mount", "/src", "/mnt", *args])
    assert exit_.value.code == EXIT_USAGE
    assert f"argument {args[0]}" in capsys.readouterr().err


def test_examples_in_the_units_and_helper_parse() -> None:
    """The -o strings the systemd units and the helper's header show as examples."""
    examples = [
        "defaults",  # shadefs@.service's default SHADEFS_OPTS
        *re.findall(r"SHADEFS_OPTS=(\S+)", (ROOT / "systemd" / "shadefs@.service").read_text()),
        *re.findall(r"^Options=(\S+)", (ROOT / "systemd" / "mnt-shade.mount").read_text(), re.M),
        *re.findall(
            r"fuse\.shadefs (\S+) 0 0", (ROOT / "mount" / "mount.fuse.shadefs").read_text()
        ),
    ]
    assert len(examples) >= 4
    for words in examples:
        opts = mount("-o", words)
        if "ram=16G" in words:
            assert opts.ram == 16 << 30
            assert (opts.ssd, opts.ssd_size) == ("/var/cache/shadefs", 400 << 30)


# -- ASCII digits only (issue: `ram ٣M` was 3 MiB) --------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("0", 0),
        ("123", 123),
        ("64K", 64 << 10),
        ("64k", 64 << 10),
        ("1.5G", 3 << 29),
        ("16GiB", 16 << 30),
        ("16gb", 16 << 30),
        (" 8 M ", 8 << 20),
        ("2T", 2 << 40),
        ("1P", 1 << 50),
        ("3M\n", 3 << 20),
    ],
)
def test_parse_size_accepts_ascii_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("digit", UNICODE_DIGITS)
def test_unicode_digits_are_not_numbers(digit: str) -> None:
    # Python itself would take them: the test proves the guard, not Python's defaults.
    assert int(digit) == 3
    for parse, text in [
        (parse_size, f"{digit}M"),
        (parse_size, f"1{digit}"),
        (parse_size, f"1.{digit}G"),
        (parse_int, digit),
        (parse_int, f"1{digit}"),
        (parse_float, digit),
        (parse_float, f"0.{digit}"),
        (options.metrics_address, f"90{digit}0"),
        (options.metrics_address, f"127.0.0.1:{digit}"),
    ]:
        with pytest.raises(ValueError):
            parse(text)


@pytest.mark.parametrize("text", ["1\u212a", "1\u212aiB", "1e3", "-1", "0x10", "1_000", "", "M"])
def test_parse_size_rejects_odd_forms(text: str) -> None:
    # U+212A is the Kelvin sign, which a case-insensitive Unicode match takes for K.
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("text", ["+1", "1_0", "1.0", "", " ", "0x1", "-0"])
def test_parse_int_is_plain_decimal(text: str) -> None:
    with pytest.raises(ValueError):
        parse_int(text)
    assert parse_int(" 42 ") == 42


@pytest.mark.parametrize("text", ["inf", "nan", "1e3", "-1", "+1", "1_0", "", "."])
def test_parse_float_is_plain_decimal(text: str) -> None:
    with pytest.raises(ValueError):
        parse_float(text)
    assert (parse_float("2"), parse_float("2.5"), parse_float(".5"), parse_float("3.")) == (
        2.0,
        2.5,
        0.5,
        3.0,
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["mount", "/s", "/m", "--ram", "٣M"],
        ["mount", "/s", "/m", "--source-threads", "٣"],
        ["mount", "/s", "/m", "--revalidate", "３"],
        ["mount", "/s", "/m", "--metrics", "٣"],
        ["umount", "/m", "--timeout", "٣"],
        ["stat", "/m", "--interval", "٣"],
        ["demo", "--epochs", "٣"],
    ],
)
def test_cli_numbers_take_ascii_digits_only(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == EXIT_USAGE


@pytest.mark.parametrize(
    "word", ["ram=٣M", "source_threads=٣", "prefetch_workers=３", "revalidate=٣", "metrics=٣"]
)
def test_o_numbers_take_ascii_digits_only(word: str) -> None:
    with pytest.raises(QuietError) as err:
        mount("-o", word)
    assert err.value.exitcode == EXIT_USAGE
