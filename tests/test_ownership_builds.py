"""A multi-node install sorts the cached entries into owned and guests off the event loop."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import trio
import trio.testing

from shadefs.cache.policies import EpochPolicy, Owned
from shadefs.sampling import builds, wire_nodes
from tests.test_placement import IDS, _installed


def test_guests_are_found_in_a_worker_thread_and_only_for_the_current_ownership(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = 40
    s = _installed(n)  # keys 100..139
    msg = wire_nodes.decode_node_order(
        wire_nodes.encode_node_order(2, 7, 1, IDS[:2], [0, 1], [bytes(5)] * 2, n), n
    )
    s.install(msg)
    assert s.partition is not None
    policy = Owned(EpochPolicy(), s.owns_key)
    keys = [139, -5, 7, *range(100, 120)]  # a block key and a file outside the dataset too
    expected = [k for k in keys if not s.owns_key(k)]
    assert expected and -5 not in expected and 7 not in expected
    for key in keys:
        policy.inner.inserted(key, 1)  # resident before the ownership was known
    assert not policy.guests
    guests = trio.run(s.unowned, list(policy.sizes))
    assert guests == expected  # in the entries' order, oldest first
    policy.reclassify(guests)
    assert list(policy.guests) == expected
    # An ownership installed while the guests were found: that answer is stale. The worker
    # thread waits until the new ownership is in (else it may finish before).
    gate = threading.Event()
    find = builds.unowned

    def held(*args: Any) -> list[int]:
        gate.wait(10)
        return find(*args)

    monkeypatch.setattr(builds, "unowned", held)

    async def changed_meanwhile() -> list[int] | None:
        async with trio.open_nursery() as nursery:
            result: list[list[int] | None] = []

            async def ask() -> None:
                result.append(await s.unowned(keys))

            nursery.start_soon(ask)
            await trio.testing.wait_all_tasks_blocked()
            s.install(msg)  # a new epoch's placement: a new owner array
            gate.set()
        return result[0]

    assert trio.run(changed_meanwhile) is None
