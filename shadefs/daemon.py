"""The daemon: mount one Service, serve its requests, and unmount cleanly.

The parts of a mount and what control asks of them are the service object's
(shadefs/service.py); this module owns the process around it: logging, the mount itself,
the nursery in which the parts' tasks run, signals, the Prometheus endpoint, and readiness.

Readiness means the mount answers. After pyfuse3.init the daemon stats its own mount point
from a worker thread while the request loop runs, and only then reports ready: on the pipe
of a background mount (cli/background.py), or as READY=1 to systemd with `--systemd`.
"""

from __future__ import annotations

import gc
import logging
import logging.handlers
import os
import resource
import signal
import sys
from pathlib import Path

# numpy (2.x) loads numpy.ma at the first `np.unique` of the process, to ask whether its
# argument is masked: ~30 ms of one loop step, which fell inside the first warm epoch (the
# `epoch` policy's bucket moves call it). Loaded with the rest of start-up instead.
import numpy.ma  # noqa: F401
import pyfuse3
import trio

from shadefs.common import EXIT_MOUNT_FAILED, QuietError
from shadefs.kernel import tuning
from shadefs.options import MountOptions
from shadefs.service import Service
from shadefs.stats import Stats

log = logging.getLogger(__name__)

# The collector's young-generation threshold (CPython: 700 allocations). A cold open leaves
# a few container objects behind (its entry, signature, records) among dozens that die at
# once; at 700 a cold epoch ran a young collection every ~120 opens and a full one every
# ~10k, about 7 us of CPU per open (bench_cpu, timed with gc.callbacks); at 10k, about 2.
# A young collection of 10k objects takes a few ms of the loop, well inside its lag bound.
GC_YOUNG = 10_000

# pyfuse3 reads the next request from /dev/fuse only while fewer than this many request
# tasks are busy. A request that waits on a hung source holds its task until its deadline
# (--source-timeout): at pyfuse3's default of 99, 100 readers of missed files stopped the
# whole mount, hits and stats.json included, and each further wave of misses waited one
# timeout more in the kernel's queue. An idle task costs nothing (pyfuse3 ends tasks beyond
# the idle minimum), a busy one a trio task and its request's buffer (touched pages only).
MAX_REQUEST_TASKS = 1024


def setup_logging(opts: MountOptions) -> None:
    root = logging.getLogger()
    root.handlers.clear()
    if opts.systemd:
        # journald adds its own timestamps; <N> prefixes carry the priority.
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_JournalFormatter())
    elif opts.log in (None, "-", "stderr"):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    elif opts.log == "none":
        handler = logging.NullHandler()
    elif opts.log == "syslog":
        handler = logging.handlers.SysLogHandler(address="/dev/log")
        handler.setFormatter(logging.Formatter("shadefs[%(process)d]: %(name)s: %(message)s"))
    else:
        Path(opts.log).parent.mkdir(parents=True, exist_ok=True)
        handler = logging.handlers.WatchedFileHandler(opts.log)
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
        )
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("shadefs").setLevel(opts.log_level.upper())


class _JournalFormatter(logging.Formatter):
    _PRIO = {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}

    def format(self, record: logging.LogRecord) -> str:
        return f"<{self._PRIO.get(record.levelname, 6)}>{record.name}: {record.getMessage()}"


def run_daemon(opts: MountOptions, ready_fd: int | None = None) -> int:
    """Mount and serve until unmounted or signalled. Returns the exit code.

    The caller has checked the environment (shadefs.cli.checks.check_environment).
    """
    setup_logging(opts)
    raise_nofile()
    try:
        return Daemon(opts, ready_fd).run()
    except QuietError as exc:
        _report(ready_fd, str(exc))
        raise
    except BaseException:
        log.exception("the daemon failed")
        _report(ready_fd, "the daemon failed unexpectedly (see its log)")
        raise


def raise_nofile() -> None:
    """Raise the soft descriptor limit to the hard one: readers' pass-through opens each
    hold a source descriptor, and 1,024 is soon reached (source/part.py caps them per user)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError) as exc:
            log.info("cannot raise the descriptor limit from %d to %d: %s", soft, hard, exc)


def _report(ready_fd: int | None, msg: str) -> None:
    if ready_fd is None:
        return
    try:
        os.write(ready_fd, msg.encode())
        os.close(ready_fd)
    except OSError:
        pass


def fuse_options(opts: MountOptions) -> set[str]:
    fsname = os.path.abspath(opts.source)
    # libfuse splits options on commas; keep the source out of fsname if it has one.
    if "," in fsname or "\\" in fsname:
        fsname = "shadefs"
    options = set(pyfuse3.default_options)
    options |= {f"fsname={fsname}", "subtype=shadefs", "noatime"}
    if opts.allow_other:
        options.add("allow_other")
    options.update(opts.extra_fuse)
    return options


class Daemon:
    """One mount's lifetime: build the service, mount, serve, unmount.

    :service: the parts and their service methods
    :ready: the mount has answered a request (a daemon that dies after that leaves its
        mount answering ENOTCONN; one that dies before takes it down)
    """

    def __init__(self, opts: MountOptions, ready_fd: int | None = None) -> None:
        self.opts = opts
        self.ready_fd = ready_fd
        self.service = Service(opts)
        self.mountpoint = self.service.mountpoint
        self.ready = False
        self._token: trio.lowlevel.TrioToken | None = None

    def run(self) -> int:
        opts, mnt = self.opts, self.mountpoint
        if opts.metrics:
            # Started before the mount, so that a taken port fails the mount cleanly.
            self._start_metrics(opts.metrics)
        try:
            pyfuse3.init(self.service.operations, mnt, fuse_options(opts))
        except RuntimeError as exc:
            raise QuietError(f"mounting {mnt} failed: {exc}", EXIT_MOUNT_FAILED) from None
        log.info(
            "mounted %s on %s (ram %d bytes, policy %s)", opts.source, mnt, opts.ram, opts.policy
        )
        clean = False
        gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])
        try:
            trio.run(self._serve)
            clean = True
        finally:
            # A daemon that dies while serving leaves its mount answering ENOTCONN, so that a
            # training job cannot mistake it for an empty dataset (S3QL does the same). One
            # that fails before it was ever ready takes its mount down with it.
            pyfuse3.close(unmount=clean or not self.ready)
            self.service.close()
            log.info("unmounted %s", mnt)
        return 0

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self.service.start(nursery)
            nursery.start_soon(_signals)
            nursery.start_soon(self._announce_ready)
            await pyfuse3.main(max_tasks=MAX_REQUEST_TASKS)
            nursery.cancel_scope.cancel()

    def _start_metrics(self, addr: str) -> None:
        """Prometheus over HTTP. Scrapes arrive on the server's thread; the stats are
        computed in the trio thread, where the state they read is consistent."""
        from shadefs.ops.prom import start_server

        def threadsafe() -> Stats:
            if self._token is None:
                raise RuntimeError("the daemon is still starting")
            return trio.from_thread.run_sync(self.service.stats, trio_token=self._token)

        try:
            host, port = start_server(addr, threadsafe)
        except (OSError, ValueError) as exc:
            raise QuietError(f"--metrics {addr}: {exc}", EXIT_MOUNT_FAILED) from None
        log.info("serving Prometheus metrics on http://%s:%d/metrics", host, port)

    async def _announce_ready(self) -> None:
        # The stat goes through the kernel to our own request loop: when it returns, the
        # mount answers. It must run in a thread, or it would wait for the loop it blocks.
        st = await trio.to_thread.run_sync(os.stat, self.mountpoint)
        await trio.to_thread.run_sync(tuning.tune, st.st_dev)
        self.ready = True
        # What start-up built (modules, options, the parts) lives as long as the daemon:
        # out of every later collection's scan.
        gc.freeze()
        log.info("mount %s is ready", self.mountpoint)
        if self.opts.systemd:
            from shadefs.ops import sdnotify

            sdnotify.ready(f"serving {self.opts.source} on {self.mountpoint}")
        _report(self.ready_fd, "ready")


async def _signals() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            if signum == signal.SIGHUP:
                log.info("SIGHUP: nothing to reload")
                continue
            log.info("got %s, unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
