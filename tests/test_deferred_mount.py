"""Files evicted from RAM but still in the kernel's page cache, through the mount: their
reopens are answered before any fetch (cache/deferred.py), so the source sends what the
daemon serves, not what the kernel serves from its own pages (issue 23); with kernel hits
the daemon never sees those reads at all. A file changed
while the kernel holds its pages is test_identity_mount.py's (the reopen's check sees it)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytestmark = pytest.mark.mount

MiB = 1 << 20


def _pass(mnt: Path, names: list[str], want: dict[str, bytes]) -> None:
    for name in names:
        assert (mnt / name).read_bytes() == want[name]


@pytest.mark.parametrize("speculate", [True, False], ids=["speculate", "no-speculate"])
def test_a_second_pass_fetches_what_the_daemon_serves(
    tmp_path: Path, mounter, speculate: bool
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(1)
    want = {f"f{i:02}.bin": rng.randbytes(256 << 10) for i in range(24)}  # 6 MiB
    for name, data in want.items():
        (src / name).write_bytes(data)
    args = ["--ram", "2M"] + ([] if speculate else ["--no-speculate"])
    m = mounter(src, *args)
    names = sorted(want)
    _pass(m.mnt, names, want)
    m.ctl("drop")  # evicted from RAM; the kernel keeps its pages of every file
    before = m.stats()
    rng.shuffle(names)
    _pass(m.mnt, names, want)
    after = m.stats()
    fetched = after["bytes_from_source"] - before["bytes_from_source"]
    served = after["bytes_served"] - before["bytes_served"]
    assert fetched <= 1.1 * served + MiB, (fetched, served)
    if m.no_open:  # kernel hits: the daemon sees none of the reads, and counts no miss
        assert (fetched, after["misses"] - before["misses"]) == (0, 0)
        return
    assert after["misses"] - before["misses"] == 24  # still misses for the counters
    assert after["handles"]["deferred"] >= 1
    assert after["handles"]["bytes"] == 0 and after["handles"]["open"] == 0
