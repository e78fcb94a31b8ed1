"""The daemon's own cost of a burst of misses against a hung source: handlers only.

    python tools/bench/bench_burst.py [--misses 200] [--threads 32] [--rounds 3]
                                      [--same-reader] [--warm-threads] [--profile first|next]

No FUSE and no kernel: the filesystem's `open` handler is awaited by `--misses` concurrent
tasks, each for a file not read before and as a reader thread of its own (a real thread of
this process, parked, whose id is the request's pid: FUSE gives the caller's thread id, and
a burst of readers is a burst of new ids), while every source call blocks until released:
a source that stopped answering, with `--source-timeout 2` and `--source-threads THREADS`.
Under trio's MockClock the deadline is a jump, not a wait.

Two waves, as `bench_hang.py`'s: in the first, THREADS calls get a thread and the rest wait
for one, and all fail at the deadline; in the next every thread is stuck, so each call fails
at once. Per wave it prints the process CPU per miss (all threads, `time.process_time`) to
take the misses in (until every task waits) and to fail them at the deadline. What the
kernel, /dev/fuse and pyfuse3's request loop add per request is not here:
`bench_hang.py` measures the whole through a mount. `--same-reader`: every request from
this process's main thread (the job resolution's cache then answers); `--warm-threads`:
trio's thread cache holds THREADS idle threads before the first wave; `--profile`: cProfile
of one wave's intake (first) or of the whole next wave, the top functions printed.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyfuse3
import trio
import trio.testing

from shadefs.fs.namespace import ROOT_INODE
from shadefs.options import MountOptions
from shadefs.service import Service

_TIMEOUT = 2.0


class _Ctx:
    uid = os.getuid()
    gid = os.getgid()
    umask = 0o022

    def __init__(self, pid: int) -> None:
        self.pid = pid


def _readers(count: int) -> tuple[list[int], threading.Event]:
    """`count` parked threads of this process (their ids), and what lets them end."""
    ids: list[int] = []
    release = threading.Event()

    def park() -> None:
        ids.append(threading.get_native_id())
        release.wait()

    for _ in range(count):
        threading.Thread(target=park, daemon=True).start()
    while len(ids) < count:
        time.sleep(0.01)
    return ids, release


def one_round(args: argparse.Namespace, prof: cProfile.Profile | None) -> list[tuple[float, float]]:
    """[(intake, deadline) process CPU seconds per miss] for each of the two waves."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp)
        for w in range(2):
            (src / f"w{w}").mkdir()
            for i in range(args.misses):
                (src / f"w{w}" / f"f{i}").write_bytes(b"x" * (10_000 + i))
        opts = MountOptions(
            source=str(src),
            mountpoint="/unused",
            ram=256 << 20,
            source_timeout=_TIMEOUT,
            source_threads=args.threads,
            inline_reads=False,  # every fetch goes to a thread, as from NFS
            speculate=False,
            prefetch=False,
        )
        service = Service(opts)
        ops, source = service.operations, service.source
        gate = threading.Event()  # set: the source answers
        gate.set()
        answer = source._call

        def hang(fn: Callable[..., Any], fn_args: tuple[object, ...]) -> Any:
            gate.wait()
            return answer(fn, fn_args)

        source._call = hang  # type: ignore[method-assign]
        readers, release = _readers(2 * args.misses)
        if args.same_reader:
            readers = [os.getpid()] * len(readers)

        async def miss(inode: int, pid: int) -> None:
            try:
                await ops.open(inode, os.O_RDONLY, _Ctx(pid))  # type: ignore[arg-type]
            except pyfuse3.FUSEError:
                pass

        async def run() -> list[tuple[float, float]]:
            clock = trio.lowlevel.current_clock()
            assert isinstance(clock, trio.testing.MockClock)
            inodes = []
            for w in range(2):  # looked up while the source answers
                d = (await ops.lookup(ROOT_INODE, b"w%d" % w, _Ctx(0))).st_ino  # type: ignore[arg-type]
                names = [b"f%d" % i for i in range(args.misses)]
                inodes.append([(await ops.lookup(d, n, _Ctx(0))).st_ino for n in names])  # type: ignore[arg-type]
            if args.warm_threads:
                async with trio.open_nursery() as nursery:
                    for _ in range(args.threads):
                        nursery.start_soon(source.run, time.sleep, 0.05)
            gate.clear()  # the source stops answering
            got = []
            for w in range(2):
                profiled = prof is not None and args.profile == ("first", "next")[w]
                c0 = time.process_time()
                if profiled:
                    prof.enable()
                async with trio.open_nursery() as nursery:
                    for i, inode in enumerate(inodes[w]):
                        nursery.start_soon(miss, inode, readers[w * args.misses + i])
                    await trio.testing.wait_all_tasks_blocked(0.05)
                    c1 = time.process_time()
                    if profiled and w == 0:
                        prof.disable()
                    clock.jump(_TIMEOUT)
                c2 = time.process_time()
                if profiled:
                    prof.disable()
                got.append(((c1 - c0) / args.misses, (c2 - c1) / args.misses))
            return got

        try:
            return trio.run(run, clock=trio.testing.MockClock())
        finally:
            gate.set()
            release.set()
            service.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--misses", type=int, default=200)
    ap.add_argument("--threads", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--same-reader", action="store_true")
    ap.add_argument("--warm-threads", action="store_true")
    ap.add_argument("--profile", choices=["first", "next"])
    args = ap.parse_args()
    prof = cProfile.Profile() if args.profile else None
    for r in range(args.rounds):
        waves = one_round(args, prof)
        print(
            f"round {r + 1}: "
            + "; ".join(
                f"wave {w + 1}: {(a + d) * 1e6:.0f} us of CPU per miss "
                f"(intake {a * 1e6:.0f}, at the deadline {d * 1e6:.0f})"
                for w, (a, d) in enumerate(waves)
            )
        )
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
