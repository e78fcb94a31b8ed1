"""ControlClient, the one client of `.shadefs`: its answers on a real mount, and its errors.

Every error is a ControlError: a QuietError with the exit code the CLI documents (7: not a
shadefs mount or daemon gone, 8: a write rejected) and a RuntimeError for the sampler.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from shadefs.common import EXIT_NOT_SHADEFS, EXIT_REJECTED, QuietError
from shadefs.torch.client import ControlClient, ControlError, RejectedError, find_mount
from tests.conftest import make_tree, poll


def test_not_a_mount_is_exit_7_from_every_call(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    calls = [
        lambda c: c.check(),
        lambda c: c.stats(),
        lambda c: c.text("stats"),
        lambda c: c.ctl("drop"),
        lambda c: c.residency([b"a"]),
        lambda c: c.register(b"SHDS"),
        lambda c: c.order(b"SHDQ"),
    ]
    for where in (tmp_path, tmp_path / "file", tmp_path / "missing"):
        for call in calls:
            with pytest.raises(ControlError, match="is not a shadefs mount") as e:
                call(ControlClient(where))
            assert e.value.exitcode == EXIT_NOT_SHADEFS
            assert isinstance(e.value, QuietError) and isinstance(e.value, RuntimeError)


def test_an_older_daemon_names_the_missing_file(tmp_path: Path) -> None:
    (tmp_path / ".shadefs").mkdir()
    (tmp_path / ".shadefs" / "ctl").write_text("# last write: none\n")
    c = ControlClient(tmp_path)
    assert c.check() == tmp_path / ".shadefs"
    assert c.last_result() == "none"
    with pytest.raises(ControlError, match=r"\.shadefs/residency does not exist: .*residency"):
        c.residency([b"a"])
    with pytest.raises(ControlError, match=r"\.shadefs/losses does not exist: .*sampler channel"):
        c.send_losses(b"SHDL")
    assert find_mount(tmp_path / "train" / "x.png") == str(tmp_path)
    assert find_mount(tmp_path.parent) is None


@pytest.mark.mount
def test_stats_ctl_and_residency_on_a_real_mount(tmp_path: Path, mounter) -> None:
    src = make_tree(tmp_path / "src", {"a.bin": b"a" * 1000, "d/b.bin": b"b" * 2000})
    m = mounter(src, "--ram", "1M")
    c = ControlClient(m.mnt)
    (m.mnt / "a.bin").read_bytes()
    stats = c.stats()
    assert stats["misses"] == 1 and stats["pid"] > 0
    assert "misses 1" in c.text("stats")
    assert c.residency([b"a.bin", b"d/b.bin", b"nope"]) == ["ram", "none", "missing"]

    assert c.ctl("ram 2M").startswith("ok")
    assert c.ctl(["policy lru", "ram 3M"]).startswith("ok")  # one write, two commands
    assert (c.stats()["ram_capacity"], c.stats()["policy"]) == (3 << 20, "lru")
    with pytest.raises(RejectedError) as e:
        c.ctl(["ram 1M", "ram lots"])
    assert e.value.exitcode == EXIT_REJECTED and "not a size" in e.value.result
    assert str(e.value).startswith(f"shadefs rejected a write to {m.mnt}/.shadefs/ctl: error:")
    assert c.stats()["ram_capacity"] == 3 << 20  # nothing of the rejected write applied
    with pytest.raises(RejectedError):
        c.register(b"SHDS not a message")


@pytest.mark.mount
def test_a_dead_daemon_is_exit_7(tmp_path: Path, mounter) -> None:
    src = make_tree(tmp_path / "src", {"a.bin": b"a"})
    m = mounter(src)
    c = ControlClient(m.mnt)
    os.kill(c.stats()["pid"], signal.SIGKILL)

    def gone() -> bool:  # once the kernel has noticed
        try:
            c.stats()
        except ControlError as exc:
            return "is gone" in str(exc)
        return False

    poll(gone, "the dead daemon's mount still answers", 10)
    with pytest.raises(ControlError, match=f"shadefs daemon of {m.mnt} is gone") as e:
        c.ctl("drop")
    assert e.value.exitcode == EXIT_NOT_SHADEFS
