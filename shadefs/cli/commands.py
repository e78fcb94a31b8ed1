"""The `shadefs` command line: mount, umount, stat, ctl, demo.

Expected failures print one line (`shadefs: error: ...`) and exit with the code documented
in common.py; only bugs produce a traceback (exit code 1).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from typing import NoReturn

from shadefs import __version__, options
from shadefs.cli.background import spawn_background
from shadefs.cli.checks import check_environment
from shadefs.cli.waiting import ANSWER_TIMEOUT, NoAnswer, mounted, within
from shadefs.common import (
    EXIT_INTERNAL,
    EXIT_NOT_SHADEFS,
    EXIT_USAGE,
    QuietError,
    parse_float,
    parse_int,
)
from shadefs.options import KERNEL_HITS_MODES, argtype
from shadefs.torch.client import ControlClient, read_stats

log = logging.getLogger(__name__)

_WAIT = "seconds to wait for the daemon to answer (default: %(default)g)"


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, as every other error of the command line
    (`--help` shows the usage); its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="shadefs",
        description="A caching filesystem for deep-learning training data.",
    )
    p.add_argument("--version", action="version", version=f"shadefs {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    m = sub.add_parser("mount", help="mount SRC on MNT with a cache in front of it")
    options.add_arguments(m)

    u = sub.add_parser("umount", help="unmount MNT and wait for its daemon to exit")
    u.add_argument("mountpoint", metavar="MNT")
    u.add_argument("-z", "--lazy", action="store_true", help="lazy unmount (detach now)")
    u.add_argument(
        "--timeout", type=argtype(parse_float), default=30.0, help="seconds to wait for the daemon"
    )

    s = sub.add_parser("stat", help="show the cache statistics of a mount")
    s.add_argument("mountpoint", metavar="MNT")
    s.add_argument("--json", action="store_true", help="print stats.json")
    s.add_argument("--watch", action="store_true", help="a live view, refreshed every --interval")
    s.add_argument(
        "--interval", type=argtype(parse_float), default=1.0, help="seconds between refreshes"
    )
    s.add_argument("--timeout", type=argtype(parse_float), default=ANSWER_TIMEOUT, help=_WAIT)

    w = sub.add_parser("warmup", help="read files into the cache ahead of training")
    from shadefs.ops import warmup

    warmup.add_arguments(w)
    w.add_argument(
        "--timeout",
        type=argtype(parse_float),
        default=ANSWER_TIMEOUT,
        help="seconds to wait for the daemon to answer the first check of the mount "
        "(default: %(default)g)",
    )

    c = sub.add_parser("ctl", help="send a control command to a mount")
    c.add_argument("mountpoint", metavar="MNT")
    c.add_argument("words", nargs="+", metavar="COMMAND", help="e.g.  ram 8G")
    c.add_argument("--timeout", type=argtype(parse_float), default=ANSWER_TIMEOUT, help=_WAIT)

    d = sub.add_parser("demo", help="mount a bundled dataset and show what the cache does")
    d.add_argument("--dataset", help="an ImageFolder tree to use instead of the bundled one")
    d.add_argument("--epochs", type=argtype(parse_int), default=5)
    d.add_argument("--workdir", help="where to put the dataset and mounts (default: a temp dir)")
    d.add_argument(
        "--kernel-hits",
        choices=KERNEL_HITS_MODES,
        default="off",
        help="mount shadefs with --kernel-hits (FUSE no-open; default off)",
    )
    return p


def cmd_mount(args: argparse.Namespace, argv: list[str]) -> int:
    opts = options.from_args(args)
    check_environment(opts)
    if opts.foreground:
        from shadefs.daemon import run_daemon

        return run_daemon(opts, args.ready_fd)
    return spawn_background(argv, opts)


def cmd_stat(args: argparse.Namespace) -> int:
    if args.watch:
        from shadefs.ops.watch import watch

        mnt = os.path.abspath(args.mountpoint)
        return watch(
            args.mountpoint, args.interval, ask=lambda read: within(args.timeout, mnt, read)
        )
    client = ControlClient(args.mountpoint)
    name = "stats.json" if args.json else "stats"
    sys.stdout.write(within(args.timeout, client.mountpoint, lambda: client.text(name)))
    sys.stdout.flush()
    return 0


def cmd_ctl(args: argparse.Namespace) -> int:
    client = ControlClient(args.mountpoint)
    print(within(args.timeout, client.mountpoint, lambda: client.ctl(" ".join(args.words))))
    return 0


def cmd_umount(args: argparse.Namespace) -> int:
    # The mount point's own path is never resolved through the mount: stat'ing it would
    # wait on a stopped daemon.
    raw = os.path.abspath(args.mountpoint)
    mnt = os.path.join(os.path.realpath(os.path.dirname(raw)), os.path.basename(raw))
    if not mounted(mnt):
        raise QuietError(f"{mnt} is not mounted", EXIT_NOT_SHADEFS)
    if args.lazy:
        # A lazy detach needs nothing from the daemon: it is not asked (a stopped one would
        # hold the command for the whole answer timeout). The daemon exits once it runs
        # and finds its mount gone.
        _fusermount(mnt, ["-z"], args.timeout)
        print(f"shadefs: detached {mnt}; its daemon exits once its mount is gone", file=sys.stderr)
        return 0
    pid = None
    try:
        pid = int(within(min(args.timeout, ANSWER_TIMEOUT), mnt, lambda: read_stats(mnt))["pid"])
    except NoAnswer:
        raise
    except (QuietError, OSError, ValueError, KeyError, TypeError):
        pass  # a dead daemon (ENOTCONN) is unmounted all the same
    _fusermount(mnt, [], args.timeout)
    if pid is not None:
        deadline = time.monotonic() + args.timeout
        while _alive(pid):
            if time.monotonic() > deadline:
                raise QuietError(
                    f"unmounted, but daemon {pid} is still running after {args.timeout:.0f} s",
                    EXIT_NOT_SHADEFS,
                )
            time.sleep(0.05)
    return 0


def _fusermount(mnt: str, flags: list[str], timeout: float) -> None:
    """`fusermount3 -u FLAGS MNT`, or QuietError saying why it failed."""
    try:
        res = subprocess.run(
            ["fusermount3", "-u", *flags, mnt], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        raise QuietError(
            f"unmounting {mnt}: fusermount3 did not finish", EXIT_NOT_SHADEFS
        ) from None
    if res.returncode != 0:
        msg = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed"
        raise QuietError(f"unmounting {mnt}: {msg}", EXIT_NOT_SHADEFS)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def cmd_demo(args: argparse.Namespace) -> int:
    from shadefs.demo.run import run_demo

    return run_demo(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "mount":
            return cmd_mount(args, argv)
        if args.command == "umount":
            return cmd_umount(args)
        if args.command == "stat":
            return cmd_stat(args)
        if args.command == "ctl":
            return cmd_ctl(args)
        if args.command == "demo":
            return cmd_demo(args)
        if args.command == "warmup":
            from shadefs.ops import warmup

            client = ControlClient(args.mountpoint)
            within(args.timeout, client.mountpoint, client.check)  # a stopped daemon: exit 7
            return warmup.run(args)
    except QuietError as exc:
        print(f"shadefs: error: {exc}", file=sys.stderr)
        return exc.exitcode
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `shadefs stat --json | head -1`: the reader left. Quiet, like a tool killed by
        # SIGPIPE; stdout goes to /dev/null so that the flush at exit cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    parser.error(f"unknown command {args.command}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        logging.exception("internal error")
        sys.exit(EXIT_INTERNAL)
