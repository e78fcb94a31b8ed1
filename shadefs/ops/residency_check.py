"""`shadefs warmup --check`: how much of a set of files is cached, per tier, reading none.

This module owns asking the daemon where each file is (through the `residency` control
file, by way of `ControlClient.residency`), and the report: files and bytes per tier, the
cached fractions, as text or JSON. Choosing the files is `warmup.select`'s job.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shadefs.common import format_size
from shadefs.torch.client import ControlClient

CACHED = ("ram", "ssd")
# The most failures listed on stderr.
MAX_LISTED = 10

# Asks the daemon where each path (relative to the mount root) is, one status per path.
Query = Callable[[list[bytes]], list[str]]


@dataclass
class Report:
    """Counts and bytes per residency status (`ram`, `ssd`, `none`, `missing`, ...)."""

    files: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, status: str, size: int) -> None:
        self.files[status] = self.files.get(status, 0) + 1
        self.bytes[status] = self.bytes.get(status, 0) + max(size, 0)

    @property
    def total_files(self) -> int:
        return sum(self.files.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def cached_fraction(self) -> tuple[float, float]:
        """(files, bytes) held in any tier, as fractions of all files and bytes asked about."""
        f = sum(self.files.get(t, 0) for t in CACHED)
        b = sum(self.bytes.get(t, 0) for t in CACHED)
        return (
            f / self.total_files if self.total_files else 0.0,
            b / self.total_bytes if self.total_bytes else 0.0,
        )

    def as_dict(self) -> dict[str, object]:
        files_frac, bytes_frac = self.cached_fraction()
        statuses = sorted(set(self.files) | {"ram", "ssd", "none", "missing"})
        return {
            "files": self.total_files,
            "bytes": self.total_bytes,
            "tiers": {
                s: {"files": self.files.get(s, 0), "bytes": self.bytes.get(s, 0)} for s in statuses
            },
            "cached_files_fraction": round(files_frac, 6),
            "cached_bytes_fraction": round(bytes_frac, 6),
        }

    def text(self) -> str:
        tf, tb = self.total_files, self.total_bytes

        def pct(n: int, of: int) -> str:
            return f"{100 * n / of:.1f}%" if of else "0.0%"

        extra = sorted(set(self.files) - {"ram", "ssd", "none", "missing"})
        tiers = [*CACHED, *extra]
        files = ", ".join(
            f"{t} {self.files.get(t, 0)} ({pct(self.files.get(t, 0), tf)})" for t in tiers
        )
        sizes = ", ".join(
            f"{t} {format_size(self.bytes.get(t, 0))} ({pct(self.bytes.get(t, 0), tb)})"
            for t in tiers
        )
        files_frac, bytes_frac = self.cached_fraction()
        return (
            f"{tf} files, {format_size(tb)}: {files}, not cached {self.files.get('none', 0)}, "
            f"missing {self.files.get('missing', 0)}\n"
            f"bytes: {sizes}, not cached {format_size(self.bytes.get('none', 0))}\n"
            f"cached: {100 * files_frac:.1f}% of files, {100 * bytes_frac:.1f}% of bytes\n"
        )


def check(mnt: str, files: Sequence[tuple[str, int]], query: Query | None = None) -> Report:
    """Residency of `files` ((absolute path under mnt, size)); `query` for tests."""
    mnt = os.path.abspath(mnt)
    rels = [os.fsencode(os.path.relpath(p, mnt)) for p, _ in files]
    # A name with a newline cannot be asked about in a line protocol: report it as unknown.
    ok = [i for i, r in enumerate(rels) if b"\n" not in r]
    ask = query if query is not None else ControlClient(mnt).residency
    answers = ask([rels[i] for i in ok])
    report = Report()
    status = dict(zip(ok, answers, strict=True))
    for i, (_, size) in enumerate(files):
        report.add(status.get(i, "unknown"), size)
    return report


def print_report(report: Report, errors: Sequence[tuple[str, str]], as_json: bool) -> int:
    """Print `report` (and the paths that could not be listed); the number of files missing."""
    for path, why in errors[:MAX_LISTED]:
        print(f"shadefs: cannot list {path}: {why}", file=sys.stderr)
    if as_json:
        d = report.as_dict()
        d["errors"] = [{"path": p, "error": e} for p, e in errors[:MAX_LISTED]]
        print(json.dumps(d))
    else:
        sys.stdout.write(report.text())
    return report.files.get("missing", 0) + len(errors)
