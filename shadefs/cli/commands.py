"""The `shadefs` command line: mount, umount, stat, ctl, demo.

Expected failures print one line (`shadefs: error: ...`) and exit with the code documented
in common.py; only bugs produce a traceback (exit code 1).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import subprocess
import sys
import time

from shadefs import __version__
from shadefs.cli.background import MountOptions, check_environment, default_ram, spawn_background
from shadefs.common import EXIT_INTERNAL, EXIT_NOT_SHADEFS, EXIT_USAGE, QuietError, parse_size
from shadefs.torch.client import ControlClient, read_stats

log = logging.getLogger(__name__)

# Words that belong to fstab/mount(8), not to shadefs: accepted and ignored.
_FSTAB_WORDS = {
    "defaults", "auto", "noauto", "nofail", "_netdev", "user", "users", "nouser", "rw", "ro",
    "suid", "nosuid", "dev", "nodev", "exec", "noexec", "sync", "async", "relatime",
    "norelatime", "strictatime", "owner", "group",
}  # fmt: skip
# -o name -> (option attribute, takes a value)
_O_OPTIONS = {
    "ram": ("ram", True),
    "policy": ("policy", True),
    "max_entry": ("max_entry", True),
    "allow_other": ("allow_other", False),
    "log_level": ("log_level", True),
    "log": ("log", True),
    "source_timeout": ("source_timeout", True),
    "source_threads": ("source_threads", True),
    "ssd": ("ssd", True),
    "ssd_min_free": ("ssd_min_free", True),
    "revalidate": ("revalidate", True),
    "metrics": ("metrics", True),
    "prefetch": ("prefetch", True),
    "prefetch_window": ("prefetch_window", True),
    "prefetch_workers": ("prefetch_workers", True),
    "prefetch_abandon": ("prefetch_abandon", True),
}


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shadefs",
        description="A caching filesystem for deep-learning training data.",
    )
    p.add_argument("--version", action="version", version=f"shadefs {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    m = sub.add_parser("mount", help="mount SRC on MNT with a cache in front of it")
    m.add_argument("source", metavar="SRC", help="the dataset tree (e.g. an NFS mount)")
    m.add_argument("mountpoint", metavar="MNT", help="an empty directory to mount on")
    m.add_argument("-f", "--foreground", action="store_true", help="stay attached")
    m.add_argument(
        "--ram", type=_size, help="RAM budget, e.g. 16G (default: 1/4 of available memory)"
    )
    m.add_argument(
        "--policy",
        choices=["epoch", "lru", "shade", "belady"],
        help="eviction policy (default epoch)",
    )
    m.add_argument(
        "--max-entry", type=_size, help="files larger than this are read through, not cached"
    )
    m.add_argument("--allow-other", action="store_true", help="let other users read the mount")
    m.add_argument("-o", dest="opts", action="append", default=[], help="fstab-style options")
    m.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    m.add_argument("--log", help="log file, 'syslog', 'stderr' or 'none'")
    m.add_argument("--source-timeout", type=float, help="seconds before a source call is EIO")
    m.add_argument(
        "--ssd",
        metavar="DIR[:SIZE]",
        help="local SSD cache directory and budget (default 80%% of free space)",
    )
    m.add_argument("--ssd-min-free", type=_size, help="free space to leave on the cache disk")
    m.add_argument(
        "--revalidate", type=float, help="seconds before a file is checked against SRC again (3600)"
    )
    m.add_argument("--systemd", action="store_true", help="run as a Type=notify service")
    m.add_argument(
        "--metrics", metavar="[HOST:]PORT", help="serve Prometheus metrics (loopback by default)"
    )
    m.add_argument(
        "--prefetch",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fetch the misses of a known order ahead of the reader (default: on)",
    )
    m.add_argument(
        "--prefetch-window", type=_size, help="bytes staged ahead (default: RAM/4, 64M-1G)"
    )
    m.add_argument("--prefetch-workers", type=int, help="most fetches in flight (16)")
    m.add_argument(
        "--prefetch-abandon", type=float, help="seconds without progress that end a plan (60)"
    )
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)

    u = sub.add_parser("umount", help="unmount MNT and wait for its daemon to exit")
    u.add_argument("mountpoint", metavar="MNT")
    u.add_argument("-z", "--lazy", action="store_true", help="lazy unmount (detach now)")
    u.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the daemon")

    s = sub.add_parser("stat", help="show the cache statistics of a mount")
    s.add_argument("mountpoint", metavar="MNT")
    s.add_argument("--json", action="store_true", help="print stats.json")
    s.add_argument("--watch", action="store_true", help="a live view, refreshed every --interval")
    s.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")

    w = sub.add_parser("warmup", help="read files into the cache ahead of training")
    from shadefs.ops import warmup

    warmup.add_arguments(w)

    c = sub.add_parser("ctl", help="send a control command to a mount")
    c.add_argument("mountpoint", metavar="MNT")
    c.add_argument("words", nargs="+", metavar="COMMAND", help="e.g.  ram 8G")

    d = sub.add_parser("demo", help="mount a bundled dataset and show what the cache does")
    d.add_argument("--dataset", help="an ImageFolder tree to use instead of the bundled one")
    d.add_argument("--epochs", type=int, default=5)
    d.add_argument("--workdir", help="where to put the dataset and mounts (default: a temp dir)")
    return p


def _mount_options(args: argparse.Namespace) -> MountOptions:

    values: dict[str, object] = {}
    extra: list[str] = []
    for group in args.opts:
        for word in filter(None, (w.strip() for w in group.split(","))):
            key, _, value = word.partition("=")
            if key in _FSTAB_WORDS or key.startswith(("x-systemd.", "x-", "comment")):
                continue
            if key not in _O_OPTIONS:
                raise QuietError(f"unknown mount option {key!r} in -o")
            attr, takes_value = _O_OPTIONS[key]
            if takes_value and not value:
                raise QuietError(f"mount option {key} needs a value ({key}=...)")
            if not takes_value and value:
                raise QuietError(f"mount option {key} takes no value")
            values[attr] = value if takes_value else True
    # Command-line flags win over -o.
    for attr in (
        "ram", "policy", "max_entry", "log_level", "log", "source_timeout", "ssd",
        "ssd_min_free", "revalidate", "metrics", "prefetch", "prefetch_window",
        "prefetch_workers", "prefetch_abandon",
    ):  # fmt: skip
        v = getattr(args, attr)
        if v is not None:
            values[attr] = v
    if args.allow_other:
        values["allow_other"] = True
    try:
        for attr in ("ram", "max_entry", "ssd_min_free", "prefetch_window"):
            if isinstance(values.get(attr), str):
                values[attr] = parse_size(values[attr])  # type: ignore[arg-type]
        for attr in ("source_timeout", "revalidate", "prefetch_abandon"):
            if isinstance(values.get(attr), str):
                values[attr] = float(values[attr])  # type: ignore[arg-type]
        if isinstance(values.get("prefetch_workers"), str):
            values["prefetch_workers"] = int(values["prefetch_workers"])  # type: ignore[arg-type]
        if isinstance(values.get("prefetch"), str):
            flag = str(values["prefetch"]).lower()
            if flag not in ("on", "off", "yes", "no", "true", "false", "1", "0"):
                raise QuietError(f"prefetch=on or prefetch=off, not {flag!r}")
            values["prefetch"] = flag in ("on", "yes", "true", "1")
        if values.get("ssd"):
            # DIR[:SIZE]; a directory name may itself contain ':', so split at the last one
            # only when what follows parses as a size.
            path, sep, size = str(values["ssd"]).rpartition(":")
            if sep and path:
                try:
                    values["ssd_size"] = parse_size(size)
                    values["ssd"] = path
                except ValueError:
                    pass
        if isinstance(values.get("source_threads"), str):
            values["source_threads"] = int(values["source_threads"])  # type: ignore[arg-type]
    except ValueError as exc:
        raise QuietError(str(exc)) from None
    if values.get("policy", "epoch") not in ("epoch", "lru", "shade", "belady"):
        raise QuietError(f"unknown policy {values['policy']!r} (epoch, lru, shade or belady)")
    if values.get("log_level", "info") not in ("debug", "info", "warning", "error"):
        raise QuietError(f"unknown log level {values['log_level']!r}")
    if values.get("ram") is None:
        values["ram"] = default_ram()
    if values.get("metrics"):
        from shadefs.ops.prom import parse_address

        try:
            parse_address(str(values["metrics"]))
        except ValueError as exc:
            raise QuietError(f"--metrics: {exc}") from None
    return MountOptions(
        source=args.source,
        mountpoint=args.mountpoint,
        foreground=args.foreground or args.systemd,
        systemd=args.systemd,
        extra_fuse=extra,
        **values,  # type: ignore[arg-type]
    )


def cmd_mount(args: argparse.Namespace, argv: list[str]) -> int:
    opts = _mount_options(args)
    check_environment(opts)
    if opts.foreground:
        from shadefs.daemon import run_daemon

        return run_daemon(opts, args.ready_fd)
    return spawn_background(argv, opts)


def cmd_stat(args: argparse.Namespace) -> int:
    if args.watch:
        from shadefs.ops.watch import watch

        return watch(args.mountpoint, args.interval)
    sys.stdout.write(ControlClient(args.mountpoint).text("stats.json" if args.json else "stats"))
    return 0


def cmd_ctl(args: argparse.Namespace) -> int:
    print(ControlClient(args.mountpoint).ctl(" ".join(args.words)))
    return 0


def cmd_umount(args: argparse.Namespace) -> int:
    mnt = os.path.abspath(args.mountpoint)
    pid = None
    try:
        pid = int(read_stats(mnt)["pid"])  # type: ignore[arg-type]
    except (QuietError, OSError, ValueError, KeyError):
        pass  # a dead daemon (ENOTCONN) is unmounted all the same
    if not os.path.ismount(mnt):
        try:
            os.stat(mnt)
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:
                raise QuietError(f"{mnt}: {exc.strerror}", EXIT_NOT_SHADEFS) from None
        else:
            raise QuietError(f"{mnt} is not mounted", EXIT_NOT_SHADEFS)
    cmd = ["fusermount3", "-u", *(["-z"] if args.lazy else []), mnt]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        msg = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed"
        raise QuietError(f"unmounting {mnt}: {msg}", EXIT_NOT_SHADEFS)
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

            return warmup.run(args)
    except QuietError as exc:
        print(f"shadefs: error: {exc}", file=sys.stderr)
        return exc.exitcode
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command}")
    return EXIT_USAGE


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        logging.exception("internal error")
        sys.exit(EXIT_INTERNAL)
