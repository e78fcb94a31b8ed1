"""Small pieces shared by the CLI and the daemon: sizes, user errors and exit codes.

Exit codes (documented in the README):

=====  =============================================================
0      success
1      unexpected internal error (a bug: the traceback is logged)
2      bad command line (unknown option, bad size, bad -o option)
3      the source directory is missing or not a directory
4      the mount point is missing, not a directory or already mounted
5      FUSE is not available (no /dev/fuse, no fusermount3)
6      the mount failed or the daemon did not become ready
7      not a shadefs mount, or the daemon does not answer
8      a control command was rejected (EINVAL)
9      the cache directory is in use by another daemon
=====  =============================================================
"""

from __future__ import annotations

import re

#: The control directory's name at the top of every mount (the daemon's and its clients').
CONTROL_NAME = ".shadefs"

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_SOURCE = 3
EXIT_MOUNTPOINT = 4
EXIT_NOFUSE = 5
EXIT_MOUNT_FAILED = 6
EXIT_NOT_SHADEFS = 7
EXIT_REJECTED = 8
EXIT_CACHE_LOCKED = 9


class QuietError(Exception):
    """An expected failure: print `msg` on one line, no traceback, exit with `exitcode`."""

    def __init__(self, msg: str, exitcode: int = EXIT_USAGE) -> None:
        super().__init__(msg)
        self.msg = msg
        self.exitcode = exitcode

    def __str__(self) -> str:
        return self.msg


# Explicit [0-9] and re.ASCII: Python's \d, int() and float() take any Unicode digit (`٣M`
# would be 3 MiB), and IGNORECASE without ASCII lets the Kelvin sign stand for K.
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGTP]?)(i?B?)?\s*", re.IGNORECASE | re.ASCII)
_INT_RE = re.compile(r"\s*([0-9]+)\s*", re.ASCII)
_FLOAT_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*", re.ASCII)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


def parse_size(text: str) -> int:
    """Parse `123`, `64K`, `1.5G`, `16GiB` into bytes (binary multiples). Raises ValueError."""
    m = _SIZE_RE.fullmatch(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use bytes or a K/M/G/T suffix, e.g. 16G)")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value >= 1 << 62:
        raise ValueError(f"size too large: {text!r}")
    return int(value)


def parse_int(text: str, minimum: int = 0) -> int:
    """A decimal integer in ASCII digits, at least `minimum`. Raises ValueError."""
    m = _INT_RE.fullmatch(text)
    if not m:
        raise ValueError(f"not a whole number: {text!r}")
    value = int(m.group(1))
    if value < minimum:
        raise ValueError(f"{text.strip()} is less than {minimum}")
    return value


def parse_float(text: str) -> float:
    """A non-negative decimal number in ASCII digits (no sign, exponent, inf or nan)."""
    m = _FLOAT_RE.fullmatch(text)
    if not m:
        raise ValueError(f"not a number: {text!r} (use digits, e.g. 2.5)")
    return float(m.group(1))


def format_size(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
