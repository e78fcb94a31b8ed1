"""A source file's version: what tells two versions of one file apart.

A file is cached, staged, served and checked as the version it was looked up as; every
part that asks "is this still that version?" compares `Signature`s. ctime is in it because
it is the one field a writer cannot put back.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol


class StatLike(Protocol):
    """What a signature (and the cache's open) reads of a stat: os.stat_result, or the
    namespace's compact record."""

    @property
    def st_size(self) -> int: ...
    @property
    def st_mtime_ns(self) -> int: ...
    @property
    def st_ctime_ns(self) -> int: ...
    @property
    def st_ino(self) -> int: ...


class Signature(NamedTuple):
    """The source file's identity when it was cached; any change makes the entry stale.

    ctime_ns is there because it is the one field a writer cannot put back: size and mtime
    can be restored after an in-place rewrite (utime), ctime moves on with every change.
    A tuple rather than a frozen dataclass: one is built and compared on every open, and a
    tuple costs a fraction of a frozen dataclass's __init__.
    """

    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int

    @classmethod
    def of(cls, st: StatLike) -> Signature:
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def serves(got: Signature, size: int, want: Signature) -> bool:
    """Whether `size` bytes read as version `got` are version `want`, whole: the one check
    before bytes are served, cached or staged as the version a reader looked up."""
    return got == want and size == want.size


class Changed(Exception):
    """The source has another version of a file than the one looked up: its bytes are not
    served under the old version. The file system checks the node and retires it
    (`Namespace.fresh_stat`)."""
