"""Asking a daemon that may not answer: every tool call into a mount has a time limit.

A stopped (SIGSTOP) or wedged daemon leaves every request to its mount waiting in the
kernel, and a tool that reads `stats.json` or stats the mount point would wait with it.
So the command line makes such calls in a daemon thread and gives up after a deadline
with one clear line; the thread is left behind, and dies with the process (a request the
daemon has not read yet is abandoned by the kernel when the process exits).

Whether a path is mounted comes from /proc/self/mountinfo, which asks no daemon.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

from shadefs.common import EXIT_NOT_SHADEFS, QuietError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds a tool waits for a daemon to answer one request before it gives up.
ANSWER_TIMEOUT = 10.0


class NoAnswer(QuietError):
    """The daemon did not answer within the time limit (exit code 7)."""

    def __init__(self, mountpoint: str, seconds: float) -> None:
        super().__init__(
            f"the shadefs daemon of {mountpoint} does not answer within {seconds:g} s "
            f"(stopped or hung?); `shadefs umount -z {mountpoint}` detaches it",
            EXIT_NOT_SHADEFS,
        )


def within(seconds: float, mountpoint: str, fn: Callable[[], T]) -> T:
    """fn() run in a thread; its result or exception, or NoAnswer after `seconds`."""
    box: dict[str, object] = {}

    def call() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    t = threading.Thread(target=call, name="shadefs-ask", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise NoAnswer(mountpoint, seconds)
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounted(path: str) -> bool:
    """Whether `path` (absolute, symlinks resolved by the caller) is a mount point, from
    /proc/self/mountinfo: no request reaches the filesystem mounted there."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            return any(
                len(fields) > 4 and _unescape(fields[4]) == path
                for fields in (line.split() for line in f)
            )
    except OSError:
        return os.path.ismount(path)
