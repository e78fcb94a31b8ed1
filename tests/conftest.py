"""Shared fixtures: source trees, real mounts, and a fake request context.

Mount tests start the real daemon through the real CLI (`shadefs mount`, which returns once
the mount answers) and unmount with `shadefs umount`. Where FUSE is missing they skip on a
developer machine but FAIL when the environment variable CI is set: a CI run that skipped
them would prove nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest


def fuse_problem() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed"
    return None


def require_fuse() -> None:
    problem = fuse_problem()
    if problem is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"FUSE mount tests cannot run in CI: {problem}")
    pytest.skip(problem)


def shadefs_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "shadefs", *args]


@dataclass
class Mount:
    source: Path
    mnt: Path
    log: Path

    def stats(self) -> dict:
        return json.loads((self.mnt / ".shadefs" / "stats.json").read_bytes())

    @property
    def no_open(self) -> bool:
        """Whether the mount serves with kernel hits: the kernel then serves every read of
        the pages it holds, and the daemon sees and counts only the reads it lacks."""
        return bool(self.stats()["no_open"])

    def ctl(self, line: str) -> None:
        fd = os.open(self.mnt / ".shadefs" / "ctl", os.O_WRONLY)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def unmount(self) -> None:
        if os.path.ismount(self.mnt) or _dead_mount(self.mnt):
            res = subprocess.run(
                shadefs_cmd("umount", str(self.mnt)), capture_output=True, text=True, timeout=60
            )
            if res.returncode != 0:
                subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
                raise AssertionError(f"shadefs umount failed: {res.stderr}")


T = TypeVar("T")


def poll(
    check: Callable[[], T],
    what: str | Callable[[], str],
    timeout: float = 30.0,
    *,
    interval: float = 0.05,
    alive: subprocess.Popen[Any] | None = None,
) -> T:
    """`check()` once it is true (or what it returned, when truthy), asked every `interval`
    seconds: the one wait of the mount tests, whose daemon is another process. Fails with
    `what` (a text, or a function that says what was seen) after `timeout` seconds, or as
    soon as process `alive` has exited."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if alive is not None and alive.poll() is not None:
            pytest.fail(f"the process exited with {alive.returncode} while waiting: "
                        f"{what if isinstance(what, str) else what()}")  # fmt: skip
        if time.monotonic() > deadline:
            pytest.fail(f"timed out: {what if isinstance(what, str) else what()}")
        time.sleep(interval)


class FakeClock:
    """A clock for the parts' `clock` argument that moves only when the test moves it
    (`advance`), so that ages past `--revalidate` need no real sleep."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def drop_kernel_pages() -> None:
    """Drop the kernel's page cache, as memory pressure does for a dataset larger than
    memory: the next read of every file reaches the daemon, with or without kernel hits
    (with them, a file whose pages the kernel kept is read without asking the daemon)."""
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1")


def _dead_mount(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == 107  # ENOTCONN
    return False


# `make test` runs the mount tests a second time with kernel hits on (FUSE no-open mode):
# every mount then takes `--kernel-hits on` unless the test chose a mode itself.
KERNEL_HITS = os.environ.get("SHADEFS_TEST_KERNEL_HITS", "")


def start_mount(source: Path, mnt: Path, *args: str, log: Path | None = None) -> Mount:
    require_fuse()
    if KERNEL_HITS and not any(a.startswith("--kernel-hits") for a in args):
        args = (*args, "--kernel-hits", KERNEL_HITS)
    mnt.mkdir(parents=True, exist_ok=True)
    log = log or mnt.parent / f"{mnt.name}.log"
    res = subprocess.run(
        shadefs_cmd("mount", str(source), str(mnt), "--log", str(log), *args),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if res.returncode != 0:
        daemon_log = log.read_text() if log.exists() else ""
        raise AssertionError(f"mount failed ({res.returncode}): {res.stderr}\n{daemon_log}")
    assert os.path.ismount(mnt)
    return Mount(source, mnt, log)


@pytest.fixture
def mounter(tmp_path: Path) -> Iterator:
    """Call mounter(source, *args) to get a Mount; everything is unmounted at teardown."""
    mounts: list[Mount] = []

    def make(source: Path, *args: str, name: str = "mnt") -> Mount:
        m = start_mount(source, tmp_path / name, *args)
        mounts.append(m)
        return m

    yield make
    errors = []
    for m in mounts:
        try:
            m.unmount()
        except Exception as exc:  # keep unmounting the others
            errors.append(exc)
        # No test may leave warnings or errors in the daemon's log that it did not expect.
    if errors:
        raise errors[0]


class FakeCtx:
    """Stands in for pyfuse3.RequestContext in handler-level tests."""

    def __init__(self, uid: int | None = None, gid: int | None = None, pid: int = 1) -> None:
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self.pid = pid
        self.umask = 0o022


def make_tree(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root
