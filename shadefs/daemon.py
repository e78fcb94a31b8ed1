"""The daemon: build the filesystem objects, mount, serve, and unmount cleanly.

Readiness means the mount answers. After pyfuse3.init the daemon stats its own mount point
from a worker thread while the request loop runs, and only then reports ready: on the pipe
of a background mount (mount.py), or as READY=1 to systemd with `--systemd`.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pyfuse3
import trio

from shadefs.cache.coordinator import Cache
from shadefs.cache.policies import make_policy
from shadefs.cache.prefetch import Prefetcher
from shadefs.cache.ssd_store import CacheLocked, SsdStore
from shadefs.cache.ssd_tier import SsdTier
from shadefs.cli.background import MountOptions, check_environment
from shadefs.common import EXIT_CACHE_LOCKED, EXIT_MOUNT_FAILED, EXIT_USAGE, QuietError
from shadefs.control.files import Control
from shadefs.fs.namespace import Namespace
from shadefs.fs.operations import Operations
from shadefs.sampling.registry import Sampling
from shadefs.source import Source
from shadefs.stats import Metrics, snapshot

log = logging.getLogger(__name__)

# Set once the mount has answered its first request (see _run's cleanup).
_READY = False


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
    """Mount and serve until unmounted or signalled. Returns the exit code."""
    setup_logging(opts)
    try:
        return _run(opts, ready_fd)
    except QuietError as exc:
        _report(ready_fd, str(exc))
        raise
    except BaseException:
        log.exception("the daemon failed")
        _report(ready_fd, "the daemon failed unexpectedly (see its log)")
        raise


def _report(ready_fd: int | None, msg: str) -> None:
    if ready_fd is None:
        return
    try:
        os.write(ready_fd, msg.encode())
        os.close(ready_fd)
    except OSError:
        pass


def ssd_defaults(path: str, size: int | None, min_free: int | None) -> tuple[int, int]:
    """(budget, free-space floor) for a cache directory.

    By default the floor is 5% of the cache filesystem (at most 1 GiB) and the budget 80% of
    what is free above it when the cache is created. The budget is recorded in DIR/budget
    and reused by later mounts that give no SIZE: recomputed from the free space, it would
    shrink on every remount by what the cache itself already occupies.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    sv = os.statvfs(path)
    total, free = sv.f_blocks * sv.f_frsize, sv.f_bavail * sv.f_frsize
    floor = min(total // 20, 1 << 30) if min_free is None else min_free
    record = Path(path) / "budget"
    if size is None:
        try:
            size = int(record.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            size = int(max(free - floor, 0) * 0.8)
    try:
        tmp = record.with_suffix(".tmp")
        tmp.write_text(f"{size}\n")
        tmp.replace(record)
    except OSError as exc:
        log.warning("cannot record the SSD budget in %s: %s", record, exc.strerror)
    return size, floor


def build(opts: MountOptions) -> tuple[Operations, dict[str, object]]:
    """The filesystem objects for `opts` (also used by tests that drive handlers directly)."""
    source = Source(opts.source, max_threads=opts.source_threads, timeout=opts.source_timeout)
    ns = Namespace(source, timeout=opts.revalidate, revalidate=opts.revalidate)
    metrics = Metrics()
    sampling = Sampling()
    ssd = None
    if opts.ssd:
        budget, floor = ssd_defaults(opts.ssd, opts.ssd_size, opts.ssd_min_free)
        try:
            store = SsdStore(Path(opts.ssd), budget, min_free=floor)
        except CacheLocked as exc:
            raise QuietError(str(exc), EXIT_CACHE_LOCKED) from None
        except OSError as exc:
            raise QuietError(f"cache directory {opts.ssd}: {exc.strerror}", EXIT_USAGE) from None
        ssd = SsdTier(store, make_policy("epoch"), ns.key_of_ino)
    cache = Cache(
        source,
        make_policy("epoch"),
        metrics,
        capacity=opts.ram,
        max_entry=opts.max_entry,
        ssd=ssd,
    )
    prefetcher = None
    if opts.prefetch:
        window = opts.prefetch_window or min(max(opts.ram // 4, 64 << 20), 1 << 30)
        prefetcher = Prefetcher(
            cache,
            window=window,
            max_workers=opts.prefetch_workers,
            abandon_after=opts.prefetch_abandon,
        )
        cache.prefetcher = prefetcher
    next_use = prefetcher.next_use if prefetcher else None
    cache.set_policy(
        make_policy(opts.policy, sampling.score_of, next_use),
        make_policy(opts.policy, sampling.score_of, next_use),
    )
    mnt = os.path.abspath(opts.mountpoint)

    def stats() -> dict[str, object]:
        s = snapshot(metrics, cache, ns, source, mnt)
        s["sampler"] = sampling.describe()
        if prefetcher is not None:
            s["prefetch"] = prefetcher.describe()
        return s

    control = Control(cache, metrics, ns, sampling, stats, prefetcher=prefetcher)
    ops = Operations(ns, cache, control, metrics, source)
    parts = {"source": source, "ns": ns, "cache": cache, "metrics": metrics}
    parts["sampling"] = sampling
    parts["control"] = control
    parts["ssd"] = ssd
    parts["stats"] = stats
    parts["prefetcher"] = prefetcher
    return ops, parts


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


def _run(opts: MountOptions, ready_fd: int | None) -> int:
    check_environment(opts)
    ops, parts = build(opts)
    ssd = parts["ssd"]
    assert ssd is None or isinstance(ssd, SsdTier)
    mnt = os.path.abspath(opts.mountpoint)
    token: list[trio.lowlevel.TrioToken] = []
    if opts.metrics:
        # Started before the mount, so that a taken port fails the mount cleanly.
        _start_metrics(opts.metrics, parts["stats"], token)  # type: ignore[arg-type]
    try:
        pyfuse3.init(ops, mnt, fuse_options(opts))
    except RuntimeError as exc:
        raise QuietError(f"mounting {mnt} failed: {exc}", EXIT_MOUNT_FAILED) from None
    log.info("mounted %s on %s (ram %d bytes, policy %s)", opts.source, mnt, opts.ram, opts.policy)
    clean = False
    try:
        trio.run(_serve, opts, mnt, ready_fd, parts, token)
        clean = True
    finally:
        # A daemon that dies while serving leaves its mount answering ENOTCONN, so that a
        # training job cannot mistake it for an empty dataset (S3QL does the same). One
        # that fails before it was ever ready takes its mount down with it.
        pyfuse3.close(unmount=clean or not _READY)
        if ssd is not None:
            ssd.store.close()
        log.info("unmounted %s", mnt)
    return 0


async def _serve(
    opts: MountOptions,
    mnt: str,
    ready_fd: int | None,
    parts: dict[str, object],
    token: list[trio.lowlevel.TrioToken],
) -> None:
    token.append(trio.lowlevel.current_trio_token())
    ssd, prefetcher = parts["ssd"], parts["prefetcher"]
    async with trio.open_nursery() as nursery:
        if isinstance(prefetcher, Prefetcher):
            nursery.start_soon(prefetcher.run)
        nursery.start_soon(_signals)
        nursery.start_soon(_announce_ready, opts, mnt, ready_fd)
        if isinstance(ssd, SsdTier):
            nursery.start_soon(ssd.restore)
            nursery.start_soon(ssd.evictor)
            for _ in range(4):
                nursery.start_soon(ssd.writer)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


def _start_metrics(
    addr: str, stats: Callable[[], dict[str, object]], token: list[trio.lowlevel.TrioToken]
) -> None:
    """Prometheus over HTTP. Scrapes arrive on the server's thread; the stats are computed
    in the trio thread, where the state they read is consistent."""
    from shadefs.ops.prom import start_server

    def threadsafe() -> dict[str, object]:
        if not token:
            raise RuntimeError("the daemon is still starting")
        return trio.from_thread.run_sync(stats, trio_token=token[0])

    try:
        host, port = start_server(addr, threadsafe)
    except (OSError, ValueError) as exc:
        raise QuietError(f"--metrics {addr}: {exc}", EXIT_MOUNT_FAILED) from None
    log.info("serving Prometheus metrics on http://%s:%d/metrics", host, port)


async def _signals() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            if signum == signal.SIGHUP:
                log.info("SIGHUP: nothing to reload")
                continue
            log.info("got %s, unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()


async def _announce_ready(opts: MountOptions, mnt: str, ready_fd: int | None) -> None:
    # The stat goes through the kernel to our own request loop: when it returns, the
    # mount answers. It must run in a thread, or it would wait for the loop it blocks.
    await trio.to_thread.run_sync(os.stat, mnt)
    global _READY
    _READY = True
    log.info("mount %s is ready", mnt)
    if opts.systemd:
        from shadefs.ops import sdnotify

        sdnotify.ready(f"serving {opts.source} on {mnt}")
    _report(ready_fd, "ready")
