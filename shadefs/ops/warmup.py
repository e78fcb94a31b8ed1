"""`shadefs warmup`: read files through a mount so that they are cached, or ask what is.

    shadefs warmup MNT [PATH...] [--from-file F] [-j N] [--json]
    shadefs warmup MNT [PATH...] [--from-file F] --check [--json]

This module owns choosing the files (PATH arguments, a list file, or the whole mount) and
reading them with a pool of threads. The progress display is `ops.progress` (rich on a
terminal, plain lines otherwise); `--check` is `ops.residency_check`. It never talks to the
cache directly: a warm-up is plain reads through the mount, so the daemon admits what it
reads by the same policy as any reader (a file the policy refuses stays uncached; `--check`
shows that).

PATHs, on the command line or one per line in `--from-file F` (`-` reads standard input),
follow one rule: a relative path is relative to MNT, an absolute path must lie under MNT.
Directories are walked recursively in name order; symbolic links and special files found by
the walk are skipped (a link could lead out of the mount or loop; a FIFO would block). A
PATH that is itself a symbolic link, or passes through one, is followed only while it stays
inside the mount: one that leads out of it is a failure, never read (warmup often runs as
root, and a link in SRC may name any file). Files are opened beneath MNT's descriptor with
no symlink on the way (`source_paths.Resolver`), so a directory swapped for a link after
the selection cannot lead the read out either. With neither PATHs nor a list, the whole
mount is warmed.

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
import stat
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from shadefs.common import EXIT_OK, EXIT_USAGE, QuietError, format_size
from shadefs.ops import residency_check
from shadefs.ops.residency_check import MAX_LISTED
from shadefs.source.paths import Resolver
from shadefs.torch.client import CONTROL_DIR, ControlClient

log = logging.getLogger(__name__)

EXIT_UNREADABLE = 3
CHUNK = 1 << 20
DEFAULT_JOBS = 16
# Report progress at most this often (seconds).
REDRAW = 0.1


class Progress(Protocol):
    """What the warm-up reports while it runs (`ops.progress` draws it)."""

    def listing(self, found: int) -> None: ...

    def reading(self, done: int, total: int, nbytes: int, elapsed: float) -> None: ...


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `warmup` subcommand's arguments."""
    parser.add_argument("mountpoint", metavar="MNT", help="a shadefs mount")
    parser.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="files or directories to warm, relative to MNT or absolute under it "
        "(default: the whole mount)",
    )
    parser.add_argument(
        "--from-file",
        metavar="F",
        action="append",
        default=[],
        help="read more paths from F, one per line, relative to MNT or absolute under it "
        "('-': standard input)",
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
    # rich is loaded here, not at import: the parser that imports this module also mounts.
    from shadefs.ops.progress import progress_for

    client = ControlClient(args.mountpoint)
    client.check()
    mnt = client.mountpoint
    with progress_for(sys.stderr) as progress:
        selection = select(mnt, args.paths, args.from_file, sizes=args.check, progress=progress)
        files = [f for f, _ in selection.files]
        result = None if args.check else warm(files, jobs=args.jobs, progress=progress, root=mnt)
    if result is None:
        report = residency_check.check(mnt, selection.files, client.residency)
        missing = residency_check.print_report(report, selection.errors, args.json)
        return EXIT_UNREADABLE if missing else EXIT_OK
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

    A relative path is relative to `mnt`; an absolute one must lie under it (QuietError,
    exit code 2, otherwise). `sizes` stats every file (for --check's byte counts); otherwise
    sizes are -1, because a warm-up does not need them and each stat is a request to the
    daemon. A path that does not exist is kept with size 0: a warm-up then fails on it, and
    --check reports it `missing`.
    """
    mnt = os.path.abspath(mnt)
    targets = [_under_mount(mnt, p, p) for p in paths]
    for name in from_files:
        targets.extend(_read_list(mnt, name))
    if not paths and not from_files:
        targets = [mnt]
    sel = Selection()
    for target in targets:
        _expand(mnt, target, sel, sizes, progress)
    return sel


def _under_mount(mnt: str, path: str, shown: str) -> str:
    """`path` as an absolute path under `mnt` (a relative one is taken from `mnt`).

    `shown` names the path in the error: QuietError (exit code 2) when it is outside.
    """
    full = os.path.normpath(os.path.join(mnt, path))
    if _is_under(mnt, full):
        return full
    if os.path.isabs(path):
        # The same place spelt through a symbolic link (e.g. /data -> /mnt/shade).
        real, real_mnt = os.path.realpath(full), os.path.realpath(mnt)
        if _is_under(real_mnt, real):
            return os.path.normpath(os.path.join(mnt, os.path.relpath(real, real_mnt)))
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
    # Bytes, split on \n only: names may hold spaces, \r or bytes that are not UTF-8.
    return [
        _under_mount(mnt, os.fsdecode(raw), f"{name}:{n}: {os.fsdecode(raw)}")
        for n, raw in enumerate(data.split(b"\n"), 1)
        if raw
    ]


def _expand(mnt: str, target: str, sel: Selection, sizes: bool, progress: Progress | None) -> None:
    if _is_control(mnt, target):
        raise QuietError(f"{target} is the control directory, not data", EXIT_USAGE)
    # The same place without symbolic links, if it is inside the mount at all.
    real, real_mnt = os.path.realpath(target), os.path.realpath(mnt)
    if not _is_under(real_mnt, real):
        sel.errors.append((target, "a symbolic link that leads out of the mount: not followed"))
        return
    target = os.path.normpath(os.path.join(mnt, os.path.relpath(real, real_mnt)))
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
    return _is_under(os.path.join(mnt, CONTROL_DIR), path)


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


def read_file(path: str, buf: bytearray, beneath: Resolver | None = None) -> int:
    """Read `path` to its end into `buf` (reused, so no allocation per chunk); bytes read.

    With `beneath` (a resolver of the mount), `path` is opened relative to the mount with no
    symbolic link on the way, and only if it is a regular file.
    """
    if beneath is None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    else:
        root = os.fsdecode(beneath.root)
        fd, _ = beneath.open_regular(os.fsencode(os.path.relpath(path, root)))
    try:
        # The kernel's pages go first: it would serve a file it holds from them, and the
        # daemon, which fetches at the first read that reaches it (cache/deferred.py), would
        # not cache the file.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        total = 0
        while n := os.readv(fd, [buf]):
            total += n
        return total
    finally:
        os.close(fd)


def warm(
    paths: Sequence[str],
    *,
    jobs: int = DEFAULT_JOBS,
    progress: Progress | None = None,
    root: str | None = None,
) -> Result:
    """Read every file of `paths` fully with `jobs` threads (reads through FUSE drop the GIL).

    With `root` (the mount), every path is opened beneath it, never through a symlink.
    """
    result = Result()
    beneath = Resolver(os.fsencode(root)) if root is not None else None
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
                n = read_file(path, buf, beneath)
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
    result.seconds = time.monotonic() - start
    return result


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
