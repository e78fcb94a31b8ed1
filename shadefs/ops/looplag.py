"""The event loop's health: how late a 10 ms timer fires (stats.json `loop_lag_max_ms`).

Everything of the data path runs in the one trio thread (docs/developer-notes.md), so any
work that holds it (an order build, a rerank over every entry) delays every open waiting
behind it. `LoopLag.run` sleeps 10 ms again and again and keeps the worst overshoot; the
stats take it (`take`), so each read of stats.json or of the Prometheus endpoint shows the
worst stall since the previous read.
"""

from __future__ import annotations

import trio

PERIOD = 0.010  # seconds: the timer's period


class LoopLag:
    """The worst delay of a `PERIOD` timer in the event loop since the last `take`."""

    def __init__(self) -> None:
        self.worst = 0.0  # seconds

    async def run(self) -> None:
        """Measure until cancelled (a task of the daemon's nursery)."""
        while True:
            t0 = trio.current_time()
            await trio.sleep(PERIOD)
            late = trio.current_time() - t0 - PERIOD
            if late > self.worst:
                self.worst = late

    def take(self) -> float:
        """The worst delay in ms since the last call, and start afresh."""
        worst, self.worst = self.worst, 0.0
        return round(worst * 1000, 3)
