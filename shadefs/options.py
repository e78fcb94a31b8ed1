"""The mount options: one table that makes the flags, the `-o` words, the defaults and the docs.

Each `Option` in `OPTIONS` is one mount option, `--name-with-dashes` on the command line and
`name_with_underscores=VALUE` in `-o` and fstab. From the table come the flags of `shadefs
mount` (`add_arguments`), the parsing of `-o` (`parse_o`, `from_args`), the defaults of
`MountOptions`, and the option table of the README (`readme_table`; a test keeps the README
equal to it).

The daemon imports this module, so it stays light: no trio, numpy or pyfuse3.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from shadefs.common import (
    QuietError,
    parse_float,
    parse_int,
    parse_size,
)

T = TypeVar("T")

POLICIES = ("epoch", "lru", "shade", "belady")
LOG_LEVELS = ("debug", "info", "warning", "error")
KERNEL_HITS_MODES = ("on", "off", "auto")

# Words that belong to fstab, mount(8) or systemd, not to shadefs: `-o` ignores them, as
# mount/mount.fuse.shadefs drops them (shadefs@.service passes -o without that helper).
FSTAB_WORDS = frozenset({
    "defaults", "auto", "noauto", "nofail", "_netdev", "user", "users", "nouser", "rw", "ro",
    "suid", "nosuid", "dev", "nodev", "exec", "noexec", "sync", "async", "relatime",
    "norelatime", "strictatime", "owner", "group",
})  # fmt: skip
_ON, _OFF = ("on", "yes", "true", "1"), ("off", "no", "false", "0")


@dataclass(frozen=True)
class Option(Generic[T]):
    """One mount option: its parser, default and documentation."""

    name: str
    default: T
    parse: Callable[[str], T] | None  # text -> value, ValueError says why; None: a switch
    help: str  # for --help
    meaning: str  # for the README (markdown)
    shown: str = ""  # the default as the docs state it
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    short: str | None = None
    fstab: bool = True  # usable in -o and fstab
    negatable: bool = False  # --name / --no-name on the command line, name=on|off in -o

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def o_word(self) -> str:
        if self.negatable:
            return f"{self.name}=on|off"
        return f"{self.name}={self.metavar}" if self.parse else self.name


def choice(what: str, choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            alternatives = f"{', '.join(choices[:-1])} or {choices[-1]}"
            raise ValueError(f"unknown {what} {text!r} ({alternatives})")
        return text

    return parse


def on_off(text: str) -> bool:
    word = text.strip().lower()
    if word not in _ON + _OFF:
        raise ValueError(f"use on or off, not {text!r}")
    return word in _ON


def positive_int(text: str) -> int:
    return parse_int(text, minimum=1)


def positive_float(text: str) -> float:
    value = parse_float(text)
    if value <= 0:
        raise ValueError(f"must be above 0, got {text.strip()}")
    return value


def ssd_value(text: str) -> str:
    """`DIR[:SIZE]`, checked as `split_ssd` splits it (ValueError for a bad SIZE)."""
    split_ssd(text)
    return text


def any_text(text: str) -> str:
    return text


def metrics_address(text: str) -> str:
    """`[HOST:]PORT`, checked as the daemon will bind it."""
    if not text.isascii():
        raise ValueError(f"bad metrics address {text!r}: use ASCII digits and names")
    from shadefs.ops.prom import parse_address  # prometheus_client: only when asked for

    parse_address(text)
    return text


# The table. `help` is for --help, `shown` is the default as the docs state it, `meaning`
# is the README's column (markdown). Laid out by hand so that it reads as a table.
# fmt: off
RAM = Option[int | None](
    name="ram", default=None, parse=parse_size, metavar="SIZE",
    help="RAM budget, e.g. 16G", shown="¼ of available memory",
    meaning="RAM budget in bytes (`K`/`M`/`G`/`T` suffixes, binary). Never exceeded: it "
    "counts file bytes",
)
SSD = Option[str | None](
    name="ssd", default=None, parse=ssd_value, metavar="DIR[:SIZE]",
    help="local SSD cache directory and its budget", shown="off",
    meaning="a local SSD tier in DIR; SIZE defaults to 80% of the disk's free space above "
    "the floor",
)
SSD_MIN_FREE = Option[int | None](
    name="ssd_min_free", default=None, parse=parse_size, metavar="SIZE",
    help="free space to leave on the cache disk", shown="5% of the cache disk, at most 1G",
    meaning="free space always left on the cache disk",
)
POLICY = Option(
    name="policy", default="epoch", parse=choice("policy", POLICIES), choices=POLICIES,
    metavar="NAME", help="eviction policy: epoch, lru, shade or belady", shown="`epoch`",
    meaning="`epoch`: keep what has not been read this epoch; `lru`: the baseline; `shade`: "
    "importance-driven (for `ShadeSampler`); `belady`: furthest next use of a known order "
    "(prefetch plans)",
)
MAX_ENTRY = Option[int | None](
    name="max_entry", default=None, parse=parse_size, metavar="SIZE",
    help="the largest file cached whole in RAM", shown="min(RAM/8, 256M)",
    meaning="the largest file cached whole in RAM; a file larger than every tier caches whole "
    "(the SSD tier: min(SSD/8, 256M)) is cached in blocks (`--block-size`)",
)
BLOCK_SIZE = Option(
    name="block_size", default=1 << 20, parse=parse_size, metavar="SIZE", shown="1M",
    help="block size of files above --max-entry", meaning="block size of files cached in blocks",
)
PASSTHROUGH_ABOVE = Option[int | None](
    name="passthrough_above", default=None, parse=parse_size, metavar="SIZE",
    help="files larger than this are read through", shown="none",
    meaning="files larger than this are read through, never cached (`--max-entry`: no blocks)",
)
HANDLE_LIMIT = Option[int | None](
    name="handle_limit", default=None, parse=parse_size, metavar="SIZE",
    help="bytes open handles may keep alive outside the RAM budget", shown="the RAM budget",
    meaning="evicted bytes that open files may keep alive above `--ram`; past it, new opens "
    "of uncached files are read through",
)
SOURCE_TIMEOUT = Option(
    name="source_timeout", default=30.0, parse=positive_float, metavar="S",
    help="seconds before a source call fails with EIO", shown="30",
    meaning="a source call that takes longer fails with EIO, so a hung NFS server cannot "
    "hang training",
)
SOURCE_THREADS = Option(
    name="source_threads", default=32, parse=positive_int, metavar="N",
    help="worker threads for source calls", shown="32",
    meaning="worker threads for source calls: the most calls to SRC in flight at once",
)
INLINE_READS = Option(
    name="inline_reads", default=True, parse=on_off, negatable=True,
    help="read small files SRC holds in memory without a worker thread", shown="on",
    meaning="a small file that a local SRC has cached is read on the event loop, without a "
    "worker thread (NFS, FUSE and uncached files go to a thread)",
)
KERNEL_HITS = Option(
    name="kernel_hits", default="off", parse=choice("kernel-hits mode", KERNEL_HITS_MODES),
    choices=KERNEL_HITS_MODES, metavar="on|off|auto", shown="off",
    help="let the kernel open files itself, so that a warm open never reaches the daemon "
    "(needs the patched pyfuse3: make pyfuse3)",
    meaning="FUSE no-open mode: the kernel opens files itself and serves the pages it holds; "
    "the daemon sees only reads of pages the kernel lacks (README: Kernel hits). `auto`: on "
    "where pyfuse3 supports it",
)
REVALIDATE = Option(
    name="revalidate", default=3600.0, parse=parse_float, metavar="S",
    help="seconds before a file is checked against SRC again", shown="3600",
    meaning="after S seconds a file's signature is checked against SRC on open, and a "
    "directory listing is refreshed (with it, which entries have no extended attributes); "
    "also the kernel's entry/attribute timeout",
)
PREFETCH = Option(
    name="prefetch", default=True, parse=on_off, negatable=True,
    help="fetch the misses of a known order ahead of the reader", shown="on",
    meaning="fetch the misses of a known order (the sampler's, or a plan) ahead of the reader",
)
SPECULATE = Option(
    name="speculate", default=True, parse=on_off, negatable=True,
    help="stage the files a job has not read yet this epoch", shown="on",
    meaning="for a job that announces no order, stage what it has not read yet this epoch "
    "(within the prefetch window; needs prefetch)",
)
PREFETCH_WINDOW = Option[int | None](
    name="prefetch_window", default=None, parse=parse_size, metavar="SIZE",
    help="bytes staged ahead of the readers", shown="RAM/4, 64M–1G",
    meaning="bytes staged ahead of the readers",
)
PREFETCH_WORKERS = Option(
    name="prefetch_workers", default=16, parse=positive_int, metavar="N",
    help="the most fetches in flight", shown="16",
    meaning="the most fetches in flight; the prefetcher adapts below it",
)
PREFETCH_ABANDON = Option(
    name="prefetch_abandon", default=60.0, parse=parse_float, metavar="S",
    help="seconds without progress that end a prefetch plan", shown="60",
    meaning="a prefetch plan whose reader makes no progress for S seconds ends, and what it "
    "staged is dropped",
)
JOB_IDLE = Option(
    name="job_idle", default=120.0, parse=parse_float, metavar="S",
    help="seconds without reads after which a job is over", shown="120",
    meaning="a job (the processes of one training run, or a named sampler) that reads "
    "nothing for S seconds is over: it leaves the stats and stops counting as demand",
)
METRICS = Option[str | None](
    name="metrics", default=None, parse=metrics_address, metavar="[HOST:]PORT",
    help="serve Prometheus metrics (loopback by default)", shown="off",
    meaning="Prometheus metrics over HTTP (loopback when only a port is given)",
)
ALLOW_OTHER = Option(
    name="allow_other", default=False, parse=None,
    help="let other users read the mount", shown="off",
    meaning="let other users read the mount (needs `user_allow_other` in /etc/fuse.conf for "
    "non-root)",
)
LOG = Option[str | None](
    name="log", default=None, parse=any_text, metavar="FILE|syslog|stderr|none",
    help="where the daemon logs",
    shown="`~/.local/state/shadefs/<mnt>.log` in the background, stderr with `-f`",
    meaning="where the daemon logs",
)
LOG_LEVEL = Option(
    name="log_level", default="info", parse=choice("log level", LOG_LEVELS), choices=LOG_LEVELS,
    metavar="LEVEL", help="debug, info, warning or error", shown="`info`",
    meaning="`debug`, `info`, `warning`, `error`",
)
FOREGROUND = Option(
    name="foreground", default=False, parse=None, short="-f", fstab=False,
    help="stay attached", shown="off",
    meaning="stay attached: the daemon runs in the foreground and logs to stderr",
)
SYSTEMD = Option(
    name="systemd", default=False, parse=None, fstab=False,
    help="run as a Type=notify service", shown="off",
    meaning="foreground, READY=1 via sd_notify once the mount answers, journal-friendly logs",
)

OPTIONS: tuple[Option[Any], ...] = (
    RAM, SSD, SSD_MIN_FREE, POLICY, MAX_ENTRY, BLOCK_SIZE, PASSTHROUGH_ABOVE, HANDLE_LIMIT,
    SOURCE_TIMEOUT, SOURCE_THREADS, INLINE_READS, KERNEL_HITS, REVALIDATE, PREFETCH, SPECULATE,
    PREFETCH_WINDOW, PREFETCH_WORKERS, PREFETCH_ABANDON, JOB_IDLE, METRICS,
    ALLOW_OTHER, LOG, LOG_LEVEL, FOREGROUND, SYSTEMD,
)
# fmt: on
BY_NAME = {opt.name: opt for opt in OPTIONS}


@dataclass
class MountOptions:
    """Everything `shadefs mount` accepts; the defaults are the table's."""

    source: str
    mountpoint: str
    ram: int  # RAM's default depends on the machine: default_ram()
    policy: str = POLICY.default
    max_entry: int | None = MAX_ENTRY.default
    block_size: int = BLOCK_SIZE.default
    passthrough_above: int | None = PASSTHROUGH_ABOVE.default
    handle_limit: int | None = HANDLE_LIMIT.default
    allow_other: bool = ALLOW_OTHER.default
    foreground: bool = FOREGROUND.default
    systemd: bool = SYSTEMD.default
    log_level: str = LOG_LEVEL.default
    log: str | None = LOG.default
    source_timeout: float = SOURCE_TIMEOUT.default
    source_threads: int = SOURCE_THREADS.default
    inline_reads: bool = INLINE_READS.default
    kernel_hits: str = KERNEL_HITS.default
    revalidate: float = REVALIDATE.default
    ssd: str | None = SSD.default
    ssd_size: int | None = None  # the SIZE of --ssd DIR:SIZE
    ssd_min_free: int | None = SSD_MIN_FREE.default
    metrics: str | None = METRICS.default
    prefetch: bool = PREFETCH.default
    prefetch_window: int | None = PREFETCH_WINDOW.default
    speculate: bool = SPECULATE.default
    prefetch_workers: int = PREFETCH_WORKERS.default
    prefetch_abandon: float = PREFETCH_ABANDON.default
    job_idle: float = JOB_IDLE.default
    extra_fuse: list[str] = field(default_factory=list)

    @property
    def prefetch_window_bytes(self) -> int:
        """`--prefetch-window`, or its default: a quarter of the RAM budget, within 64M-1G
        (the `shown` default of PREFETCH_WINDOW)."""
        if self.prefetch_window:
            return self.prefetch_window
        return min(max(self.ram // 4, 64 << 20), 1 << 30)


def argtype(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse `type=` from a parser that raises ValueError: argparse shows the reason."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `shadefs mount`. Flags left out are None, so that `-o` can fill them."""
    parser.add_argument("source", metavar="SRC", help="the dataset tree (e.g. an NFS mount)")
    parser.add_argument("mountpoint", metavar="MNT", help="an empty directory to mount on")
    for opt in OPTIONS:
        names = [opt.short, opt.flag] if opt.short else [opt.flag]
        shown = opt.shown.replace("`", "")
        text = (f"{opt.help} (default: {shown})" if shown else opt.help).replace("%", "%%")
        if opt.negatable:
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, help=text)
        elif opt.parse is None:
            parser.add_argument(*names, action="store_true", default=None, help=text)
        elif opt.choices:
            parser.add_argument(*names, choices=opt.choices, metavar=opt.metavar, help=text)
        else:
            parser.add_argument(*names, type=argtype(opt.parse), metavar=opt.metavar, help=text)
    parser.add_argument(
        "-o",
        dest="opts",
        metavar="OPTS",
        action="append",
        default=[],
        help="fstab-style options: every long option with _ for -, e.g. ram=16G,allow_other",
    )
    # The background parent tells its foreground child where to report readiness.
    parser.add_argument("--ready-fd", type=argtype(parse_int), help=argparse.SUPPRESS)


def parse_o(groups: Iterable[str]) -> dict[str, Any]:
    """The values that `-o a=1,b,...` groups set, by option name; QuietError on a bad word."""
    values: dict[str, Any] = {}
    for group in groups:
        for word in filter(None, (w.strip() for w in group.split(","))):
            key, _, text = word.partition("=")
            if key in FSTAB_WORDS or key.startswith("x-") or key == "comment":
                continue
            opt = BY_NAME.get(key)
            if opt is None:
                raise QuietError(f"unknown mount option {key!r} in -o")
            if not opt.fstab:
                raise QuietError(f"mount option {key} is for the command line ({opt.flag})")
            if opt.parse is None:
                if text:
                    raise QuietError(f"mount option {key} takes no value")
                values[key] = True
                continue
            if not text:
                raise QuietError(f"mount option {key} needs a value ({key}=...)")
            try:
                values[key] = opt.parse(text)
            except ValueError as exc:
                raise QuietError(f"mount option {key}: {exc}") from None
    return values


def split_ssd(text: str) -> tuple[str, int | None]:
    """`DIR[:SIZE]` -> (DIR, SIZE or None); ValueError when what follows the last ':' is not
    a size. A directory whose name has a ':' is taken whole if it exists (else give its
    size after it): a SIZE that does not parse must never become part of a new directory's
    name, mounted with the default budget."""
    path, sep, size = text.rpartition(":")
    if not sep or not path or os.path.isdir(text):
        return text, None
    try:
        return path, parse_size(size)
    except ValueError as exc:
        raise ValueError(f"bad SIZE in DIR:SIZE: {exc}") from None


def from_args(args: argparse.Namespace) -> MountOptions:
    """MountOptions from parsed `shadefs mount` arguments: flags win over -o, then defaults."""
    values = parse_o(args.opts)
    for opt in OPTIONS:
        given = getattr(args, opt.name)
        if given is not None:
            values[opt.name] = given
    if values.get("ssd"):
        values["ssd"], values["ssd_size"] = split_ssd(values["ssd"])
    if values.get("ram") is None:
        values["ram"] = default_ram()
    values["foreground"] = values.get("foreground", False) or values.get("systemd", False)
    return MountOptions(source=args.source, mountpoint=args.mountpoint, **values)


def readme_table() -> str:
    """The README's option table, in markdown."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| option | `-o` / fstab | default | meaning |", "|---|---|---|---|"]
    for opt in OPTIONS:
        flag = f"`{opt.flag} {opt.metavar}`" if opt.metavar else f"`{opt.flag}`"
        if opt.negatable:
            flag = f"`{opt.flag}` / `--no-{opt.flag[2:]}`"
        if opt.short:
            flag = f"`{opt.short}`, {flag}"
        o_word = f"`{opt.o_word}`" if opt.fstab else "command line only"
        rows.append(f"| {cell(flag)} | {cell(o_word)} | {cell(opt.shown)} | {cell(opt.meaning)} |")
    rows.append(
        "| `-o OPTS` | | | fstab-style, comma-separated: `ram=16G,ssd=/var/cache/shadefs:400G,"
        "policy=lru,allow_other,revalidate=600,prefetch=off,metrics=9567`. fstab-only words "
        "(`defaults`, `_netdev`, `nofail`, `noauto`, `x-systemd.*`, `rw`, ...) are ignored; "
        "anything unknown is an error. Command-line flags win over `-o` |"
    )
    return "\n".join(rows) + "\n"


def default_ram() -> int:
    """A quarter of the memory available now: the page cache and the job need the rest."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 4
    except OSError:
        pass
    return 1 << 30
