"""What `shadefs warmup` shows while it runs: rich's progress bar on a terminal, plain lines
otherwise.

On a terminal, `RichProgress` is a transient rich bar (files done of the total, bytes, rate,
time left) that rich redraws from its own thread and erases when it is closed. Anywhere else
(a log file, a pipe, a CI job), `PlainProgress` writes one plain line every `every` seconds
and nothing for a run shorter than that, so the output reads well in a log and holds no
terminal escapes.

Only the command line imports this module (and with it rich), never the daemon.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType
from typing import IO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)

from shadefs.common import format_size

# Seconds between two plain progress lines.
PLAIN_EVERY = 10.0


class RichProgress:
    """A rich progress bar: a spinner while listing, then a bar while reading."""

    def __init__(self, console: Console) -> None:
        self._bar = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("files  {task.fields[size]}  {task.fields[rate]}"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self._listing: TaskID | None = None
        self._reading: TaskID | None = None
        self._bar.start()

    def listing(self, found: int) -> None:
        if self._listing is None:
            # No total: rich shows the bar as pulsing, and the spinner turns.
            self._listing = self._bar.add_task("listing", total=None, size="", rate="")
        self._bar.update(self._listing, completed=found)

    def reading(self, done: int, total: int, nbytes: int, elapsed: float) -> None:
        if self._reading is None:
            if self._listing is not None:
                self._bar.remove_task(self._listing)
            self._reading = self._bar.add_task("reading", total=total, size="", rate="")
        rate = f"{format_size(nbytes / elapsed)}/s" if elapsed > 0 else ""
        self._bar.update(
            self._reading, completed=done, total=total, size=format_size(nbytes), rate=rate
        )

    def close(self) -> None:
        self._bar.stop()

    def __enter__(self) -> RichProgress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class PlainProgress:
    """One plain line every `every` seconds (the first one `every` seconds after the start)."""

    def __init__(
        self,
        out: IO[str],
        every: float = PLAIN_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.out = out
        self.every = every
        self._clock = clock
        self._last = clock()

    def _due(self) -> bool:
        now = self._clock()
        if now - self._last < self.every:
            return False
        self._last = now
        return True

    def listing(self, found: int) -> None:
        if self._due():
            self._line(f"listing: {found} files found")

    def reading(self, done: int, total: int, nbytes: int, elapsed: float) -> None:
        if not self._due():
            return
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = duration((total - done) / rate) if rate > 0 else "--:--"
        self._line(f"{done}/{total} files, {format_size(nbytes)}, {rate:.0f} files/s, ETA {eta}")

    def _line(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def close(self) -> None:
        pass  # every line is complete already

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def progress_for(out: IO[str]) -> RichProgress | PlainProgress:
    """A rich bar when `out` is a terminal, plain lines otherwise."""
    if out.isatty():
        return RichProgress(Console(file=out))
    return PlainProgress(out)


def duration(seconds: float) -> str:
    """`m:ss`, or `h:mm:ss` from an hour up."""
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"
