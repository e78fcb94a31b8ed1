"""``python -m shadefs.demo.slowfs SRC MNT``: mount an emulated slow remote filer.

shadefs is benchmarked against NFS servers backed by spinning disks or busy cloud filers,
but development machines have neither NFS nor tc-netem. slowfs mirrors a local directory
and charges every request what such a server would (``shadefs.demo.slowfs_ops``):

* ``--open-latency MS`` on every open (default 5), ``--read-latency MS`` on every read
  request (default 0), ``--meta-latency MS`` on lookup, getattr and readdir (default 0.5);
* ``--bandwidth MB/s`` (10**6 bytes/s, default 100, 0 = unlimited), one link shared by all
  concurrent readers, so four readers split it rather than getting it four times;
* ``--jitter FRACTION`` scales each latency by a random factor in [1-F, 1+F];
* ``--dir-timeout S`` lets the kernel cache a directory's attributes and entries for S
  seconds (default 1), as NFS clients do (acdirmin); a file's are never cached.
* ``--hang-on KINDS`` (``open``, ``read``, ``readdir``, comma-separated): SIGUSR1 makes
  those requests hang until SIGUSR2, as a server that stops answering one kind of request
  (SIGSTOP hangs all of them, the emulator's stats included).

Latencies are ``trio.sleep`` calls, so concurrent requests overlap like requests queued
on a real server: one request's latency never delays another's. The emulator's own CPU
is what it costs the machine (one Python loop, ~0.1 ms per request on a 2-core VM): a
read sleeps once for its latency and transfer together, and idle request tasks are kept
between bursts.

``getfattr -n user.slowfs.stats MNT`` returns JSON counters (opens, reads, bytes, ...)
so that tests can check which requests reached the "remote", and the emulator's CPU:
``cpu_seconds``, ``cpu_share`` (of one core, since the mount) and ``cpu_share_recent``
(since the previous read of the stats).

This module owns the command line, daemonizing and the serve loop. The demo, the tests
and the benchmarks run it as ``python -m shadefs.demo.slowfs SRC MNT [--daemon] [options]``;
SIGTERM or SIGINT unmounts cleanly, as does ``fusermount3 -u MNT``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import pyfuse3
import trio

from shadefs.demo.slowfs_ops import HANG_KINDS, SlowOperations

# Run with -m, this module is __main__: name its logger after it all the same.
log = logging.getLogger("shadefs.demo.slowfs")

_IDLE_TASKS = 16


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m shadefs.demo.slowfs",
        description="Mount SRC read-only on MNT with the latency and bandwidth of a slow "
        "remote filer. Stats: getfattr -n user.slowfs.stats MNT",
    )
    parser.add_argument("source", metavar="SRC", help="directory to mirror")
    parser.add_argument("mountpoint", metavar="MNT", help="empty directory to mount on")
    parser.add_argument(
        "--open-latency", type=float, default=5.0, metavar="MS", help="per open (default 5)"
    )
    parser.add_argument(
        "--read-latency", type=float, default=0.0, metavar="MS", help="per read (default 0)"
    )
    parser.add_argument(
        "--meta-latency",
        type=float,
        default=0.5,
        metavar="MS",
        help="per lookup, getattr and readdir (default 0.5)",
    )
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=100.0,
        metavar="MB/S",
        help="shared by all readers, in 10**6 bytes/s (default 100, 0 = unlimited)",
    )
    parser.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="scale each latency by a random factor in [1-F, 1+F] (default 0)",
    )
    parser.add_argument(
        "--dir-timeout",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds the kernel may cache a directory's attributes and entries, as NFS "
        "clients do (default 1; a file's are never cached)",
    )
    parser.add_argument(
        "--no-direct-io",
        dest="direct_io",
        action="store_false",
        help="allow readahead and mmap within one open (the cache is still dropped on every open)",
    )
    parser.add_argument(
        "--hang-on",
        default="",
        metavar="KINDS",
        help="comma-separated request kinds (open, read, readdir) that hang from SIGUSR1 "
        "until SIGUSR2",
    )
    parser.add_argument("--allow-other", action="store_true", help="let other users read")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "-f", "--foreground", action="store_true", help="stay in the foreground (default)"
    )
    mode.add_argument(
        "--daemon",
        action="store_true",
        help="go to the background once mounted; exit 0 when the mount is ready",
    )
    parser.add_argument("--log", metavar="FILE", help="log here (default: stderr; none daemonized)")
    parser.add_argument(
        "--log-level",
        type=str.upper,
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="default: warning",
    )
    args = parser.parse_args(argv)
    for name in ("open_latency", "read_latency", "meta_latency", "bandwidth", "dir_timeout"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative")
    args.hang_on = frozenset(filter(None, args.hang_on.split(",")))
    if not args.hang_on <= HANG_KINDS:
        parser.error(f"--hang-on takes {', '.join(sorted(HANG_KINDS))}")
    if not 0 <= args.jitter <= 1:
        parser.error("--jitter must be between 0 and 1")
    if not os.path.isdir(args.source):
        parser.error(f"{args.source} is not a directory")
    if not os.path.isdir(args.mountpoint):
        parser.error(f"{args.mountpoint} is not a directory")
    # --daemon changes directory to /, so relative paths would break afterwards.
    args.source = os.path.abspath(args.source)
    args.mountpoint = os.path.abspath(args.mountpoint)
    return args


def _daemonize() -> int:
    """Fork; the parent waits until the child reports the mount ready, then exits.

    Return the pipe descriptor on which the child reports readiness.
    """
    read_end, write_end = os.pipe()
    if os.fork():
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            answer = pipe.read()
        # The child's start-up errors already went to our shared stderr.
        os._exit(0 if answer == b"ready" else 1)
    os.close(read_end)
    os.setsid()
    # Do not pin the caller's working directory (and its filesystem) for our lifetime;
    # the source is already absolute and the log file already open.
    os.chdir("/")
    return write_end


def _detach_stdio(log_file: str | None) -> None:
    """Point stdio at /dev/null, so that a caller capturing our output sees EOF."""
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    if log_file is None:
        # Logging would otherwise write into a pipe that nobody reads any more.
        logging.disable(logging.CRITICAL)
    os.dup2(devnull, 2)
    os.close(devnull)


async def _serve(ops: SlowOperations, ready_fd: int | None, log_file: str | None) -> None:
    # Install the handlers before reporting ready, so that a caller may signal at once.
    with trio.open_signal_receiver(
        signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2
    ) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_on_signals, ops, signals)
            if ready_fd is not None:
                _detach_stdio(log_file)
                os.write(ready_fd, b"ready")
                os.close(ready_fd)
            # Idle request tasks are kept rather than ended and restarted with each burst:
            # starting tasks is a share of the emulator's CPU under load.
            await pyfuse3.main(min_tasks=_IDLE_TASKS)
            # main() also returns after an external `fusermount3 -u`; stop the watcher.
            nursery.cancel_scope.cancel()


async def _on_signals(ops: SlowOperations, signals: Any) -> None:
    async for signum in signals:
        if signum == signal.SIGUSR1:
            ops.hang()
            log.info("SIGUSR1: %s requests hang", ",".join(sorted(ops.hang_on)) or "no")
            continue
        if signum == signal.SIGUSR2:
            ops.resume()
            log.info("SIGUSR2: requests answer again")
            continue
        log.info("%s received, unmounting", signal.Signals(signum).name)
        pyfuse3.terminate()
        return


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        filename=args.log,
        level=args.log_level,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
    )
    ops = SlowOperations(
        args.source,
        open_latency=args.open_latency / 1e3,
        read_latency=args.read_latency / 1e3,
        meta_latency=args.meta_latency / 1e3,
        bandwidth=args.bandwidth * 1e6,
        jitter=args.jitter,
        direct_io=args.direct_io,
        dir_timeout=args.dir_timeout,
        hang_on=args.hang_on,
    )
    options = set(pyfuse3.default_options)
    options |= {"fsname=slowfs", "subtype=slowfs", "ro"}
    if args.allow_other:
        options.add("allow_other")

    ready_fd = _daemonize() if args.daemon else None
    try:
        pyfuse3.init(ops, args.mountpoint, options)
    except RuntimeError as exc:
        log.error("cannot mount %s: %s", args.mountpoint, exc)
        return 1
    log.info(
        "serving %s on %s (open %.1f ms, read %.1f ms, meta %.1f ms, %s MB/s)",
        args.source,
        args.mountpoint,
        args.open_latency,
        args.read_latency,
        args.meta_latency,
        args.bandwidth or "unlimited",
    )
    try:
        trio.run(_serve, ops, ready_fd, args.log)
    finally:
        # Unmounting is safe after an external unmount too: libfuse notices the closed
        # channel and skips it.
        pyfuse3.close(unmount=True)
    log.info("unmounted %s", args.mountpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
