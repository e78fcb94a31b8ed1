"""Cache policies: pure decision objects that never do I/O and never take locks.

The cache tells a policy what happens (`inserted`, `removed`, `accessed`) and asks it two
questions: may this miss be admitted, and if so which resident entries make room for it
(`admit`); and which entries to drop to free bytes when the budget shrinks (`shrink`).
Keys are opaque ints (the cache uses inode numbers), sizes are bytes.

`lru` is the baseline. `epoch` is the default (DESIGN.md fact 1): under shuffled epochs
every file is read once per epoch, so the best any demand cache can do is keep a fixed
set until it has been read this epoch (hit ratio f = cache/dataset, the bound that
Belady's MIN also reaches), while LRU thrashes (about f^2/2). `shade` keeps the samples the
training job finds most important (SHADE's APP): it pays off with the importance sampler,
which replays resident samples. Later policies (clairvoyant) implement the same interface.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import replace

from sortedcontainers import SortedList

from shadefs.stats import PolicyState

log = logging.getLogger(__name__)


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
    def accessed(self, key: int, hit: bool) -> None:
        """An open of `key` (one sample read); `hit` says whether it was resident."""

    @abstractmethod
    def admit(self, key: int, size: int, free: int) -> list[int] | None:
        """Victims to evict so that the miss `key` of `size` bytes fits, or None to refuse.

        `free` is the tier's free bytes now. Returning [] means it fits as is.
        """

    @abstractmethod
    def shrink(self, need: int) -> list[int]:
        """Victims, in eviction order, that free at least `need` bytes (or everything)."""

    def begin_epoch(self, epoch: int) -> None:  # noqa: B027 - optional hook
        """The sampler announced epoch `epoch` (policies that infer epochs may use it)."""

    def describe(self) -> PolicyState:
        return PolicyState(name=self.name, entries=len(self.sizes))


class LruPolicy(Policy):
    """Least recently used, over bytes: always admit, evict the oldest access first."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._order: OrderedDict[int, None] = OrderedDict()

    def inserted(self, key: int, size: int) -> None:
        super().inserted(key, size)
        self._order[key] = None

    def removed(self, key: int) -> None:
        super().removed(key)
        self._order.pop(key, None)

    def accessed(self, key: int, hit: bool) -> None:
        if hit and key in self._order:
            self._order.move_to_end(key)

    def admit(self, key: int, size: int, free: int) -> list[int] | None:
        return _take(iter(self._order), self.sizes, size - free)

    def shrink(self, need: int) -> list[int]:
        victims = _take(iter(self._order), self.sizes, need)
        return list(self._order) if victims is None else victims


class EpochPolicy(Policy):
    """Keep what has not been read this epoch; evict what was read this epoch first.

    Each resident entry remembers the epoch of its last read. Relative to the current
    epoch E an entry is *protected* (last read in E-1: it will be read again in E),
    *consumed* (read in E: its next read is in E+1) or *stale* (not read for a whole epoch:
    no longer part of what the job reads). A miss is admitted into free space, or in place
    of stale entries; it is never swapped for a consumed one, because the miss itself was
    just consumed and the swap would be pure churn. Consumed entries go first when the
    budget shrinks, protected ones last.

    Epochs are inferred when no sampler announces them: reading a resident file that was
    already read in the current epoch means a new pass over the data has begun. With a
    resident fraction f the boundary is noticed after about 1/f reads of the new epoch,
    and the misses in between are not admitted anyway, so nothing is lost.
    """

    name = "epoch"

    def __init__(self) -> None:
        super().__init__()
        self.epoch = 0
        self._explicit = False
        self._last: dict[int, int] = {}
        # Insertion-ordered buckets of keys by the epoch of their last read.
        self._buckets: dict[int, dict[int, None]] = {}

    def _place(self, key: int, epoch: int) -> None:
        old = self._last.get(key)
        if old is not None:
            bucket = self._buckets[old]
            del bucket[key]
            if not bucket:
                del self._buckets[old]
        self._last[key] = epoch
        self._buckets.setdefault(epoch, {})[key] = None

    def inserted(self, key: int, size: int) -> None:
        super().inserted(key, size)
        # A miss was just read, so a new entry starts out consumed.
        self._place(key, self.epoch)

    def restored(self, key: int, size: int) -> None:
        # Found on disk after a restart: nothing says it was read this epoch, so it is
        # protected until it is (and its first read must not look like a new epoch).
        Policy.inserted(self, key, size)
        self._place(key, self.epoch - 1)

    def removed(self, key: int) -> None:
        super().removed(key)
        old = self._last.pop(key, None)
        if old is not None:
            bucket = self._buckets[old]
            del bucket[key]
            if not bucket:
                del self._buckets[old]

    def accessed(self, key: int, hit: bool) -> None:
        if not hit:
            return
        last = self._last.get(key)
        if last is None:
            return
        if last == self.epoch and not self._explicit:
            self.epoch += 1
            log.debug("inferred the start of epoch %d", self.epoch)
        self._place(key, self.epoch)

    def begin_epoch(self, epoch: int) -> None:
        self._explicit = True
        if epoch > self.epoch:
            self.epoch = epoch

    def _stale(self) -> Iterable[int]:
        for e in sorted(self._buckets):
            if e >= self.epoch - 1:
                break
            yield from self._buckets[e]

    def _consumed(self) -> Iterable[int]:
        yield from self._buckets.get(self.epoch, ())

    def _protected(self) -> Iterable[int]:
        yield from self._buckets.get(self.epoch - 1, ())

    def admit(self, key: int, size: int, free: int) -> list[int] | None:
        return _take(self._stale(), self.sizes, size - free)

    def shrink(self, need: int) -> list[int]:
        def order() -> Iterable[int]:
            yield from self._stale()
            yield from self._consumed()
            yield from self._protected()

        victims = _take(order(), self.sizes, need)
        return list(order()) if victims is None else victims

    def describe(self) -> PolicyState:
        source = "sampler" if self._explicit else "inferred"
        return replace(super().describe(), epoch=self.epoch, epoch_source=source)


class ShadePolicy(Policy):
    """SHADE's APP: resident entries ordered by importance; a miss is admitted only if it is
    more important than the least important resident entries it replaces.

    Importance comes from `score(key)` (the importance table, which covers every sample,
    cached or not: the ghost table). Scores change whenever losses arrive; instead of
    re-sorting on every update, an entry sits in the sorted list under the score it had when
    last ranked, and is re-ranked when it reaches the bottom (a lazy priority queue). So a
    loss batch costs the policy nothing, and eviction does O(log n) work per re-ranked entry.
    Ties keep what is resident (strictly more important to get in), so equal scores mean no
    churn: with no losses reported yet this behaves like a static cache.
    """

    name = "shade"

    def __init__(self, score: Callable[[int], float]) -> None:
        super().__init__()
        self.score = score
        self._ranked: SortedList = SortedList()
        self._rank_of: dict[int, float] = {}

    def inserted(self, key: int, size: int) -> None:
        super().inserted(key, size)
        s = self.score(key)
        self._rank_of[key] = s
        self._ranked.add((s, key))

    def removed(self, key: int) -> None:
        super().removed(key)
        s = self._rank_of.pop(key, None)
        if s is not None:
            self._ranked.remove((s, key))

    def accessed(self, key: int, hit: bool) -> None:
        pass  # reads say nothing about importance under an importance sampler

    def _bottom(self) -> Iterable[tuple[float, int]]:
        """Entries from the least important up, each re-ranked to its current score first."""
        return _lazy_walk(self._ranked, self._rank_of, self.score, descending=False)

    def admit(self, key: int, size: int, free: int) -> list[int] | None:
        need = size - free
        if need <= 0:
            return []
        incoming = self.score(key)
        return _ranked_victims(self._bottom(), self.sizes, need, lambda s: s >= incoming)

    def shrink(self, need: int) -> list[int]:
        return _ranked_victims(self._bottom(), self.sizes, need) or []

    def describe(self) -> PolicyState:
        d = super().describe()
        if not self._ranked:
            return d
        low, high = round(self._ranked[0][0], 4), round(self._ranked[-1][0], 4)
        return replace(d, min_score=low, max_score=high)


class BeladyPolicy(Policy):
    """Belady's MIN on a known order: evict what is needed furthest in the future.

    `next_use(key)` estimates when `key` is read next: a monotonic time from the prefetch
    plans, or any quantity that grows with distance in a known order. Keys that no plan
    reads again are infinitely far. The rule (Lobster): never evict an entry whose next
    use comes before that of the entry being brought in. A miss whose own next use is
    furthest is not admitted at all (MIN with bypass). With no known order, every key is
    infinitely far, nothing is ever displaced, and the cache keeps what it filled up with.

    Entries sit in a sorted list under the estimate they had when last ranked. Estimates
    only move when a key is read (its next use jumps to the following occurrence) or when
    the readers' rates change, so each entry is re-ranked when read, and the furthest
    entry is checked again before it is evicted (a lazy priority queue).
    """

    name = "belady"

    def __init__(self, next_use: Callable[[int], float]) -> None:
        super().__init__()
        self.next_use = next_use
        self._ranked: SortedList = SortedList()
        self._rank_of: dict[int, float] = {}

    def _rank(self, key: int) -> None:
        old = self._rank_of.get(key)
        if old is not None:
            self._ranked.remove((old, key))
        t = self.next_use(key)
        self._rank_of[key] = t
        self._ranked.add((t, key))

    def inserted(self, key: int, size: int) -> None:
        super().inserted(key, size)
        self._rank(key)

    def removed(self, key: int) -> None:
        super().removed(key)
        t = self._rank_of.pop(key, None)
        if t is not None:
            self._ranked.remove((t, key))

    def accessed(self, key: int, hit: bool) -> None:
        if key in self._rank_of:
            self._rank(key)

    def _furthest(self) -> Iterable[tuple[float, int]]:
        """Entries from the furthest next use down, each re-checked before it is offered."""
        return _lazy_walk(self._ranked, self._rank_of, self.next_use, descending=True)

    def admit(self, key: int, size: int, free: int) -> list[int] | None:
        need = size - free
        if need <= 0:
            return []
        incoming = self.next_use(key)
        # Everything from the first entry needed no later than the newcomer on must stay.
        return _ranked_victims(self._furthest(), self.sizes, need, lambda t: not t > incoming)

    def shrink(self, need: int) -> list[int]:
        return _ranked_victims(self._furthest(), self.sizes, need) or []


def _same(a: float, b: float) -> bool:
    return a == b or (math.isinf(a) and math.isinf(b) and (a > 0) == (b > 0)) or abs(a - b) <= 1e-3


def _lazy_walk(
    ranked: SortedList,
    rank_of: dict[int, float],
    current: Callable[[int], float],
    *,
    descending: bool,
) -> Iterable[tuple[float, int]]:
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


def _ranked_victims(
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


def _take(candidates: Iterable[int], sizes: dict[int, int], need: int) -> list[int] | None:
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


POLICIES = ("epoch", "lru", "shade", "belady")


def make_policy(
    name: str,
    score: Callable[[int], float] | None = None,
    next_use: Callable[[int], float] | None = None,
) -> Policy:
    """A fresh policy by name; `shade` ranks by `score` (neutral for every key if None),
    `belady` by `next_use` (every key infinitely far if None)."""
    if name == "epoch":
        return EpochPolicy()
    if name == "lru":
        return LruPolicy()
    if name == "shade":
        return ShadePolicy(score or (lambda key: 0.5))
    if name == "belady":
        return BeladyPolicy(next_use or (lambda key: math.inf))
    raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
