"""The daemon against its surroundings, through real mounts: a cache directory deleted or
foreign, bad cache paths, a stopped daemon under the tools, another user's descriptors, a
source remounted on its path, a closed pipe.

Each test is one case of issue 22's "the daemon against its surroundings"; the README's
Security section states what they show.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import make_tree, shadefs_cmd

pytestmark = pytest.mark.mount


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(shadefs_cmd(*args), capture_output=True, text=True, timeout=timeout)


def wait_for(what: str, test: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not test():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


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
    shutil.rmtree(cache)
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
    wait_for("SSD writes", lambda: m2.stats()["tiers"]["ssd"]["writes"] >= 10)
    for rel, data in tree.items():
        assert (m.mnt / rel).read_bytes() == data
    entries = [p for p in (cache / "data").rglob("*") if p.is_file()]
    assert len(entries) == m2.stats()["ssd_entries"]
    assert m.log.read_text().count("was deleted while mounted") == 1
    assert "Traceback" not in m.log.read_text()
