"""The daemon's own cost of a warm cache hit: open + release handlers called directly.

    python tools/bench/bench_handlers.py [--files 100] [--size 110000] [--calls 200000]

No FUSE and no kernel: the handlers of a built filesystem are awaited in a loop on files that
are resident in the RAM tier. Comparing the result with bench_hits.py's per-file time
through a real mount separates what shadefs's code costs from what the FUSE round trips and
pyfuse3's request machinery cost.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import trio

from shadefs.fs.namespace import ROOT_INODE
from shadefs.options import MountOptions
from shadefs.service import Service


class _Ctx:
    uid = os.getuid()
    gid = os.getgid()
    pid = os.getpid()
    umask = 0o022


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=100)
    ap.add_argument("--size", type=int, default=110_000)
    ap.add_argument("--calls", type=int, default=200_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "d"
        src.mkdir()
        for i in range(args.files):
            (src / f"f{i}").write_bytes(os.urandom(args.size))
        ops = Service(MountOptions(source=tmp, mountpoint="/unused", ram=1 << 30)).operations

        async def run() -> float:
            d = (await ops.lookup(ROOT_INODE, b"d", _Ctx)).st_ino
            inos = [(await ops.lookup(d, b"f%d" % i, _Ctx)).st_ino for i in range(args.files)]
            for ino in inos:  # make every file resident
                await ops.release((await ops.open(ino, os.O_RDONLY, _Ctx)).fh)
            t0 = time.perf_counter()
            for k in range(args.calls):
                fi = await ops.open(inos[k % args.files], os.O_RDONLY, _Ctx)
                await ops.release(fi.fh)
            return (time.perf_counter() - t0) / args.calls

        per_call = trio.run(run)
    print(
        f"open+release of a RAM hit, handlers only: {per_call * 1e6:.2f} us per file "
        f"({args.calls} calls over {args.files} resident files of {args.size} B)"
    )


if __name__ == "__main__":
    main()
