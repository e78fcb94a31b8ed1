"""The tools against a stopped daemon, and bad `--ssd` sizes: issue 36's must-show.

    python tools/bench/bench_stopped_daemon.py

Mounts a small tree, stops the daemon with SIGSTOP, and times `shadefs stat --timeout 1`,
`shadefs stat --watch --timeout 1` and `shadefs umount -z` (which must not ask the daemon),
then checks that the mount point is gone from /proc/self/mountinfo. Then runs
`shadefs mount` with `--ssd DIR:-1`, `--ssd DIR:10Q` and `-o ssd=DIR:abc`: the exit code,
the lines on stderr, and whether anything was created. Prints the figures; asserts nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from benchlib import SHADEFS, is_mounted, lazy_unmount, mount, stats


def _timed(*args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.monotonic()
    res = subprocess.run([*SHADEFS, *args], capture_output=True, text=True, timeout=120)
    return time.monotonic() - t0, res


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, mnt = Path(tmp) / "src", Path(tmp) / "mnt"
        src.mkdir()
        (src / "f").write_bytes(b"x" * 1000)
        mount(src, mnt)
        pid = int(stats(mnt)["pid"])
        os.kill(pid, signal.SIGSTOP)
        try:
            for args in (["stat", str(mnt), "--timeout", "1"],
                         ["stat", str(mnt), "--watch", "--timeout", "1"],
                         ["umount", "-z", str(mnt)]):  # fmt: skip
                took, res = _timed(*args)
                print(
                    f"shadefs {' '.join(args).replace(str(mnt), 'MNT')} on a stopped daemon: exit "
                    f"{res.returncode} in {took:.2f} s: {res.stderr.strip()}"
                )
            print(f"mount point still in mountinfo: {is_mounted(mnt)}")
        finally:
            os.kill(pid, signal.SIGCONT)
            lazy_unmount(mnt)
        for args in (["--ssd", "{c}:-1"], ["--ssd", "{c}:10Q"], ["-o", "ssd={c}:abc"]):
            cache = Path(tmp) / "cache"
            given = [args[0], args[1].format(c=cache)]
            mnt.mkdir(exist_ok=True)
            took, res = _timed("mount", str(src), str(mnt), *given)
            created = sorted(p.name for p in Path(tmp).iterdir() if p.name.startswith("cache"))
            print(
                f"mount {' '.join(given).replace(str(cache), 'DIR')}: exit {res.returncode}, "
                f"{len(res.stderr.splitlines())} line(s), created {created or 'nothing'}: "
                f"{res.stderr.strip()}"
            )
            if is_mounted(mnt):
                lazy_unmount(mnt)


if __name__ == "__main__":
    main()
