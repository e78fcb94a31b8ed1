"""The policy interface and the victim walks that several policies share.

A policy is a pure decision object: it never does I/O and never takes a lock. The cache
tells it what happens (`inserted`, `restored`, `removed`, `accessed` with the reading
job, `begin_epoch`) and asks
it two questions: may this miss be admitted, and if so which resident entries make room for
it (`admit`); and which entries to drop to free bytes when the budget shrinks (`shrink`).
Keys are opaque ints (the cache uses inode numbers), sizes are bytes.

The helpers below turn an order of candidates into a victim list: `take_prefix` for
policies that keep plain orders (lru, epoch), `lazy_walk` and `ranked_victims` for those
that keep a sorted list of ranks that go stale (shade, belady).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator

import numpy as np
from sortedcontainers import SortedList

from shadefs.stats import PolicyState

__all__ = ["Policy", "lazy_walk", "ranked_victims", "take_prefix"]


class Policy(ABC):
    """What every policy answers. All methods are O(1) or O(victims) and never block."""

    name: str = ""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}

    def inserted(self, key: int, size: int) -> None:
        self.sizes[key] = size

    def removed(self, key: int) -> None:
        self.sizes.pop(key, None)

    def restored(self, key: int, size: int) -> None:
        """An entry found on disk (restart) rather than just read: not an access."""
        self.inserted(key, size)

    @abstractmethod
    def accessed(self, key: int, hit: bool, job: int = 0) -> None:
        """An open of `key` (one sample read) by job `job` (the cache's job row, 0 when
        unknown); `hit` says whether it was resident."""

    def accessed_many(self, keys: list[int], job: int, ids: np.ndarray, ranks: np.ndarray) -> None:
        """Hits of the resident `keys` by job `job`, in order, told after the tracker took
        them all in (`ids`, `ranks`: their tracker ids and ranks now; no key repeats)."""
        for key in keys:
            self.accessed(key, True, job)

    @abstractmethod
    def admit(self, key: int, size: int, free: int) -> list[int] | None:
        """Victims to evict so that the miss `key` of `size` bytes fits, or None to refuse.

        `free` is the tier's free bytes now. Returning [] means it fits as is.
        """

    @abstractmethod
    def shrink(self, need: int) -> list[int]:
        """Victims, in eviction order, that free at least `need` bytes (or everything)."""

    def begin_epoch(self, epoch: int, job: int | None = None) -> None:  # noqa: B027
        """The sampler announced epoch `epoch` for job `job` (None: every job), with a new
        order: what the old one still read is no longer pending. Epochs themselves are
        the readers' tracker's (readers/tracker.py): no policy infers one."""

    def describe(self) -> PolicyState:
        return PolicyState(name=self.name, entries=len(self.sizes))


def take_prefix(candidates: Iterable[int], sizes: dict[int, int], need: int) -> list[int] | None:
    """The shortest prefix of `candidates` whose sizes add up to `need`, or None."""
    if need <= 0:
        return []
    victims = []
    for key in candidates:
        victims.append(key)
        need -= sizes[key]
        if need <= 0:
            return victims
    return None


def _same(a: float, b: float) -> bool:
    # Estimates such as next-use times drift a little all the time; a move this small is
    # not worth a re-rank. Two infinities of one sign are the same rank.
    return a == b or (math.isinf(a) and math.isinf(b) and (a > 0) == (b > 0)) or abs(a - b) <= 1e-3


def lazy_walk(
    ranked: SortedList,
    rank_of: dict[int, float],
    current: Callable[[int], float],
    *,
    descending: bool,
) -> Iterator[tuple[float, int]]:
    """Walk (rank, key) entries in order, re-ranking stale ones before offering them.

    An entry sits in `ranked` under the rank it had when last ranked. Before it is offered,
    its current rank is checked; a stale one is moved to where it belongs and the walk
    starts again from the end it began at, so an entry that moved behind the walk's
    position is still seen. Every entry is offered at most once.
    """
    offered: set[int] = set()
    while True:
        positions = range(len(ranked) - 1, -1, -1) if descending else range(len(ranked))
        for i in positions:
            rank, key = ranked[i]
            if key in offered:
                continue
            now = current(key)
            if not _same(now, rank):
                ranked.remove((rank, key))
                ranked.add((now, key))
                rank_of[key] = now
                break  # the list moved under us: start again
            offered.add(key)
            yield rank, key
        else:
            return


def ranked_victims(
    ranked: Iterable[tuple[float, int]],
    sizes: dict[int, int],
    need: int,
    must_stay: Callable[[float], bool] | None = None,
) -> list[int] | None:
    """Victims taken in eviction order until `need` bytes are freed.

    With `must_stay`, reaching an entry it accepts means the newcomer is not worth the
    room: None. Without it (shrinking), take what there is, even if it is not enough.
    """
    victims: list[int] = []
    for rank, key in ranked:
        if need <= 0:
            break
        if must_stay is not None and must_stay(rank):
            return None
        victims.append(key)
        need -= sizes[key]
    if need > 0 and must_stay is not None:
        return None
    return victims
