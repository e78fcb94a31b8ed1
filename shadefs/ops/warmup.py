"""`shadefs warmup`: read files through a mount so that they are cached, or ask what is.

    shadefs warmup MNT [PATH...] [--from-file F] [-j N] [--json]
    shadefs warmup MNT [PATH...] [--from-file F] --check [--json]

This module owns choosing the files (PATH arguments, a list file, or the whole mount),
reading them with a pool of threads, the progress bar, and the client side of the
`.shadefs/residency` control file that `--check` uses. It never talks to the cache directly:
a warm-up is plain reads through the mount, so the daemon admits what it reads by the same
policy as any reader (a file the policy refuses stays uncached; `--check` shows that).

PATHs are files or directories under MNT, absolute or relative to the current directory.
Directories are walked recursively in name order; symbolic links and special files found by
the walk are skipped (a link could lead out of the mount or loop; a FIFO would block).
`--from-file F` adds one path per line, relative to MNT or absolute under it (`-` reads
standard input). With neither, the whole mount is warmed.

Exit codes (the others are in common.py):

=====  ===================================================================================
0      every file was read (or, with --check, every file was found)
2      bad command line (a PATH outside MNT, an unreadable --from-file)
3      some files could not be read (EIO, ENOENT, ...): they are counted and the first ten
       are listed on stderr; with --check, some paths are missing from the mount
7      MNT is not a shadefs mount, or its daemon does not answer
=====  ===================================================================================
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import stat
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Protocol

from shadefs.common import (
    EXIT_NOT_SHADEFS,
    EXIT_OK,
    EXIT_USAGE,
    QuietError,
    control_dir,
    format_size,
)

log = logging.getLogger(__name__)

EXIT_UNREADABLE = 3
CONTROL = ".shadefs"
CHUNK = 1 << 20
# The residency protocol: whole lines, at most this many bytes per write().
MAX_WRITE = 64 << 10
MAX_LISTED = 10
DEFAULT_JOBS = 16
# Redraw the progress bar at most this often (seconds).
REDRAW = 0.1
CACHED = ("ram", "ssd")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `warmup` subcommand's arguments."""
    parser.add_argument("mountpoint", metavar="MNT", help="a shadefs mount")
    parser.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="files or directories under MNT to warm (default: the whole mount)",
    )
    parser.add_argument(
        "--from-file",
        metavar="F",
        action="append",
        default=[],
        help="read more paths from F, one per line, relative to MNT ('-': standard input)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="read nothing: report which files are cached, and in which tier",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "-j",
        "--jobs",
        type=_positive_int,
        default=DEFAULT_JOBS,
        metavar="N",
        help=f"files read in parallel (default {DEFAULT_JOBS})",
    )


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def run(args: argparse.Namespace) -> int:
    """Run `shadefs warmup`; returns the exit code (QuietError for expected failures)."""
    mnt = os.path.abspath(args.mountpoint)
    control_dir(mnt)
    progress = Progress(sys.stderr) if sys.stderr.isatty() else None
    selection = select(mnt, args.paths, args.from_file, sizes=args.check, progress=progress)
    if args.check:
        return _run_check(mnt, selection, args.json)
    result = warm([f for f, _ in selection.files], jobs=args.jobs, progress=progress)
    result.failures[:0] = selection.errors
    result.failed += len(selection.errors)
    _print_result(result, args.json)
    return EXIT_UNREADABLE if result.failed else EXIT_OK


# --- choosing the files -------------------------------------------------------------------


@dataclass
class Selection:
    """The files to warm, in order and without duplicates, and what could not be listed."""

    files: list[tuple[str, int]] = field(default_factory=list)  # (absolute path, size or -1)
    errors: list[tuple[str, str]] = field(default_factory=list)  # (path, why)
    _seen: set[str] = field(default_factory=set, repr=False)

    def add(self, path: str, size: int) -> None:
        if path not in self._seen:
            self._seen.add(path)
            self.files.append((path, size))


def select(
    mnt: str,
    paths: Sequence[str],
    from_files: Sequence[str] = (),
    *,
    sizes: bool = False,
    progress: Progress | None = None,
) -> Selection:
    """Expand PATHs and list files into regular files under `mnt`.

    `sizes` stats every file (for --check's byte counts); otherwise sizes are -1, because a
    warm-up does not need them and each stat is a request to the daemon. A path that does not
    exist is kept with size 0: a warm-up then fails on it, and --check reports it `missing`.
    """
    mnt = os.path.abspath(mnt)
    targets = [_under(mnt, os.path.abspath(p), p) for p in paths]
    for name in from_files:
        targets.extend(_read_list(mnt, name))
    if not paths and not from_files:
        targets = [mnt]
    sel = Selection()
    for target in targets:
        _expand(mnt, target, sel, sizes, progress)
    if progress:
        progress.clear()
    return sel


def _under(mnt: str, path: str, shown: str) -> str:
    if _is_under(mnt, path):
        return path
    # The same place spelt through a symbolic link (e.g. /data -> /mnt/shade).
    real = os.path.realpath(path)
    if _is_under(os.path.realpath(mnt), real):
        return os.path.join(mnt, os.path.relpath(real, os.path.realpath(mnt)))
    raise QuietError(f"{shown} is not under the mount {mnt}", EXIT_USAGE)


def _is_under(mnt: str, path: str) -> bool:
    return path == mnt or path.startswith(mnt.rstrip("/") + "/")


def _read_list(mnt: str, name: str) -> list[str]:
    try:
        if name == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(name, "rb") as f:
                data = f.read()
    except OSError as exc:
        raise QuietError(f"cannot read the list {name}: {exc.strerror}", EXIT_USAGE) from None
    out = []
    # Bytes, split on \n only: names may hold spaces, \r or bytes that are not UTF-8.
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw:
            continue
        line = os.fsdecode(raw)
        path = os.path.normpath(os.path.join(mnt, line))
        if not _is_under(mnt, path):
            raise QuietError(f"{name}:{n}: {line} is not under the mount {mnt}", EXIT_USAGE)
        out.append(path)
    return out


def _expand(mnt: str, target: str, sel: Selection, sizes: bool, progress: Progress | None) -> None:
    if _is_control(mnt, target):
        raise QuietError(f"{target} is the control directory, not data", EXIT_USAGE)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        sel.add(target, 0)
        return
    except OSError as exc:
        sel.errors.append((target, exc.strerror or str(exc)))
        return
    if stat.S_ISDIR(st.st_mode):
        _walk(mnt, target, sel, sizes, progress)
    elif stat.S_ISREG(st.st_mode):
        sel.add(target, st.st_size)
    else:
        sel.errors.append((target, "not a regular file"))


def _walk(mnt: str, top: str, sel: Selection, sizes: bool, progress: Progress | None) -> None:
    """Depth first, every directory in name order (files and subdirectories interleaved),
    with a stack of iterators rather than recursion: datasets nest deeper than one thinks."""
    stack = [iter(_listdir(top, sel))]
    while stack:
        e = next(stack[-1], None)
        if e is None:
            stack.pop()
            continue
        try:
            if e.is_dir(follow_symlinks=False):
                if not _is_control(mnt, e.path):
                    stack.append(iter(_listdir(e.path, sel)))
                    if progress:
                        progress.listing(len(sel.files))
            elif e.is_file(follow_symlinks=False):
                sel.add(e.path, e.stat(follow_symlinks=False).st_size if sizes else -1)
        except OSError as exc:
            sel.errors.append((e.path, exc.strerror or str(exc)))


def _listdir(path: str, sel: Selection) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError as exc:
        sel.errors.append((path, exc.strerror or str(exc)))
        return []


def _is_control(mnt: str, path: str) -> bool:
    return _is_under(os.path.join(mnt, CONTROL), path)


# --- reading ------------------------------------------------------------------------------


@dataclass
class Result:
    """What a warm-up did; `failures` holds the first few (path, why), `failed` counts all."""

    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failed: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {
            "files": self.files,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "failed": self.failed,
            "failures": [{"path": p, "error": e} for p, e in self.failures[:MAX_LISTED]],
        }


def read_file(path: str, buf: bytearray) -> int:
    """Read `path` to its end into `buf` (reused, so no allocation per chunk); bytes read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        total = 0
        while n := os.readv(fd, [buf]):
            total += n
        return total
    finally:
        os.close(fd)


def warm(
    paths: Sequence[str], *, jobs: int = DEFAULT_JOBS, progress: Progress | None = None
) -> Result:
    """Read every file of `paths` fully with `jobs` threads (reads through FUSE drop the GIL)."""
    result = Result()
    lock = threading.Lock()
    stop = threading.Event()
    items: Iterator[str] = iter(paths)
    start = time.monotonic()

    def worker() -> None:
        buf = bytearray(CHUNK)
        while not stop.is_set():
            with lock:
                path = next(items, None)
            if path is None:
                return
            try:
                n = read_file(path, buf)
            except OSError as exc:
                with lock:
                    result.failed += 1
                    if len(result.failures) < MAX_LISTED:
                        result.failures.append((path, exc.strerror or str(exc)))
            else:
                with lock:
                    result.files += 1
                    result.bytes += n

    # Daemon threads: a read stuck on a hung source must not keep Ctrl-C from exiting.
    threads = [
        threading.Thread(target=worker, name=f"warmup-{i}", daemon=True)
        for i in range(max(1, min(jobs, len(paths))))
    ]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(REDRAW)
                if progress:
                    with lock:
                        done, nbytes, failed = result.files, result.bytes, result.failed
                    progress.reading(done + failed, len(paths), nbytes, time.monotonic() - start)
    except KeyboardInterrupt:
        stop.set()
        raise
    finally:
        if progress:
            progress.clear()
    result.seconds = time.monotonic() - start
    return result


class Progress:
    """A one-line progress bar on a terminal, redrawn in place at most every REDRAW s."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self._last = 0.0
        self._drawn = False

    def _draw(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < REDRAW:
            return
        self._last = now
        width = shutil.get_terminal_size((80, 24)).columns - 1
        # \r plus erase-to-end-of-line: a shorter line must not leave the old one's tail.
        self.out.write("\r" + text[:width] + "\x1b[K")
        self.out.flush()
        self._drawn = True

    def listing(self, found: int) -> None:
        self._draw(f"listing: {found} files found")

    def reading(self, done: int, total: int, nbytes: int, elapsed: float) -> None:
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = _duration((total - done) / rate) if rate > 0 else "--:--"
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 20)
        self._draw(
            f"[{bar:<20}] {done}/{total} files  {format_size(nbytes)}  "
            f"{rate:.0f} files/s  ETA {eta}"
        )

    def clear(self) -> None:
        if self._drawn:
            self.out.write("\r\x1b[K")
            self.out.flush()
            self._drawn = False


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


def _print_result(result: Result, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.as_dict()))
    else:
        secs = max(result.seconds, 1e-9)
        print(
            f"warmed {result.files} files, {format_size(result.bytes)} in {result.seconds:.1f} s "
            f"({result.files / secs:.0f} files/s, {format_size(result.bytes / secs)}/s), "
            f"{result.failed} failed"
        )
    for path, why in result.failures[:MAX_LISTED]:
        print(f"shadefs: failed: {path}: {why}", file=sys.stderr)
    if result.failed > MAX_LISTED:
        print(f"shadefs: ... and {result.failed - MAX_LISTED} more", file=sys.stderr)


# --- --check: the residency control file --------------------------------------------------


class Channel(Protocol):
    """One open descriptor of `.shadefs/residency` (or a stand-in for tests)."""

    def write(self, data: bytes) -> int: ...

    def read_all(self) -> bytes: ...


class FileChannel:
    """The residency file opened read-write: write the queries, then read the answers."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)

    def write(self, data: bytes) -> int:
        return os.write(self.fd, data)

    def read_all(self) -> bytes:
        # pread from offset 0: the writes moved the descriptor's offset past the answers.
        parts = []
        off = 0
        while chunk := os.pread(self.fd, CHUNK, off):
            parts.append(chunk)
            off += len(chunk)
        return b"".join(parts)

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> FileChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def query_residency(channel: Channel, rel_paths: Iterable[bytes]) -> list[str]:
    """Ask where each path (relative to the mount root, no newline in it) is cached.

    Writes whole newline-terminated lines, at most MAX_WRITE bytes per write(), then reads
    the accumulated answers: one of `ram`, `ssd`, `none`, `missing` per path, in order.
    """
    sent = 0
    batch: list[bytes] = []
    size = 0
    for rel in rel_paths:
        line = rel + b"\n"
        if len(line) > MAX_WRITE:
            raise ValueError(f"path too long for the residency file: {rel[:80]!r}...")
        if size + len(line) > MAX_WRITE:
            _write_all(channel, b"".join(batch))
            batch, size = [], 0
        batch.append(line)
        size += len(line)
        sent += 1
    if batch:
        _write_all(channel, b"".join(batch))
    answers = channel.read_all().decode("utf-8", "replace").splitlines()
    if len(answers) != sent:
        raise QuietError(
            f"the daemon answered {len(answers)} residency lines for {sent} paths",
            EXIT_NOT_SHADEFS,
        )
    return answers


def _write_all(channel: Channel, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = channel.write(bytes(view))
        view = view[n:]


def residency(mnt: str, rel_paths: Sequence[bytes]) -> list[str]:
    """`query_residency` against the live mount at `mnt`, with its errors as QuietError."""
    path = control_dir(mnt) / "residency"
    try:
        with FileChannel(path) as channel:
            return query_residency(channel, rel_paths)
    except FileNotFoundError:
        raise QuietError(
            f"the daemon of {mnt} has no residency file (it predates --check)", EXIT_NOT_SHADEFS
        ) from None
    except OSError as exc:
        raise QuietError(f"asking {mnt} for residency: {exc.strerror}", EXIT_NOT_SHADEFS) from None


@dataclass
class Report:
    """Counts and bytes per residency status (`ram`, `ssd`, `none`, `missing`, ...)."""

    files: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, status: str, size: int) -> None:
        self.files[status] = self.files.get(status, 0) + 1
        self.bytes[status] = self.bytes.get(status, 0) + max(size, 0)

    @property
    def total_files(self) -> int:
        return sum(self.files.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def cached_fraction(self) -> tuple[float, float]:
        """(files, bytes) held in any tier, as fractions of all files and bytes asked about."""
        f = sum(self.files.get(t, 0) for t in CACHED)
        b = sum(self.bytes.get(t, 0) for t in CACHED)
        return (
            f / self.total_files if self.total_files else 0.0,
            b / self.total_bytes if self.total_bytes else 0.0,
        )

    def as_dict(self) -> dict[str, object]:
        files_frac, bytes_frac = self.cached_fraction()
        statuses = sorted(set(self.files) | {"ram", "ssd", "none", "missing"})
        return {
            "files": self.total_files,
            "bytes": self.total_bytes,
            "tiers": {
                s: {"files": self.files.get(s, 0), "bytes": self.bytes.get(s, 0)} for s in statuses
            },
            "cached_files_fraction": round(files_frac, 6),
            "cached_bytes_fraction": round(bytes_frac, 6),
        }

    def text(self) -> str:
        tf, tb = self.total_files, self.total_bytes

        def pct(n: int, of: int) -> str:
            return f"{100 * n / of:.1f}%" if of else "0.0%"

        extra = sorted(set(self.files) - {"ram", "ssd", "none", "missing"})
        tiers = [*CACHED, *extra]
        files = ", ".join(
            f"{t} {self.files.get(t, 0)} ({pct(self.files.get(t, 0), tf)})" for t in tiers
        )
        sizes = ", ".join(
            f"{t} {format_size(self.bytes.get(t, 0))} ({pct(self.bytes.get(t, 0), tb)})"
            for t in tiers
        )
        files_frac, bytes_frac = self.cached_fraction()
        return (
            f"{tf} files, {format_size(tb)}: {files}, not cached {self.files.get('none', 0)}, "
            f"missing {self.files.get('missing', 0)}\n"
            f"bytes: {sizes}, not cached {format_size(self.bytes.get('none', 0))}\n"
            f"cached: {100 * files_frac:.1f}% of files, {100 * bytes_frac:.1f}% of bytes\n"
        )


def check(mnt: str, files: Sequence[tuple[str, int]], channel: Channel | None = None) -> Report:
    """Residency of `files` ((absolute path under mnt, size)); `channel` for tests."""
    mnt = os.path.abspath(mnt)
    rels = [os.fsencode(os.path.relpath(p, mnt)) for p, _ in files]
    # A name with a newline cannot be asked about in a line protocol: report it as unknown.
    ok = [i for i, r in enumerate(rels) if b"\n" not in r]
    query = (rels[i] for i in ok)
    answers = query_residency(channel, query) if channel else residency(mnt, list(query))
    report = Report()
    status = dict(zip(ok, answers, strict=True))
    for i, (_, size) in enumerate(files):
        report.add(status.get(i, "unknown"), size)
    return report


def _run_check(mnt: str, selection: Selection, as_json: bool) -> int:
    report = check(mnt, selection.files)
    for path, why in selection.errors[:MAX_LISTED]:
        print(f"shadefs: cannot list {path}: {why}", file=sys.stderr)
    if as_json:
        d = report.as_dict()
        d["errors"] = [{"path": p, "error": e} for p, e in selection.errors[:MAX_LISTED]]
        print(json.dumps(d))
    else:
        sys.stdout.write(report.text())
    missing = report.files.get("missing", 0) + len(selection.errors)
    return EXIT_UNREADABLE if missing else EXIT_OK
