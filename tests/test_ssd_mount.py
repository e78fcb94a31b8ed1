"""The SSD tier through real mounts: restarts, crashes, corruption, hangs, full disks."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import drop_kernel_pages, poll, require_fuse, shadefs_cmd

pytestmark = pytest.mark.mount
REPO = Path(__file__).resolve().parents[1]


def make_source(root: Path, files: int, *, seed: int = 0, max_size: int = 300_000) -> int:
    rng = random.Random(seed)
    total = 0
    for i in range(files):
        p = root / f"d{i % 7}" / f"f{i:04d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        n = rng.choice([0, 100, 5000, 60_000, rng.randint(1, max_size)])
        p.write_bytes(rng.randbytes(n))
        total += n
    return total


def read_all_and_compare(src: Path, mnt: Path) -> None:
    for p in sorted(src.rglob("*")):
        if p.is_file():
            assert (mnt / p.relative_to(src)).read_bytes() == p.read_bytes(), p


def wait_until(m, done, what: str, timeout: float = 30) -> dict:
    """The mount's stats once `done(stats)` holds (the daemon is another process)."""

    def finished() -> dict | None:
        s = m.stats()
        return s if done(s) else None

    return poll(finished, what, timeout)


def wait_for_writes(m, timeout: float = 30) -> dict:
    return wait_until(
        m, lambda s: s["tiers"]["ssd"]["queued_writes"] == 0, "SSD writes did not finish", timeout
    )


def test_sigkill_then_remount_reuses_the_ssd_cache(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    total = make_source(src, 300)
    cache = tmp_path / "cache"
    m = mounter(src, "--ram", "1M", "--ssd", f"{cache}:1G")
    read_all_and_compare(src, m.mnt)
    s = wait_for_writes(m)
    # (With kernel hits an empty file is never read: the kernel knows it has no bytes.)
    cached = sum(1 for p in src.rglob("*.bin") if p.stat().st_size or not m.no_open)
    assert s["ssd_entries"] == cached and s["ram_bytes"] <= 1 << 20
    os.kill(s["pid"], signal.SIGKILL)
    time.sleep(0.2)
    with pytest.raises(OSError):
        os.listdir(m.mnt)  # a dead mount answers ENOTCONN, it is not an empty directory
    m.unmount()
    m2 = mounter(src, "--ram", "1M", "--ssd", f"{cache}:1G", name="mnt")
    read_all_and_compare(src, m2.mnt)
    assert m2.stats()["bytes_from_source"] <= 0.01 * total
    # The restore runs in the background (reads above did not wait for it); it ends soon.
    s2 = wait_until(m2, lambda s: s["restore"]["done"], "the restore did not finish")
    assert s2["restore"]["entries"] == cached


def test_flipped_bytes_in_the_cache_dir_never_reach_readers(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    make_source(src, 120, seed=1)
    cache = tmp_path / "cache"
    m = mounter(src, "--ram", "256K", "--ssd", f"{cache}:1G")
    read_all_and_compare(src, m.mnt)
    wait_for_writes(m)
    m.unmount()
    rng = random.Random(5)
    victims = rng.sample([p for p in cache.rglob("*") if p.is_file() and p.stat().st_size], 10)
    for p in victims:
        data = bytearray(p.read_bytes())
        for _ in range(3):
            data[rng.randrange(len(data))] ^= 0xFF
        p.write_bytes(bytes(data))
    m2 = mounter(src, "--ram", "256K", "--ssd", f"{cache}:1G", name="mnt")
    read_all_and_compare(src, m2.mnt)
    read_all_and_compare(src, m2.mnt)
    s = m2.stats()
    entry_victims = sum(1 for p in victims if "data" in p.parts)
    assert s["corrupt_entries"] >= entry_victims > 0
    assert s["bytes_from_source"] > 0  # the damaged entries were refetched


def test_default_ssd_budget_survives_remounts(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    make_source(src, 20, seed=7)
    cache = tmp_path / "cache"
    m = mounter(src, "--ssd", str(cache))
    budget = m.stats()["ssd_capacity"]
    read_all_and_compare(src, m.mnt)
    wait_for_writes(m)
    m.unmount()
    # The cache now takes disk space; a recomputed default would come out smaller.
    m2 = mounter(src, "--ssd", str(cache), name="mnt")
    assert m2.stats()["ssd_capacity"] == budget > 0


def test_second_daemon_on_one_cache_dir_is_refused(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    make_source(src, 3)
    cache = tmp_path / "cache"
    mounter(src, "--ssd", str(cache))
    (tmp_path / "mnt2").mkdir()
    res = subprocess.run(
        shadefs_cmd("mount", str(src), str(tmp_path / "mnt2"), "--ssd", str(cache)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 9, res.stderr
    assert "in use by another shadefs daemon" in res.stderr and "Traceback" not in res.stderr


def test_full_cache_disk_degrades_to_ram_and_source(tmp_path: Path, mounter) -> None:
    require_fuse()
    src = tmp_path / "src"
    make_source(src, 80, seed=2)
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)], check=True)
    try:
        # A budget far above what the disk holds: the disk fills before the budget does.
        m = mounter(src, "--ram", "512K", "--ssd", f"{small}/c:1G", "--ssd-min-free", "0")
        for _ in range(2):
            read_all_and_compare(src, m.mnt)
        s = wait_for_writes(m)
        assert s["tiers"]["ssd"]["write_failures"] > 0
        assert s["ram_bytes"] <= 512 << 10
        m.unmount()
        assert "Traceback" not in m.log.read_text()
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_concurrent_readers_never_exceed_the_ssd_budget(tmp_path: Path, mounter) -> None:
    require_fuse()
    src = tmp_path / "src"
    total = make_source(src, 240, seed=3, max_size=120_000)
    budget = total // 3
    # The cache gets a filesystem of its own so that its usage can be sampled atomically
    # (statvfs); a walk over the directory could count a victim and its replacement, which
    # never coexisted. tmpfs directories take no blocks, so this counts entry files only.
    fs = tmp_path / "cachefs"
    fs.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(fs)], check=True)
    try:
        m = mounter(src, "--ram", "256K", "--ssd", f"{fs}/c:{budget}", "--ssd-min-free", "0")

        def used() -> int:
            sv = os.statvfs(fs)
            return (sv.f_blocks - sv.f_bfree) * sv.f_frsize

        baseline = used()  # the lock file
        files = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
        peak = 0
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, used() - baseline)
                time.sleep(0.002)

        errors: list[BaseException] = []

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(3):
                    order = files[:]
                    rng.shuffle(order)
                    for rel in order:
                        assert (m.mnt / rel).read_bytes() == (src / rel).read_bytes()
            except BaseException as exc:
                errors.append(exc)

        sampler = threading.Thread(target=sample)
        sampler.start()
        threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        s = wait_for_writes(m)
        stop.set()
        sampler.join()
        assert not errors, errors[0]
        assert 0 < peak <= budget, (peak, budget)
        assert s["ssd_bytes"] <= budget and s["tiers"]["ssd"]["writes"] > 0
        m.unmount()
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)


# --- a source that hangs or vanishes -----------------------------------------------------


def start_slowfs(real: Path, mnt: Path) -> int:
    mnt.mkdir()
    subprocess.run(
        [sys.executable, "-m", "shadefs.demo.slowfs", str(real), str(mnt), "--daemon"]
        + ["--open-latency", "0", "--meta-latency", "0", "--bandwidth", "0"],
        check=True,
        timeout=60,
    )
    stats = json.loads(os.getxattr(mnt, "user.slowfs.stats"))
    return int(stats["pid"])


def test_hanging_source_serves_hits_and_fails_misses_in_time(tmp_path: Path, mounter) -> None:
    require_fuse()
    real = tmp_path / "real"
    make_source(real, 40, seed=4)
    remote = tmp_path / "remote"
    slow_pid = start_slowfs(real, remote)
    try:
        # No speculation: it would have staged the cold files before the source hung.
        m = mounter(remote, "--ram", "64M", "--source-timeout", "2", "--no-speculate")
        cached = sorted(p.relative_to(real) for p in real.rglob("*") if p.is_file())
        warm = cached[:20]
        # (an empty file's read needs no source call: under kernel hits, not even a request)
        cold = [rel for rel in cached[20:] if (real / rel).stat().st_size]
        for rel in warm:
            (m.mnt / rel).read_bytes()
        subprocess.run(["ls", "-R", str(m.mnt)], check=True, capture_output=True)
        os.kill(slow_pid, signal.SIGSTOP)  # every call into the source now blocks
        for rel in warm:
            assert (m.mnt / rel).read_bytes() == (real / rel).read_bytes()
        t0 = time.monotonic()
        with pytest.raises(OSError) as e:
            (m.mnt / cold[0]).read_bytes()
        assert e.value.errno == 5 and time.monotonic() - t0 <= 2 + 1
        t0 = time.monotonic()
        res = subprocess.run(["ls", "-R", str(m.mnt)], capture_output=True, timeout=20)
        assert res.returncode == 0 and time.monotonic() - t0 < 2
        assert m.stats()["source_healthy"] is False
        os.kill(slow_pid, signal.SIGCONT)

        def read_cold() -> bytes | None:
            try:
                return (m.mnt / cold[1]).read_bytes()
            except OSError:
                return None

        got = poll(read_cold, "no recovery after SIGCONT", 10, interval=0.2)  # (automatic)
        assert got == (real / cold[1]).read_bytes()
        assert m.stats()["source_healthy"] is True
        m.unmount()
        log = m.log.read_text()
        assert log.count("did not answer") == 1, log  # once per outage, not per request
    finally:
        os.kill(slow_pid, signal.SIGCONT)
        subprocess.run(["fusermount3", "-u", "-z", str(remote)], check=False)


def test_vanished_source_keeps_hits_and_fails_misses(tmp_path: Path, mounter) -> None:
    require_fuse()
    real = tmp_path / "real"
    make_source(real, 20, seed=6)
    remote = tmp_path / "remote"
    slow_pid = start_slowfs(real, remote)
    try:
        m = mounter(remote, "--ram", "64M", "--source-timeout", "2")
        files = sorted(p.relative_to(real) for p in real.rglob("*") if p.is_file())
        for rel in files[:10]:
            (m.mnt / rel).read_bytes()
        os.kill(slow_pid, signal.SIGKILL)  # the server is gone: ENOTCONN underneath
        time.sleep(0.2)
        for rel in files[:10]:
            assert (m.mnt / rel).read_bytes() == (real / rel).read_bytes()
        with pytest.raises(OSError) as e:
            (m.mnt / files[15]).read_bytes()
        assert e.value.errno == 5
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(remote)], check=False)


def test_changed_source_file_is_refetched(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    f = src / "d" / "sample.bin"
    f.write_bytes(b"old contents\n" * 100)
    cache = tmp_path / "cache"
    m = mounter(src, "--ram", "1M", "--ssd", f"{cache}:1G", "--revalidate", "0.5")
    assert (m.mnt / "d" / "sample.bin").read_bytes() == f.read_bytes()
    wait_for_writes(m)
    f.write_bytes(b"new and longer contents\n" * 300)
    time.sleep(1.0)
    assert (m.mnt / "d" / "sample.bin").read_bytes() == f.read_bytes()
    assert (m.mnt / "d" / "sample.bin").stat().st_size == f.stat().st_size
    s = m.stats()
    assert s["changed_files"] == 1
    # Remounted with the SSD cache: the new contents, not the old entry.
    m.unmount()
    m2 = mounter(src, "--ram", "1M", "--ssd", f"{cache}:1G", name="mnt")
    assert (m2.mnt / "d" / "sample.bin").read_bytes() == f.read_bytes()


def test_a_second_epoch_takes_its_ssd_entries_staged_from_the_ssd(tmp_path: Path, mounter) -> None:
    # Epoch 1 leaves every file on the SSD tier (RAM holds a few). In epoch 2, in another
    # shuffled order, speculation stages the SSD entries ahead of the reader, read from the
    # SSD: every byte right, every open a hit, nothing from the source.
    src = tmp_path / "src"
    rng = random.Random(1)
    rels = [f"d{i % 3}/f{i:03d}.bin" for i in range(150)]
    for rel in rels:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(rng.randbytes(20_000))
    m = mounter(src, "--ram", "256K", "--ssd", f"{tmp_path / 'cache'}:64M")
    for rel in rng.sample(rels, len(rels)):
        assert (m.mnt / rel).read_bytes() == (src / rel).read_bytes()
    before = wait_for_writes(m)
    assert before["tiers"]["ssd"]["entries"] == len(rels)
    order = rng.sample(rels, len(rels))
    drop_kernel_pages()  # (with kernel hits, the kernel would serve epoch 2 from its pages)
    # The first read begins epoch 2; speculation stages the unread files (in its next tick).
    assert (m.mnt / order[0]).read_bytes() == (src / order[0]).read_bytes()
    wait_until(m, lambda s: s["prefetch"]["staged"] > 0, "no SSD entry was staged")
    for rel in order[1:]:
        assert (m.mnt / rel).read_bytes() == (src / rel).read_bytes()
    after = m.stats()
    assert after["hits"] - before["hits"] == len(rels)
    assert after["misses"] == before["misses"]
    assert after["bytes_from_source"] == before["bytes_from_source"]
    assert after["prefetch"]["served"] > before["prefetch"]["served"]
