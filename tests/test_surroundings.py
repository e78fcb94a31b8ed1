"""The daemon against its surroundings, through real mounts: a cache directory deleted or
foreign, bad cache paths, a stopped daemon under the tools, another user's descriptors, a
source remounted on its path, a closed pipe.

Each test is one case of issue 22's "the daemon against its surroundings"; the README's
Security section states what they show.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shadefs.cli.waiting import ANSWER_TIMEOUT
from tests.conftest import make_tree, poll, require_fuse, shadefs_cmd

pytestmark = pytest.mark.mount


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(shadefs_cmd(*args), capture_output=True, text=True, timeout=timeout)


def wait_for(what: str, test: Callable[[], object], timeout: float = 30.0) -> None:
    poll(test, what, timeout)


def files(n: int, size: int = 5000) -> dict[str, bytes]:
    return {f"d/f{i:03d}": bytes([i % 251]) * (size + i) for i in range(n)}


# --- the SSD cache directory ----------------------------------------------------------------


def test_cache_dir_deleted_while_mounted_degrades_to_ram_and_source(
    tmp_path: Path, mounter
) -> None:
    tree = files(40)
    src = make_tree(tmp_path / "src", tree)
    cache = tmp_path / "cache"
    m = mounter(src, "--ram", "64K", "--ssd", f"{cache}:64M")
    for rel in list(tree)[:20]:
        assert (m.mnt / rel).read_bytes() == tree[rel]
    wait_for("SSD writes", lambda: m.stats()["tiers"]["ssd"]["writes"] >= 10)
    for _ in range(50):  # a write-behind landing meanwhile fails rm -rf with ENOTEMPTY: again
        try:
            shutil.rmtree(cache)
            break
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:
                raise
    assert not cache.exists()
    # stats.json answers (its free space is read from the held directory, not the path).
    assert m.stats()["pid"] > 0
    # The evictor's next pass notices: logged once, the daemon stays up.
    wait_for("the log line", lambda: "was deleted while mounted" in m.log.read_text())
    for rel, data in tree.items():
        assert (m.mnt / rel).read_bytes() == data
    assert m.stats()["ssd_entries"] == 0
    # A second daemon may take the path now: the first never writes into it.
    m2 = mounter(src, "--ram", "64K", "--ssd", f"{cache}:64M", name="mnt2")
    for rel, data in tree.items():
        assert (m2.mnt / rel).read_bytes() == data
    for rel, data in tree.items():
        assert (m.mnt / rel).read_bytes() == data
    wait_for("SSD writes", lambda: m2.stats()["tiers"]["ssd"]["queued_writes"] == 0)
    assert m2.stats()["tiers"]["ssd"]["writes"] >= 10
    entries = [p for p in (cache / "data").rglob("*") if p.is_file()]
    assert len(entries) == m2.stats()["ssd_entries"]
    assert m.log.read_text().count("was deleted while mounted") == 1
    assert "Traceback" not in m.log.read_text()


def one_line_error(res: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert res.returncode == code, (res.returncode, res.stderr)
    assert text in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_bad_cache_paths_exit_2_before_mounting(tmp_path: Path) -> None:
    require_fuse()
    src = make_tree(tmp_path / "src", {"f": b"x"})
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    (tmp_path / "file").write_text("x")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, 65534, 65534)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    cases = [
        ("/proc/x", "cache directory /proc/x"),
        (str(tmp_path / "file"), "is not a directory"),
        (str(mnt / "cache"), "inside the mount point"),
        (str(src / ".cache"), "inside the source"),
        (str(foreign), "belongs to uid 65534"),
        (str(open_dir), "writable by others"),
    ]
    for ssd, text in cases:
        res = run_cli("mount", str(src), str(mnt), "--ssd", ssd)
        one_line_error(res, 2, text)
        assert not os.path.ismount(mnt)
    assert not (src / ".cache").exists()
    res = run_cli("mount", str(src), str(mnt), "-o", "source_timeout=0")
    one_line_error(res, 2, "must be above 0")
    for value in ("0", "-1"):
        res = run_cli("mount", str(src), str(mnt), f"--source-timeout={value}")
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert "--source-timeout" in res.stderr.strip().splitlines()[-1]
    assert not os.path.ismount(mnt)


def test_a_forged_entry_in_a_cache_others_can_write_is_never_served(
    tmp_path: Path, mounter
) -> None:
    src = make_tree(tmp_path / "src", {"f": b"genuine" * 100})
    cache = tmp_path / "cache"
    m = mounter(src, "--ssd", f"{cache}:16M")
    assert (m.mnt / "f").read_bytes() == b"genuine" * 100
    wait_for("SSD writes", lambda: m.stats()["tiers"]["ssd"]["writes"] == 1)
    m.unmount()
    # Another user could now write entries: the daemon refuses the directory.
    (cache / "data").chmod(0o777)
    res = run_cli("mount", str(src), str(m.mnt), "--ssd", f"{cache}:16M", "--log", str(m.log))
    one_line_error(res, 2, "writable by others")
    assert not os.path.ismount(m.mnt)


# --- a stopped daemon -----------------------------------------------------------------------


def test_tools_time_out_on_a_stopped_daemon_and_umount_z_detaches(tmp_path: Path, mounter) -> None:
    src = make_tree(tmp_path / "src", {"f": b"x"})
    m = mounter(src)
    pid = m.stats()["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        res = run_cli("stat", str(m.mnt), "--timeout", "1")
        one_line_error(res, 7, "does not answer within 1 s")
        res = run_cli("ctl", str(m.mnt), "drop", "--timeout", "1")
        one_line_error(res, 7, "does not answer")
        res = run_cli("umount", str(m.mnt), "--timeout", "1")
        one_line_error(res, 7, "umount -z")
        res = run_cli("stat", str(m.mnt), "--watch", "--timeout", "1")
        one_line_error(res, 7, "does not answer within 1 s")
        res = run_cli("warmup", str(m.mnt), "--timeout", "1")
        one_line_error(res, 7, "does not answer within 1 s")
        # A lazy detach asks the daemon nothing: it does not wait out the answer timeout
        # (10 s), whatever --timeout says.
        t0 = time.monotonic()
        res = run_cli("umount", "-z", str(m.mnt), "--timeout", "30")
        assert res.returncode == 0, res.stderr
        assert "detached" in res.stderr
        assert time.monotonic() - t0 < ANSWER_TIMEOUT / 2
        with open("/proc/self/mountinfo") as f:
            assert f" {m.mnt} " not in f.read()
    finally:
        os.kill(pid, signal.SIGCONT)
    # Running again, the daemon finds its mount gone and exits.
    wait_for("the daemon to exit", lambda: not Path(f"/proc/{pid}").exists())


def test_stat_into_a_closed_pipe_is_quiet(tmp_path: Path, mounter) -> None:
    src = make_tree(tmp_path / "src", {"f": b"x"})
    m = mounter(src)
    for args in (["stat", str(m.mnt), "--json"], ["stat", str(m.mnt)]):
        proc = subprocess.Popen(shadefs_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # `| true`: the reader is gone before the first write
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) in (0, 128 + signal.SIGPIPE)
        assert err == "", err


# --- descriptors ----------------------------------------------------------------------------


class Holder:
    """A forked process of user `uid` that opens `paths` and keeps what it got open until
    `release()`. (A fork, not an exec: user nobody may not run the virtualenv's Python.)"""

    def __init__(self, uid: int, paths: list[Path]) -> None:
        results_r, results_w = os.pipe()
        self._go_r, self._go_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: no pytest machinery, only system calls
            code = 1
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                fds, refused = [], 0
                for p in paths:
                    try:
                        fds.append(os.open(p, os.O_RDONLY))
                    except OSError as exc:
                        if exc.errno != errno.EMFILE:
                            raise
                        refused += 1
                os.write(results_w, f"{len(fds)} {refused}".encode())
                os.close(results_w)
                os.close(self._go_w)
                os.read(self._go_r, 1)  # until the parent closes its end
                code = 0
            finally:
                os._exit(code)
        os.close(results_w)
        os.close(self._go_r)
        with os.fdopen(results_r) as f:
            held, refused = f.read().split()
        self.held, self.refused = int(held), int(refused)

    def release(self) -> None:
        os.close(self._go_w)
        os.waitpid(self.pid, 0)


def test_another_user_cannot_exhaust_the_daemons_descriptors(tmp_path: Path) -> None:
    require_fuse()
    import resource
    import tempfile

    # Somewhere user nobody can reach (pytest's own directories are root's, mode 0700).
    top = Path(tempfile.mkdtemp(prefix="shadefs-fds-"))
    top.chmod(0o755)
    tree = {f"f{i:03d}": bytes([i]) * 8192 for i in range(100)}
    src = make_tree(top / "src", tree)
    mnt = top / "mnt"
    mnt.mkdir()

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (400, 400))

    # 8 KiB files above --max-entry are read through: each open holds a source descriptor
    # (none staged ahead in memory: no prefetch, no speculation).
    # The soft and hard limits of 400 leave the source 400 - 128 - 2 * 32 = 208 of them,
    # one user at most 208 // 8 = 26.
    args = ["--max-entry", "4K", "--passthrough-above", "4K", "--allow-other", "--no-prefetch"]
    log = tmp_path / "daemon.log"
    res = subprocess.run(
        shadefs_cmd("mount", str(src), str(mnt), "--log", str(log), *args),
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=low_limit,
    )
    assert res.returncode == 0, res.stderr
    holder = None
    try:
        holder = Holder(65534, [mnt / name for name in tree])
        assert (holder.held, holder.refused) == (26, 74)
        # The owner keeps working while the other user holds its share.
        owner = [os.open(mnt / name, os.O_RDONLY) for name in tree]
        try:
            for name, fd in zip(tree, owner, strict=True):
                assert os.pread(fd, 8192, 0) == tree[name]
        finally:
            for fd in owner:
                os.close(fd)
        text = log.read_text()
        assert "user 65534 holds 26 source descriptors" in text
        assert text.count("user 65534 holds") == 1
    finally:
        if holder is not None:
            holder.release()
        res = run_cli("umount", str(mnt))
        shutil.rmtree(top, ignore_errors=True)
    assert res.returncode == 0, res.stderr


# --- a source remounted on its path ---------------------------------------------------------


def test_a_source_remounted_on_its_path_is_reopened(tmp_path: Path, mounter) -> None:
    from tests.test_ssd_mount import start_slowfs

    require_fuse()
    tree = files(20)
    real = make_tree(tmp_path / "real", tree)
    remote = tmp_path / "remote"
    slow_pid = start_slowfs(real, remote)
    try:
        m = mounter(remote, "--source-timeout", "5", "--no-speculate", "--no-prefetch")
        names = list(tree)
        for rel in names[:5]:
            assert (m.mnt / rel).read_bytes() == tree[rel]
        os.kill(slow_pid, signal.SIGKILL)  # the source's server dies: ENOTCONN underneath
        with pytest.raises(OSError) as e:
            (m.mnt / names[10]).read_bytes()
        assert e.value.errno == errno.EIO
        subprocess.run(["fusermount3", "-u", "-z", str(remote)], check=True)
        # Not mounted yet: the path is the empty directory under the mount, not the source.
        with pytest.raises(OSError) as e:
            (m.mnt / names[11]).read_bytes()
        assert e.value.errno == errno.EIO
        # Restarted on the same path, as an automounter or a FUSE server's unit would.
        remote.rmdir()
        slow_pid = start_slowfs(real, remote)
        for rel in names[5:]:
            assert (m.mnt / rel).read_bytes() == tree[rel]
        assert m.stats()["source_healthy"] is True
        assert m.log.read_text().count("was remounted") == 1
    finally:
        os.kill(slow_pid, signal.SIGKILL)
        subprocess.run(["fusermount3", "-u", "-z", str(remote)], check=False)


# --- a hung source ----------------------------------------------------------------------------


def _slowfs(real: Path, mnt: Path, *args: str) -> int:
    mnt.mkdir()
    cmd = [sys.executable, "-m", "shadefs.demo.slowfs", str(real), str(mnt), "--daemon"]
    opts = ["--open-latency", "0", "--meta-latency", "0", "--bandwidth", "0", *args]
    subprocess.run(cmd + opts, check=True, timeout=60)
    return int(json.loads(os.getxattr(mnt, "user.slowfs.stats"))["pid"])


def _timed_read(path: Path) -> tuple[float, int | None]:
    t0 = time.monotonic()
    try:
        path.read_bytes()
    except OSError as exc:
        return time.monotonic() - t0, exc.errno
    return time.monotonic() - t0, None


@pytest.mark.parametrize("hang", ["stop", "open", "read"])
def test_more_misses_than_threads_into_a_hung_source_all_fail_in_time(
    tmp_path: Path, mounter, hang: str
) -> None:
    # Issue 36: with every worker thread stuck in the dead source, the misses queued behind
    # them waited until it answered again. Each must fail with EIO by its deadline.
    require_fuse()
    tree = files(30)
    real = make_tree(tmp_path / "real", tree)
    remote = tmp_path / "remote"
    slow_pid = _slowfs(real, remote, "--hang-on", "open,read,readdir")
    stop, resume = (
        (signal.SIGSTOP, signal.SIGCONT) if hang == "stop" else (signal.SIGUSR1, signal.SIGUSR2)
    )
    names = list(tree)
    hot, cold, later = names[:5], names[5:17], names[17:]
    timeout = 1.0
    pool = concurrent.futures.ThreadPoolExecutor(len(cold))
    try:
        m = mounter(remote, "--source-timeout", str(timeout), "--source-threads", "2",
                    "--no-speculate", "--no-prefetch")  # fmt: skip
        for rel in hot:
            assert (m.mnt / rel).read_bytes() == tree[rel]
        os.kill(slow_pid, stop)
        try:
            futures = [pool.submit(_timed_read, m.mnt / rel) for rel in cold]
            for rel in hot:  # hits answer while the misses wait
                assert (m.mnt / rel).read_bytes() == tree[rel]
            done, pending = concurrent.futures.wait(futures, timeout=10 * timeout)
            assert not pending, f"{len(pending)} misses still wait for the hung source"
            for f in done:
                took, err = f.result()
                assert err == errno.EIO and took <= 2 * timeout + 1, (took, err)
            s = m.stats()
            assert s["source_threads_stuck"] == 2 == s["source_threads_busy"]
            assert s["source_queue_timeouts"] >= len(cold) - 2
        finally:
            os.kill(slow_pid, resume)
            pool.shutdown(wait=True)
        # Recovery on its own: the stuck threads return, and misses are served again.
        wait_for("a good miss", lambda: _timed_read(m.mnt / later[0])[1] is None)
        for rel in later:
            assert (m.mnt / rel).read_bytes() == tree[rel]
        wait_for("the stuck threads", lambda: m.stats()["source_threads_stuck"] == 0)
        assert m.stats()["source_healthy"] is True
        m.unmount()
    finally:
        os.kill(slow_pid, signal.SIGKILL)
        subprocess.run(["fusermount3", "-u", "-z", str(remote)], check=False)


# --- forged channel headers -----------------------------------------------------------------


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def test_forged_channel_headers_are_refused_before_buffering(tmp_path: Path, mounter) -> None:
    import struct

    from shadefs.sampling import wire, wire_nodes

    tree = files(3)
    src = make_tree(tmp_path / "src", tree)
    m = mounter(src)
    ctl_dir = m.mnt / ".shadefs"
    fd = os.open(ctl_dir / "dataset", os.O_WRONLY)
    try:
        os.write(fd, wire.encode_dataset(list(tree)))
    finally:
        os.close(fd)
    pid = m.stats()["pid"]
    # 4096 nodes' bitmaps of 2**27 samples: a 64 GiB message, for a dataset of 3 samples.
    head = struct.pack(
        "<4sHHQQIIIIQQ", b"SHDI", wire.VERSION, 0, 0, 0, 4096, 4096, 0, 0, 1 << 27, 0
    )
    forged = [
        ("order", head),
        ("order", wire.encode_order_response(0, [0, 1])),  # a response is not a request
        ("losses", struct.pack("<4sHHII", b"SHDL", wire.VERSION, 0, 1, 1 << 30)),
        ("dataset", struct.pack("<4sHHQQ", b"SHDS", wire.VERSION, 0, 1, 1 << 30)),
    ]
    before = _rss(pid)
    chunk = bytes(1 << 20)
    for name, msg in forged:
        fd = os.open(ctl_dir / name, os.O_WRONLY)
        try:
            with pytest.raises(OSError) as e:
                os.write(fd, msg)
            assert e.value.errno == errno.EINVAL, name
            for _ in range(24):  # what follows a refused header is never buffered
                with pytest.raises(OSError) as e:
                    os.write(fd, chunk)
                assert e.value.errno == errno.EINVAL
        finally:
            os.close(fd)
    assert _rss(pid) - before < 48 << 20  # 96 MiB were sent
    assert "node order for 134217728 samples, but 3 are registered" in m.log.read_text()
    # A real node order of the registered dataset still goes through.
    bits = wire_nodes.encode_resident([True, True, True])[16:]
    msg = wire_nodes.encode_node_order(0, 0, 0, [7], [0], [bits], 3)
    assert wire_nodes.message_length(msg, 3) == len(msg)
    with pytest.raises(wire.WireError, match="limit"):
        wire_nodes.message_length(head, 1 << 27)


# --- the same, without a mount --------------------------------------------------------------


def test_a_store_whose_directory_is_deleted_refuses_quietly(tmp_path: Path) -> None:
    from shadefs.cache.ssd.store import SsdStore
    from shadefs.file_version import Signature

    sig = Signature(size=5, mtime_ns=1, ctime_ns=1, ino=7)
    with SsdStore(tmp_path / "c", 1 << 30, min_free=0) as store:
        assert store.put(b"a", b"hello", sig) and store.get(b"a", sig) == b"hello"
        assert not store.lost()
        shutil.rmtree(tmp_path / "c")
        assert store.lost()
        assert store.disk_free() > 0  # from the held descriptor
        assert store.get(b"a", sig) is None
        assert not store.put(b"b", b"hello", sig)
        with pytest.raises(FileNotFoundError):  # the tier's restore logs it and ends
            list(store.scan())
        assert store.remove(b"a") == 0
        # A new directory at the path is another daemon's: this store never writes there.
        (tmp_path / "c").mkdir(mode=0o700)
        assert not store.put(b"c", b"hello", sig)
        assert list((tmp_path / "c").iterdir()) == []


def test_fd_budget_caps_other_users_and_never_the_owner() -> None:
    import pyfuse3

    from shadefs.source.part import FdBudget

    fds = FdBudget(80, owner=1000)
    assert (fds.per_user, fds.others) == (10, 40)
    for fd in range(10):
        fds.take(2000)
        fds.opened(fd, 2000)
    with pytest.raises(pyfuse3.FUSEError) as e:
        fds.take(2000)
    assert e.value.errno == errno.EMFILE
    for fd in range(10, 40):  # three more users fill the others' half
        fds.take(2001 + fd // 10)
        fds.opened(fd, 2001 + fd // 10)
    with pytest.raises(pyfuse3.FUSEError):
        fds.take(3000)  # a fresh user: the others' half is full
    for uid in (1000, 0):
        fds.take(uid)  # the owner and root are never refused
        fds.give_back(uid)
    fds.take(None)  # nor the daemon's own work
    fds.closing(0)
    fds.take(2000)  # room again
    fds.give_back(2000)  # an open that failed
    assert fds.held[2000] == 9 and 1000 not in fds.held


async def test_a_tier_whose_directory_is_deleted_restores_and_evicts_without_dying(
    tmp_path: Path, autojump_clock: object
) -> None:
    import trio

    from shadefs.cache.policies.lru import LruPolicy
    from shadefs.cache.ssd.store import SsdStore
    from shadefs.cache.ssd.tier import SsdTier
    from shadefs.file_version import Signature

    sig = Signature(size=5, mtime_ns=1, ctime_ns=1, ino=7)
    with SsdStore(tmp_path / "c", 1 << 20, min_free=0) as store:
        assert store.put(b"a", b"hello", sig)
    with SsdStore(tmp_path / "c", 1 << 20, min_free=0) as store:
        tier = SsdTier(store, LruPolicy(), lambda ino: ino)
        assert await tier.lookup(7, b"a", sig) == b"hello"
        shutil.rmtree(tmp_path / "c")
        await tier.restore()  # the walk fails: logged, not raised
        assert tier.restore_done
        assert tier.describe().disk_free > 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tier.evictor, 5.0)
            await trio.sleep(6)  # one evictor pass (the clock jumps)
            nursery.cancel_scope.cancel()
        assert tier.lost
        assert tier.index == {} and await tier.lookup(7, b"a", sig) is None
        tier.offer(8, b"b", b"hello", sig)
        assert tier.queued == 0
