"""Several nodes, pure parts: ownership, locality-aware shares, the SHDB/SHDI wire format and
ownership-aware admission (no mount; the gloo tests are in test_nodes_mount.py)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from shadefs.cache.policies import EpochPolicy, Owned, ShadePolicy, make_policy
from shadefs.sampling import builds, pads, placement, wire_nodes
from shadefs.sampling.importance import ImportanceTable
from shadefs.sampling.registry import Sampling, SamplingError
from shadefs.sampling.wire import (
    OrderRequest,
    WireError,
    decode_order_request,
    encode_order_request,
)

IDS = tuple(placement.node_id(f"host{i}", "/mnt/shade") for i in range(5))


def test_node_ids_are_stable_and_distinct() -> None:
    assert placement.node_id("a", "/m") == placement.node_id("a", "/m")
    assert len({placement.node_id("a", "/m"), placement.node_id("b", "/m"),
                placement.node_id("a", "/n")}) == 3  # fmt: skip


def test_owners_split_evenly_and_move_only_the_moved_shares() -> None:
    n = 20_000
    four = placement.owners(IDS[:4], n)
    assert np.array_equal(four, placement.owners(IDS[:4], n))  # deterministic
    counts = np.bincount(four, minlength=4)
    assert counts.min() > 0.9 * n / 4 and counts.max() < 1.1 * n / 4
    # A fifth node joins: only what it takes moves, about a fifth.
    five = placement.owners(IDS, n)
    moved = five != four
    assert np.all(five[moved] == 4)
    assert 0.15 < moved.mean() < 0.25
    # Node 1 leaves: only its samples move; the others keep theirs.
    rest = (IDS[0], IDS[2], IDS[3])
    three = placement.owners(rest, n)
    kept = four != 1
    assert np.array_equal(np.asarray(rest)[three[kept]], np.asarray(IDS[:4])[four[kept]])


def _padded(order: np.ndarray, world: int) -> np.ndarray:
    per = -(-len(order) // world)
    return order[np.arange(per * world) % len(order)]


def test_locality_shares_keep_the_multiset_and_send_residents_home() -> None:
    rng = np.random.default_rng(3)
    n, world = 1003, 4
    rank_node = np.array([0, 0, 1, 1])
    owner = placement.owners(IDS[:2], n)
    resident = np.stack([(owner == k) & (rng.random(n) < 0.4) for k in range(2)])
    params = pads.OrderParams(epoch=0, seed=5, world_size=world, rank=0, replay=3.0)
    order = pads.build_global_order(rng.random(n), resident.any(axis=0), params)
    shares = placement.locality_shares(order, resident, rank_node, owner)
    assert {len(s) for s in shares} == {-(-n // world)}
    assert Counter(np.concatenate(shares).tolist()) == Counter(_padded(order, world).tolist())
    for rank, share in enumerate(shares):
        local = resident[rank_node[rank]]
        remote = resident[1 - rank_node[rank]]
        assert not remote[share].any()  # another node's cached samples stay there
        # Every entry of a sample this node holds is trained here (quota permitting).
        assert local[share].sum() > 0
    for k in range(2):
        here = np.concatenate([shares[r] for r in np.flatnonzero(rank_node == k)])
        assert (
            resident[k][here].sum()
            == np.isin(_padded(order, world), np.flatnonzero(resident[k])).sum()
        )
    # The hits are spread through each share, not bunched at its start.
    share = shares[0]
    hits = np.flatnonzero(resident[0][share])
    assert hits.mean() == pytest.approx(len(share) / 2, rel=0.2)


def test_locality_shares_respect_quotas_and_one_node_is_distributed_sampler() -> None:
    n, world = 100, 2
    order = np.arange(n)
    everything = np.ones((1, n), dtype=bool)
    shares = placement.locality_shares(order, everything, np.zeros(world, dtype=np.int64))
    assert [s.tolist() for s in shares] == [pads.rank_slice(order, 2, r).tolist() for r in range(2)]
    # Node 0 holds everything but trains only half: the rest goes to node 1.
    both = np.stack([np.ones(n, dtype=bool), np.zeros(n, dtype=bool)])
    shares = placement.locality_shares(order, both, np.array([0, 1]))
    assert sorted(np.concatenate(shares).tolist()) == list(range(n))
    assert len(shares[0]) == len(shares[1]) == 50


def test_overlap_counts_samples_on_several_ranks() -> None:
    assert placement.overlap([np.array([1, 2]), np.array([3, 4])]) == 0.0
    assert placement.overlap([np.array([1, 2]), np.array([2, 4])]) == 0.5


def test_node_order_wire_round_trip_and_checks() -> None:
    n = 13
    bits = [wire_nodes.encode_resident(np.arange(n) % k == 0)[16:] for k in (2, 3)]
    msg = wire_nodes.encode_node_order(4, 9, 1, IDS[:2], [0, 1, 1], bits, n, np.arange(n))
    assert wire_nodes.message_length(msg[:40]) is None  # the header is not whole yet
    assert wire_nodes.message_length(msg[:56]) == len(msg)
    got = wire_nodes.decode_node_order(msg, n)
    assert (got.epoch, got.seed, got.me, got.node_ids, got.world_size) == (4, 9, 1, IDS[:2], 3)
    assert np.array_equal(got.resident[1], np.arange(n) % 3 == 0)
    assert np.array_equal(got.order, np.arange(n))
    with pytest.raises(WireError, match="registered"):
        wire_nodes.decode_node_order(msg, n + 1)
    with pytest.raises(WireError, match="bytes"):
        wire_nodes.decode_node_order(msg[:-1], n)
    with pytest.raises(WireError, match="nodes"):
        wire_nodes.encode_node_order(0, 0, 0, IDS[:3], [0, 1], bits, n)
    bad = wire_nodes.encode_node_order(0, 0, 0, IDS[:2], [0, 1], bits, n, np.array([n]))
    with pytest.raises(WireError, match="out of range"):
        wire_nodes.decode_node_order(bad, n)
    req = wire_nodes.encode_resident_request(n)
    assert wire_nodes.message_length(req) == len(req)
    assert wire_nodes.decode_resident_request(req) == n
    full = np.ones(n, dtype=bool)
    assert (
        wire_nodes.decode_resident(wire_nodes.encode_resident(full), n)
        == np.packbits(full).tobytes()
    )
    with pytest.raises(WireError, match="expected 12"):
        wire_nodes.decode_resident(wire_nodes.encode_resident(full), 12)
    # Other messages still go through wire.message_length.
    q = encode_order_request(1, 0, 2, 3)
    assert wire_nodes.message_length(q) == len(q) and decode_order_request(q).world_size == 2


def _installed(n: int = 40) -> Sampling:
    s = Sampling()
    s.keys = np.arange(100, 100 + n, dtype=np.uint64)
    s._sorted_keys = s.keys.copy()
    s._sorted_ids = np.arange(n, dtype=np.int64)
    s.table = ImportanceTable(n)
    return s


def test_sampling_install_serves_the_shares_and_sets_ownership() -> None:
    n = 40
    s = _installed(n)
    assert s.owns_key(100)  # no multi-node job yet: everything
    resident = np.zeros((2, n), dtype=bool)
    resident[1, :10] = True
    bits = [np.packbits(r).tobytes() for r in resident]
    msg = wire_nodes.decode_node_order(
        wire_nodes.encode_node_order(2, 7, 1, IDS[:2], [0, 1], bits, n), n
    )
    s.set_replay(1.0)
    order = s.install(msg)
    assert sorted(order.tolist()) == list(range(n))  # replay 1: one permutation
    share1 = s.order(OrderRequest(epoch=2, rank=1, world_size=2, seed=7), lambda k: k < 0)
    assert set(range(10)) <= set(share1.tolist())  # node 1's residents are its rank's
    owner = placement.owners(IDS[:2], n)
    assert [s.owns_key(100 + i) for i in range(n)] == (owner == 1).tolist()
    assert s.owns_key(7)  # not a sample: cached as ever


def test_owned_admits_guests_only_into_free_room_and_evicts_them_first() -> None:
    owned = {1, 2, 3}
    p = make_policy("shade", score=lambda k: 0.5, owns=lambda k: k in owned)
    assert isinstance(p, Owned) and isinstance(p.inner, ShadePolicy)
    assert p.admit(10, 5, free=10) == []  # a guest fits into free room
    p.inserted(10, 5)
    assert p.admit(11, 5, free=2) is None  # a guest never evicts
    assert p.admit(1, 5, free=0) == [10]  # an owned miss takes a guest's room first
    p.removed(10)
    p.inserted(1, 5)
    p.inserted(2, 5)
    assert p.admit(3, 5, free=0) is None  # then the inner policy decides (shade: ties stay)
    assert p.shrink(5) in ([1], [2])
    p.accessed(1, True)
    # Ownership changes: the resident entries are sorted again.
    owned.discard(2)
    p.reclassify()
    assert list(p.guests) == [2]
    assert p.shrink(1) == [2]
    # A guest not yet read this epoch is one of this node's hits to come: the inner policy
    # weighs it like any entry (shade: ties stay). Once read, it is the first to go.
    assert p.admit(3, 5, free=0) is None
    p.accessed(2, True)
    assert p.read == {2: None}
    assert p.admit(3, 5, free=0) == [2]
    p.begin_epoch(1)
    assert p.admit(3, 5, free=0) is None
    # A policy made while ownership is in force (`ctl policy ...`) notes reads of guests.
    fresh = make_policy("shade", score=lambda k: 0.5, owns=lambda k: k in owned)
    fresh.inserted(2, 5)
    fresh.begin_epoch(2)
    fresh.accessed(2, True)
    assert fresh.read == {2: None}
    epoch = make_policy("epoch", owns=lambda k: True)
    assert isinstance(epoch.inner, EpochPolicy) and epoch.tracker.epochs_of() == {}
    # Without guests (no multi-node job) a hit calls the inner policy directly.
    assert epoch.accessed == epoch.inner.accessed
    assert epoch.epoch == epoch.inner.epoch  # policy state reads through


def test_install_async_places_off_the_loop_and_only_for_the_same_dataset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = 40
    s = _installed(n)
    resident = np.zeros((2, n), dtype=bool)
    bits = [np.packbits(r).tobytes() for r in resident]
    msg = wire_nodes.decode_node_order(
        wire_nodes.encode_node_order(2, 7, 1, IDS[:2], [0, 1], bits, n), n
    )
    order = trio.run(s.install_async, msg)
    assert sorted(order.tolist()) == list(range(n)) and s.partition is not None
    release = threading.Event()
    place = builds.place

    def slow_place(*args: Any) -> Any:
        release.wait(10)  # until the loop has registered another dataset
        return place(*args)

    monkeypatch.setattr(builds, "place", slow_place)

    async def registered_meanwhile() -> None:
        async def install() -> None:
            with pytest.raises(SamplingError, match="registered anew"):
                await s.install_async(msg)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(install)
            await trio.testing.wait_all_tasks_blocked()
            s._generation += 1  # what a registration does
            release.set()

    trio.run(registered_meanwhile)
