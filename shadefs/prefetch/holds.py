"""Staged files held for the opens still to come of a sweep group's members.

The members of a sweep group read one order each, at their own pace, behind the fastest.
A file staged for the group, or one the cache refused while the known orders still read it
(prefetcher.py `hold`), stays staged until that many opens of it have been seen (from any
tier), so that the members behind find it instead of fetching it again each. A member that
never comes for it is given `abandon_after` seconds (`expire`).
"""

from __future__ import annotations

__all__ = ["Holds"]


class Holds:
    """Staged key -> the opens that will still take it, and since when it is held."""

    def __init__(self) -> None:
        self.left: dict[int, int] = {}
        self._since: dict[int, float] = {}

    def __contains__(self, key: int) -> bool:
        return key in self.left

    def hold(self, key: int, opens: int, now: float) -> None:
        """Keep `key` staged for its next `opens` opens."""
        self.left[key] = opens
        self._since[key] = now

    def opened(self, key: int) -> None:
        """One more open of `key`: the last one it was held for releases it."""
        left = self.left.get(key)
        if left is not None:
            if left > 1:
                self.left[key] = left - 1
            else:
                self.release(key)

    def release(self, key: int) -> None:
        self.left.pop(key, None)
        self._since.pop(key, None)

    def expire(self, now: float, after: float) -> bool:
        """Release what is held for longer than `after` seconds; whether anything was."""
        old = [k for k, t in self._since.items() if now - t > after]
        for key in old:
            self.release(key)  # a member that never came for it: stop holding it for them
        return bool(old)
