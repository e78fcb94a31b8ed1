"""The daemon never reads anything outside SRC, and a growing file costs a bounded fetch.

Whoever can write into SRC can swap a file or a directory for a symlink after the mount has
looked it up. The secret here is a file in a directory beside SRC; every test asserts that
none of its bytes is ever served, whatever path the read takes (fetch, pass-through, SSD
revalidation, prefetch, control paths), and that the daemon stays up.

Reads through the mount go through `Resolver` on the mount root, so the test itself never
follows a symlink on the client side: a symlink that the kernel sees as a symlink (after it
revalidated the entry) cannot lead the test to the secret. Any secret byte the test gets
came from the daemon.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyfuse3
import pytest

from shadefs.fs.namespace import ROOT_INODE
from shadefs.source import paths as source_paths
from shadefs.source.part import Source
from shadefs.source.paths import Resolver
from tests.conftest import KERNEL_HITS, FakeCtx, Mount, poll

CTX = FakeCtx()
Mounter = Callable[..., Mount]
SECRET = b"SECRET-0123456789-" * 600  # 10800 bytes: above --max-entry 1K, like the legit files
MARKER = b"SECRET-0123456789"
LEGIT = b"legit" * 2000  # 10000 bytes


def _has_openat2() -> bool:
    return Resolver(b"/").kind == "openat2"


RESOLVERS = [
    pytest.param(
        True,
        id="openat2",
        marks=pytest.mark.skipif(not _has_openat2(), reason="kernel without openat2"),
    ),
    pytest.param(False, id="walk"),
]


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """(src, secret_dir): src/c2/a.txt, src/dir/f.txt, src/big.bin; the secret outside."""
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "f.txt").write_bytes(SECRET)
    (secret / "a.txt").write_bytes(SECRET)
    src = tmp_path / "src"
    (src / "c2").mkdir(parents=True)
    (src / "dir").mkdir()
    (src / "c2" / "a.txt").write_bytes(LEGIT)
    (src / "dir" / "f.txt").write_bytes(LEGIT)
    (src / "big.bin").write_bytes(LEGIT)
    return src, secret


def swap_file(path: Path, target: Path) -> None:
    path.unlink()
    path.symlink_to(target)


def swap_dir(path: Path, target: Path) -> None:
    for child in path.iterdir():
        child.unlink()
    path.rmdir()
    path.symlink_to(target)


def errno_of(exc: pytest.ExceptionInfo[pyfuse3.FUSEError]) -> int:
    return exc.value.errno


# --- the resolver and Source, for both resolvers ----------------------------------------


@pytest.mark.parametrize("use_openat2", RESOLVERS)
async def test_source_never_follows_a_symlink(tree: tuple[Path, Path], use_openat2: bool) -> None:
    src, secret = tree
    (src / "flink").symlink_to(secret / "f.txt")
    (src / "dlink").symlink_to(secret)
    (src / "dir" / "rel").symlink_to("../../secret/f.txt")
    s = Source(os.fsencode(src), use_openat2=use_openat2)
    assert s.paths.kind == ("openat2" if use_openat2 else "walk")
    for rel in (b"flink", b"dlink/f.txt", b"dir/rel", b"dlink/../c2/a.txt"):
        for call in (s.read_file, s.open_fd):
            with pytest.raises(pyfuse3.FUSEError) as e:
                await call(rel)
            assert errno_of(e) == errno.ELOOP, (rel, call)
    # Metadata: the last component is looked at, never followed; a symlinked directory on
    # the way is refused.
    assert stat.S_ISLNK((await s.lstat(b"flink")).st_mode)
    assert stat.S_ISLNK((await s.lstat(b"dlink")).st_mode)
    assert await s.readlink(b"flink") == os.fsencode(secret / "f.txt")
    meta: list[tuple[Callable[[bytes], Awaitable[object]], bytes]] = [
        (s.lstat, b"dlink/f.txt"),
        (s.readlink, b"dlink/x"),
        (s.listdir, b"dlink"),
    ]
    for meta_call, rel in meta:
        with pytest.raises(pyfuse3.FUSEError) as e:
            await meta_call(rel)
        assert errno_of(e) == errno.ELOOP, (meta_call, rel)
    # A listing shows symlinks as symlinks.
    names = dict(await s.listdir(b""))
    assert stat.S_ISLNK(names[b"flink"].st_mode) and stat.S_ISLNK(names[b"dlink"].st_mode)
    assert stat.S_ISDIR(names[b"dir"].st_mode)
    # Refused symlinks are answers, not source failures.
    assert s.healthy and s.errors == 0
    # Nothing above the root, and no absolute path.
    for rel in (b"../secret/f.txt", b"/" + os.fsencode(secret / "f.txt")):
        with pytest.raises(pyfuse3.FUSEError):
            await s.read_file(rel)
    with pytest.raises(pyfuse3.FUSEError):
        await s.lstat(b"..")
    assert s.bytes_read == 0


@pytest.mark.parametrize("use_openat2", RESOLVERS)
async def test_source_reads_the_tree(tree: tuple[Path, Path], use_openat2: bool) -> None:
    src, _ = tree
    odd = b"\xff\xfeodd.bin"  # not UTF-8: must survive as bytes
    with open(os.path.join(os.fsencode(src), b"dir", odd), "wb") as f:
        f.write(b"odd")
    s = Source(os.fsencode(src), use_openat2=use_openat2)
    assert stat.S_ISDIR(s.root_stat().st_mode)
    assert s.root_stat().st_ino == src.stat().st_ino
    data, st = await s.read_file(b"c2/a.txt", len(LEGIT))
    assert data == LEGIT and st.st_size == len(LEGIT)
    assert (await s.read_file(b"dir/" + odd))[0] == b"odd"
    assert [n for n, _ in await s.listdir(b"dir")] == sorted([b"f.txt", odd])
    assert (await s.lstat(b"dir/f.txt")).st_ino == (src / "dir" / "f.txt").stat().st_ino
    assert (await s.lstat(b"")).st_ino == src.stat().st_ino
    fd = await s.open_fd(b"big.bin")
    try:
        assert await s.pread(fd, 5, 0) == b"legit"
        assert os.get_blocking(fd)  # O_NONBLOCK was for the open only
    finally:
        await s.close_fd(fd)
    assert (await s.statvfs()).f_bsize > 0
    with pytest.raises(pyfuse3.FUSEError) as e:
        await s.read_file(b"dir")
    assert errno_of(e) == errno.EISDIR


@pytest.mark.parametrize("use_openat2", RESOLVERS)
async def test_a_fifo_swapped_in_does_not_hang_the_source(
    tree: tuple[Path, Path], use_openat2: bool
) -> None:
    src, _ = tree
    os.mkfifo(src / "fifo")
    s = Source(os.fsencode(src), use_openat2=use_openat2, timeout=5)
    for call in (s.read_file, s.open_fd):
        with pytest.raises(pyfuse3.FUSEError) as e:
            await call(b"fifo")
        assert errno_of(e) == errno.EISDIR
    assert s.timeouts == 0


@pytest.mark.parametrize("use_openat2", RESOLVERS)
async def test_xattrs_are_the_files_own(tree: tuple[Path, Path], use_openat2: bool) -> None:
    src, secret = tree
    try:
        os.setxattr(src / "c2" / "a.txt", "user.shade", b"inside")
        os.setxattr(secret / "f.txt", "user.shade", b"outside")
    except OSError as exc:
        pytest.skip(f"no user xattrs on {src}: {exc.strerror}")
    (src / "flink").symlink_to(secret / "f.txt")
    (src / "dlink").symlink_to(secret)
    s = Source(os.fsencode(src), use_openat2=use_openat2)
    assert await s.getxattr(b"c2/a.txt", b"user.shade") == b"inside"
    assert b"user.shade" in await s.listxattr(b"c2/a.txt")
    # A symlink reports no attributes of its own, and never its target's.
    with pytest.raises(pyfuse3.FUSEError) as e:
        await s.getxattr(b"flink", b"user.shade")
    assert errno_of(e) == errno.ENODATA
    assert await s.listxattr(b"flink") == []
    with pytest.raises(pyfuse3.FUSEError) as e:
        await s.getxattr(b"dlink/f.txt", b"user.shade")
    assert errno_of(e) == errno.ELOOP
    # The per-directory presence scan (ls -l's shortcut) names entries without following.
    assert s.paths.xattr_presence(b"c2", [b"a.txt"]) == [1]
    assert s.paths.xattr_presence(b"", [b"flink", b"dlink", b"..", b"c2/a.txt"]) == [0, 0, -1, -1]
    with pytest.raises(OSError):
        s.paths.xattr_presence(b"dlink", [b"f.txt"])


def test_openat2_missing_falls_back_to_the_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_openat2(*args: object) -> int:
        ctypes.set_errno(errno.ENOSYS)
        return -1

    monkeypatch.setattr(source_paths, "_syscall", no_openat2)
    assert Resolver(os.fsencode(tmp_path)).kind == "walk"
    monkeypatch.setattr(source_paths, "_syscall", None)
    assert Resolver(os.fsencode(tmp_path)).kind == "walk"


@pytest.mark.parametrize("use_openat2", RESOLVERS)
async def test_a_fetch_is_bounded_by_the_size_looked_up(tmp_path: Path, use_openat2: bool) -> None:
    src = tmp_path / "src"
    src.mkdir()
    head = os.urandom(4096)
    (src / "grow.bin").write_bytes(head + os.urandom(4 << 20))  # grew since it was looked up
    s = Source(os.fsencode(src), use_openat2=use_openat2)
    data, st = await s.read_file(b"grow.bin", 4096)
    assert data.startswith(head)
    assert 4096 < len(data) <= 4096 + (64 << 10)
    assert len(data) != st.st_size  # not a clean copy: the caller must not cache it
    assert s.bytes_read == len(data)
    # A file that grows while it is read: each fetch is bounded by the size looked up.
    path = src / "live.bin"
    path.write_bytes(head)
    stop = threading.Event()

    def append() -> None:
        with open(path, "ab") as f:
            while not stop.is_set() and f.tell() < 64 << 20:
                f.write(b"x" * 65536)

    t = threading.Thread(target=append)
    t.start()
    try:
        for _ in range(20):
            try:
                data, st = await s.read_file(b"live.bin", 4096)
            except pyfuse3.FUSEError as exc:  # it changed during both tries
                assert exc.errno == errno.EIO
                continue
            assert data.startswith(head)
            assert len(data) <= 4096 + (64 << 10)
    finally:
        stop.set()
        t.join()
    assert s.timeouts == 0


# --- the handlers, with the walk forced (a kernel without openat2) ------------------------


async def test_handlers_refuse_swapped_symlinks_with_the_walk(
    tree: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_fs_api import lookup_path, make_fs, read_all

    src, secret = tree
    monkeypatch.setattr(source_paths, "_syscall", None)
    ops, svc = make_fs(src, ram=1 << 20, max_entry=1024)
    assert svc.source.paths.kind == "walk"
    a = await lookup_path(ops, "c2/a.txt")
    d = await lookup_path(ops, "dir")
    f = await lookup_path(ops, "dir/f.txt")
    big = await lookup_path(ops, "big.bin")
    swap_file(src / "c2" / "a.txt", secret / "a.txt")
    swap_dir(src / "dir", secret)
    swap_file(src / "big.bin", secret / "f.txt")
    for ino in (a, f, big):  # fetch, fetch through a swapped directory, pass-through
        with pytest.raises(pyfuse3.FUSEError) as e:
            await read_all(ops, ino)
        assert errno_of(e) == errno.ELOOP
    # A name looked up afresh in the swapped directory: refused, not resolved in secret/.
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.lookup(d, b"a.txt", CTX)
    assert errno_of(e) == errno.ELOOP
    # The root, listed again, shows the directory as the symlink it now is.
    assert stat.S_ISLNK((await ops.lookup(ROOT_INODE, b"dir", CTX)).st_mode)
    assert svc.source.bytes_read == 0


async def test_the_operators_own_source_path_may_be_a_symlink(tree: tuple[Path, Path]) -> None:
    from tests.test_fs_api import lookup_path, make_fs, read_all

    src, _ = tree
    alias = src.parent / "alias"
    alias.symlink_to(src)  # SRC given as a symlink: followed once, when the mount starts
    ops, svc = make_fs(alias)
    assert svc.namespace.numbers.root_ino == src.stat().st_ino
    assert await read_all(ops, await lookup_path(ops, "c2/a.txt")) == LEGIT


async def test_a_reused_inode_number_of_another_type_replaces_the_node(tmp_path: Path) -> None:
    from shadefs.fs.namespace import ROOT_INODE, Namespace

    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "f").write_bytes(b"x")
    ns = Namespace(Source(os.fsencode(tmp_path)), revalidate=0.0)
    st_dir = os.lstat(tmp_path / "dir")
    ino, _ = await ns.lookup(ROOT_INODE, b"dir")
    await ns.listing(ino)
    assert ino in ns.listings
    # The directory was removed and its inode number reused by a symlink of the same name.
    (tmp_path / "dir" / "f").unlink()
    (tmp_path / "dir").rmdir()
    (tmp_path / "dir").symlink_to("/")
    scan = ns._scan_dir

    def reused(path: bytes, st_ino: int) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        names, rows, devs = scan(path, st_ino)
        rows["st_ino"][names.index(b"dir")] = st_dir.st_ino
        return names, rows, devs

    ns._scan_dir = reused  # type: ignore[method-assign]
    await ns.listing(ROOT_INODE)  # refreshed (revalidate 0): "dir" is now the symlink
    assert await ns.lookup(ROOT_INODE, b"dir") == (ino, ns.stat(ino))
    assert stat.S_ISLNK(ns.node(ino).st.st_mode)  # readlink answers; nothing lists "dir"
    assert ns.node(ino).lookups == 2
    assert ino not in ns.listings


# --- through a real mount -----------------------------------------------------------------


def read_nofollow(mnt: Path, rel: str) -> bytes:
    """The file's bytes through the mount, refusing symlinks on the client side too."""
    resolver = Resolver(os.fsencode(mnt))
    try:
        fd = resolver.open(os.fsencode(rel), os.O_RDONLY | os.O_CLOEXEC)
    finally:
        resolver.close()  # the mount root's descriptor would keep the mount busy
    try:
        return _read_fd(fd)
    finally:
        os.close(fd)


def _read_fd(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def assert_refused(mnt: Path, rel: str) -> None:
    """Reading `rel` fails with ELOOP: from the daemon, or from the client's own no-follow
    walk once the kernel has learnt that the path now holds a symlink."""
    with pytest.raises(OSError) as e:
        data = read_nofollow(mnt, rel)
        assert MARKER not in data, f"{rel}: the daemon served a file outside SRC"
    assert e.value.errno == errno.ELOOP, e.value


def assert_alive(m: Mount) -> dict[str, Any]:
    assert read_nofollow(m.mnt, "c2/b.txt") == LEGIT
    stats: dict[str, Any] = m.stats()
    return stats


@pytest.fixture
def mtree(tree: tuple[Path, Path]) -> tuple[Path, Path]:
    src, secret = tree
    (src / "c2" / "b.txt").write_bytes(LEGIT)
    return src, secret


REVALIDATE = [pytest.param((), id="default"), pytest.param(("--revalidate", "1"), id="revalidate1")]


@pytest.mark.mount
@pytest.mark.parametrize("reval", REVALIDATE)
def test_mount_fetch_never_follows_a_swap(
    mtree: tuple[Path, Path], mounter: Mounter, reval: tuple[str, ...]
) -> None:
    src, secret = mtree
    m = mounter(src, *reval)
    os.stat(m.mnt / "c2" / "a.txt")  # looked up as a regular file
    os.stat(m.mnt / "dir" / "f.txt")
    swap_file(src / "c2" / "a.txt", secret / "a.txt")
    swap_dir(src / "dir", secret)
    assert_refused(m.mnt, "c2/a.txt")  # the file itself
    assert_refused(m.mnt, "dir/f.txt")  # through the directory, looked up before
    assert_refused(m.mnt, "dir/a.txt")  # through the directory, a name never looked up
    s = assert_alive(m)
    assert s["bytes_from_source"] == len(LEGIT)  # c2/b.txt, and nothing else
    if reval:
        # Once revalidated, the kernel sees the symlinks as symlinks, pointing where they
        # point: it is the reader's own kernel that would follow them, with its rights.
        time.sleep(1.2)
        assert stat.S_ISLNK(os.lstat(m.mnt / "dir").st_mode)
        assert os.readlink(m.mnt / "dir") == str(secret)
        assert stat.S_ISLNK(os.lstat(m.mnt / "c2" / "a.txt").st_mode)
        assert_refused(m.mnt, "dir/f.txt")
        assert_alive(m)


@pytest.mark.mount
@pytest.mark.parametrize("reval", REVALIDATE)
def test_mount_passthrough_never_follows_a_swap(
    mtree: tuple[Path, Path], mounter: Mounter, reval: tuple[str, ...]
) -> None:
    src, secret = mtree
    m = mounter(src, "--max-entry", "1K", "--passthrough-above", "1K", *reval)
    fd = os.open(m.mnt / "big.bin", os.O_RDONLY)  # opened before the swap
    try:
        os.stat(m.mnt / "dir" / "f.txt")
        swap_file(src / "big.bin", secret / "f.txt")
        swap_dir(src / "dir", secret)
        if KERNEL_HITS:
            # The kernel opened the file without the daemon, which opens it at the first
            # read: a symlink now, refused (ELOOP), never followed.
            with pytest.raises(OSError):
                _read_fd(fd)
        else:
            # The open handle keeps reading the file it opened, which was in SRC.
            assert _read_fd(fd) == LEGIT
    finally:
        os.close(fd)
    assert_refused(m.mnt, "big.bin")
    assert_refused(m.mnt, "dir/f.txt")
    s = assert_alive(m)
    assert s["passthrough_opens"] >= 2
    # (under kernel hits the handle opened before the swap never read: refused)
    assert s["bytes_from_source"] == (1 if KERNEL_HITS else 2) * len(LEGIT)


def _wait_for_ssd(m: Mount, n: int) -> None:
    poll(lambda: m.stats().get("ssd_entries", 0) >= n, "SSD writes did not finish")


@pytest.mark.mount
@pytest.mark.parametrize("reval", REVALIDATE)
def test_mount_ssd_revalidation_never_follows_a_swap(
    mtree: tuple[Path, Path], mounter: Mounter, tmp_path: Path, reval: tuple[str, ...]
) -> None:
    src, secret = mtree
    m = mounter(src, "--ssd", str(tmp_path / "ssd"), *reval)
    assert read_nofollow(m.mnt, "c2/a.txt") == LEGIT
    assert read_nofollow(m.mnt, "dir/f.txt") == LEGIT
    _wait_for_ssd(m, 2)
    m.ctl("drop\n")  # only the SSD holds them now
    if reval:
        # Past the revalidation interval, the kernel looks the names up again (and finds
        # them unchanged), while the daemon's own check of the files is now due: the next
        # open revalidates against the source and, the signature having changed, fetches.
        time.sleep(1.2)
        os.stat(m.mnt / "c2" / "a.txt")
        os.stat(m.mnt / "dir" / "f.txt")
    swap_file(src / "c2" / "a.txt", secret / "a.txt")
    swap_dir(src / "dir", secret)
    if reval and KERNEL_HITS:
        # The kernel looked the names up again before the swap, and serves the pages it
        # holds of what it found (from SRC) without asking: LEGIT, or refused.
        for rel in ("dir/f.txt", "c2/a.txt"):
            try:
                assert read_nofollow(m.mnt, rel) == LEGIT
            except OSError:
                assert_refused(m.mnt, rel)
    elif reval:
        assert_refused(m.mnt, "dir/f.txt")
        assert_refused(m.mnt, "c2/a.txt")
    else:
        # Not yet revalidated: the cached copy, which came from SRC, is what is served.
        assert read_nofollow(m.mnt, "c2/a.txt") == LEGIT
        assert read_nofollow(m.mnt, "dir/f.txt") == LEGIT
    assert assert_alive(m)["bytes_from_source"] == 3 * len(LEGIT)


@pytest.mark.mount
@pytest.mark.parametrize("reval", REVALIDATE)
def test_mount_prefetch_never_follows_a_swap(
    mtree: tuple[Path, Path], mounter: Mounter, reval: tuple[str, ...]
) -> None:
    src, secret = mtree
    m = mounter(src, *reval)
    # The plan's paths are checked as they are written; the directory is swapped before the
    # plan is installed (at close), so the prefetcher fetches through the symlink.
    fd = os.open(m.mnt / ".shadefs" / "plan", os.O_WRONLY)
    try:
        os.write(fd, b"dir/f.txt\nc2/a.txt\n")
        swap_dir(src / "dir", secret)
        swap_file(src / "c2" / "a.txt", secret / "a.txt")
    finally:
        os.close(fd)
    poll(lambda: m.stats()["prefetch"]["errors"] >= 2, lambda: str(m.stats()["prefetch"]), 10)
    s = m.stats()
    assert s["prefetch"]["fetched"] == 0 and s["prefetch"]["staged"] == 0
    assert s["bytes_from_source"] == 0
    assert_refused(m.mnt, "dir/f.txt")
    assert_refused(m.mnt, "c2/a.txt")
    assert_alive(m)


@pytest.mark.mount
def test_mount_control_paths_through_a_symlink_are_refused(
    mtree: tuple[Path, Path], mounter: Mounter
) -> None:
    src, secret = mtree
    (src / "link").symlink_to(secret)
    (src / "flink").symlink_to(secret / "f.txt")
    m = mounter(src)
    for line in (
        "prefetch link/f.txt",
        "prefetch flink",
        "evict link/f.txt",
        "prefetch c2/b.txt link/f.txt",
    ):
        with pytest.raises(OSError) as e:
            m.ctl(line + "\n")
        assert e.value.errno == errno.EINVAL, line
    for plan in (b"link/f.txt\n", b"c2/b.txt\nflink\n"):
        with pytest.raises(OSError) as e:
            fd = os.open(m.mnt / ".shadefs" / "plan", os.O_WRONLY)
            try:
                os.write(fd, plan)
            finally:
                os.close(fd)
        assert e.value.errno == errno.EINVAL, plan
    # Residency says `missing` whether or not the file exists outside SRC.
    fd = os.open(m.mnt / ".shadefs" / "residency", os.O_RDWR)
    try:
        os.write(fd, b"link/f.txt\nlink/nothing-here\nflink\nc2/b.txt\n")
        assert os.pread(fd, 1000, 0) == b"missing\nmissing\nmissing\nnone\n"
    finally:
        os.close(fd)
    time.sleep(0.3)  # a prefetch that slipped through would have started by now
    s = assert_alive(m)
    assert s["prefetch"]["plans"] == 0 and s["prefetch"]["fetched"] == 0
    assert s["bytes_from_source"] == len(LEGIT)  # c2/b.txt, read by assert_alive


@pytest.mark.mount
def test_mount_growing_file_costs_a_bounded_fetch(tmp_path: Path, mounter: Mounter) -> None:
    src = tmp_path / "src"
    (src / "c2").mkdir(parents=True)
    (src / "c2" / "b.txt").write_bytes(LEGIT)
    head = os.urandom(4096)
    path = src / "grow.bin"
    path.write_bytes(head)
    m = mounter(src, "--ram", "64M")
    assert os.stat(m.mnt / "grow.bin").st_size == 4096  # looked up at 4 KiB
    stop = threading.Event()

    def append() -> None:
        with open(path, "ab") as f:
            while not stop.is_set() and f.tell() < 256 << 20:
                f.write(b"x" * 65536)

    t = threading.Thread(target=append)
    t.start()
    whole = 0
    try:
        time.sleep(0.05)  # growing already when it is opened
        for _ in range(3):
            before = m.stats()["bytes_from_source"]
            # The reader gets one whole version of the file, or EIO (it kept changing
            # while it was read), never a file cut at the size it was looked up at.
            try:
                data = read_nofollow(m.mnt, "grow.bin")
            except OSError as exc:  # (ESTALE: no version lasted from lookup to open)
                assert exc.errno in (errno.EIO, errno.ESTALE)
            else:
                assert data == head + b"x" * (len(data) - len(head))
                whole += len(data)
            used = m.stats()["bytes_from_source"] - before
            # Each read of the file is bounded by a size it had (looked up, or seen by the
            # open that met a new version) plus a margin: never unbounded.
            size = path.stat().st_size
            # (Blocks of a version read whole before may come from RAM: no lower bound.)
            assert used <= 4 * (4096 + (64 << 10)) + 2 * (size + (64 << 10) + size // 100)
    finally:
        stop.set()
        t.join()
    assert assert_alive(m)["ram_bytes"] <= len(LEGIT) + whole  # no cut file was admitted
