"""Randomised: rewrites, renames, deletes and creates race readers over a small tree.

A writer changes the source as people and rsync do (in place with the mtime put back,
replaced by rename, appended to, deleted, created, renamed over, whole directories renamed,
the RAM copy dropped) while reader threads read every path through the mount, some of them
holding a handle across the changes. Every read must give a version that path had, or an
error: never another path's bytes, a mix of two versions, or a cut file.

"That path" is a name in a directory, and both are inodes: the kernel keeps its names for
`--revalidate` seconds, so `c/f1` may give any version of a file that `f1` named in any
directory ever called `c` (an open follows the file its name leads to, also after the file
moved on), never a file it did not name: not what `f1` is in another directory (the
issue's renamed-directory case), nor a file that took over a reused inode number.

The source itself passes through a few states during one write() (a reader of SRC would see
them too): an in-place rewrite is new[:k] + old[k:] while it copies, an append is old plus
part of the tail. Those are versions the file had; old[:k] + new[k:] (what stale kernel pages
in front of new bytes give) is not.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.mount

DIRS = ["a", "b", "c"]
NAMES = ["f0", "f1", "f2", "f3"]
SIZES = [900, 4096, 20_000, 70_000, 300_000]
ALLOWED = {errno.ENOENT, errno.ESTALE, errno.EIO, errno.ENOTDIR}


class Model:
    """The source tree as the writer left it, and what each name may give through the mount.

    A file is an identity of the model (a new one for every create or replace, whatever
    inode number the filesystem hands out) with all its versions. A name is a (directory,
    name) pair, and a directory an identity too. A path may give any version of any file
    that any directory it named held under that name: the kernel keeps names (and so the
    file behind them) while the source moves on, and an open follows the file it names.
    """

    def __init__(self, root: Path, seed: int) -> None:
        self.root = root
        self.rng = random.Random(seed)
        self.serial = 0
        self.tree: dict[str, bytes] = {}  # path -> current bytes
        self.file_of: dict[str, int] = {}  # path -> file
        self.dirs = {d: k for k, d in enumerate(DIRS)}  # directory name -> directory
        self.named: dict[str, set[int]] = {d: {k} for d, k in self.dirs.items()}
        self.held: dict[tuple[int, str], set[int]] = {}  # (directory, name) -> files
        # Per file: every version, the (old, new) of in-place rewrites and the (old,
        # longer) of appends.
        self.versions: dict[int, set[bytes]] = {}
        self.rewrites: dict[int, list[tuple[bytes, bytes]]] = {}
        self.appends: dict[int, list[tuple[bytes, bytes]]] = {}
        self.lock = threading.Lock()
        self.log: list[str] = []  # what the writer did, for a failure's message
        for d in DIRS:
            (root / d).mkdir(parents=True)
            for n in NAMES:
                self._write_new(f"{d}/{n}")

    def content(self, rel: str, size: int | None = None) -> bytes:
        self.serial += 1
        unit = f"<{rel}#{self.serial}>".encode()
        size = size or self.rng.choice(SIZES)
        return (unit * (size // len(unit) + 1))[:size]

    def _name(self, rel: str, file: int) -> None:
        """`rel` names `file` from now on."""
        d, _, name = rel.partition("/")
        with self.lock:
            self.held.setdefault((self.dirs[d], name), set()).add(file)
        self.file_of[rel] = file

    def _version(self, rel: str, data: bytes) -> None:
        with self.lock:
            self.versions.setdefault(self.file_of[rel], set()).add(data)
        self.tree[rel] = data

    def _write_new(self, rel: str) -> None:
        """Create or replace `rel` atomically (a new inode), as rsync does by default."""
        data = self.content(rel)
        self._name(rel, self.serial)
        self._version(rel, data)
        tmp = self.root / f".tmp{self.serial}"
        tmp.write_bytes(data)
        os.replace(tmp, self.root / rel)

    def _forget(self, rel: str) -> None:
        del self.tree[rel]
        del self.file_of[rel]

    def step(self) -> None:
        before = dict(self.tree)
        self._step()
        moved = [
            f"{r}#{d[1:].split(b'#')[1].split(b'>')[0].decode()}"
            for r, d in self.tree.items()
            if before.get(r) is not d
        ]
        gone = [r for r in before if r not in self.tree]
        self.log.append(f"{self.op}: now {moved} gone {gone}")

    def _step(self) -> None:
        rng = self.rng
        files = sorted(self.tree)
        op = self.op = rng.choice(
            ["inplace", "replace", "append", "delete", "create", "rename", "dir"]
        )
        if op == "inplace" and files:
            rel = rng.choice(files)
            old = self.tree[rel]
            new = self.content(rel, len(old))
            with self.lock:
                self.rewrites.setdefault(self.file_of[rel], []).append((old, new))
            self._version(rel, new)
            path = self.root / rel
            before = path.stat()
            fd = os.open(path, os.O_WRONLY)
            try:
                os.pwrite(fd, new, 0)
            finally:
                os.close(fd)
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        elif op == "append" and files:
            rel = rng.choice(files)
            old = self.tree[rel]
            new = old + self.content(rel, rng.choice([100, 5000, 40_000]))
            with self.lock:
                self.appends.setdefault(self.file_of[rel], []).append((old, new))
            self._version(rel, new)
            with open(self.root / rel, "ab") as f:
                f.write(new[len(old) :])
        elif op == "replace" and files:
            self._write_new(rng.choice(files))
        elif op == "delete" and files:
            rel = rng.choice(files)
            os.unlink(self.root / rel)
            self._forget(rel)
        elif op == "create":
            d = rng.choice([d for d in DIRS if (self.root / d).is_dir()] or [None])
            if d is not None:
                self._write_new(f"{d}/{rng.choice(NAMES)}")
        elif op == "rename" and files:
            src = rng.choice(files)
            d = rng.choice([d for d in DIRS if (self.root / d).is_dir()])
            dst = f"{d}/{rng.choice(NAMES)}"
            if dst != src:
                data, file = self.tree[src], self.file_of[src]
                self._name(dst, file)
                self.tree[dst] = data
                os.replace(self.root / src, self.root / dst)
                self._forget(src)
        elif op == "dir":
            present = [d for d in DIRS if (self.root / d).is_dir()]
            absent = [d for d in DIRS if d not in present]
            if not absent:  # every name is taken: make room by removing one
                src = rng.choice(present)
                for n in NAMES:
                    if f"{src}/{n}" in self.tree:
                        os.unlink(self.root / src / n)
                        self._forget(f"{src}/{n}")
                os.rmdir(self.root / src)
                with self.lock:
                    del self.dirs[src]
                return
            src, dst = rng.choice(present), rng.choice(absent)
            with self.lock:  # the names go with their directory
                self.dirs[dst] = self.dirs.pop(src)
                self.named.setdefault(dst, set()).add(self.dirs[dst])
            os.rename(self.root / src, self.root / dst)
            for rel in [r for r in self.tree if r.startswith(src + "/")]:
                moved = dst + rel[len(src) :]
                self.tree[moved], self.file_of[moved] = self.tree[rel], self.file_of[rel]
                self._forget(rel)

    def check(self, rel: str, data: bytes) -> str | None:
        """None when `data` is a version of a file `rel` named, else what is wrong."""
        d, _, name = rel.partition("/")
        with self.lock:
            files = set().union(*(self.held.get((k, name), set()) for k in self.named[d]))
            versions = set().union(*(self.versions.get(f, set()) for f in files))
            rewrites = [r for f in files for r in self.rewrites.get(f, ())]
            appends = [a for f in files for a in self.appends.get(f, ())]
        if data in versions:
            return None
        for old, new in rewrites:
            k = len(os.path.commonprefix([data, new]))
            if len(data) == len(new) and data[k:] == old[k:]:
                return None  # caught while the source copied the new bytes in
        for old, longer in appends:
            if len(old) <= len(data) <= len(longer) and longer.startswith(data):
                return None  # caught while the source appended
        known = sorted((len(v), v[:24]) for v in versions)
        k = max(len(os.path.commonprefix([data, v])) for v in versions) if versions else 0
        return (
            f"{rel}: {len(data)} bytes starting {data[:24]!r}, from byte {k} "
            f"{data[k : k + 24]!r}, not one of {known}"
        )


def reader(mnt: Path, model: Model, stop: threading.Event, seed: int, out: list[str]) -> None:
    rng = random.Random(seed)
    paths = [f"{d}/{n}" for d in DIRS for n in NAMES]
    while not stop.is_set():
        rel = rng.choice(paths)
        try:
            with open(mnt / rel, "rb") as f:
                head = f.read(rng.choice([4096, 65536, 1 << 20]))
                if rng.random() < 0.3:
                    time.sleep(0.002)  # hold the handle while the writer goes on
                data = head + f.read()
        except OSError as exc:
            if exc.errno not in ALLOWED:
                out.append(f"{rel}: {exc!r}")
            continue
        problem = model.check(rel, data)
        if problem is not None:
            out.append(problem)
        if rng.random() < 0.05:
            try:
                os.listdir(mnt / rel.partition("/")[0])
            except OSError:
                pass


@pytest.mark.parametrize(
    "seed,reval",
    [(1, ()), (2, ("--revalidate", "0.2")), (3, ("--revalidate", "0.2"))],
    ids=["default", "revalidate-a", "revalidate-b"],
)
def test_readers_racing_changes_get_a_version_or_an_error(
    tmp_path: Path, mounter, seed: int, reval: tuple[str, ...]
) -> None:
    model = Model(tmp_path / "src", seed)
    m = mounter(model.root, "--ram", "8M", *reval)
    stop = threading.Event()
    problems: list[str] = []
    threads = [
        threading.Thread(target=reader, args=(m.mnt, model, stop, seed * 10 + k, problems))
        for k in range(3)
    ]
    for t in threads:
        t.start()
    try:
        for i in range(300):
            model.step()
            if i % 40 == 39:
                m.ctl("drop")
            time.sleep(model.rng.choice([0, 0.001, 0.01]))
    finally:
        stop.set()
        for t in threads:
            t.join()
    if problems and os.environ.get("IDENTITY_RACE_LOG"):
        Path(os.environ["IDENTITY_RACE_LOG"]).write_text("\n".join(problems + model.log))
    assert not problems, "\n".join(problems[:5] + model.log)
    # Once the changes stop and the snapshots age, every path reads as the source has it.
    time.sleep(0.5 if reval else 0)
    if reval:
        for rel in [f"{d}/{n}" for d in DIRS for n in NAMES]:
            want = model.tree.get(rel)
            got: bytes | None
            try:
                got = (m.mnt / rel).read_bytes()
            except FileNotFoundError:
                got = None
            assert got == want, rel
    assert "Traceback" not in m.log.read_text()
