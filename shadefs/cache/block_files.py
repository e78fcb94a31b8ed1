"""Block-cached files seen whole: their residency, their eviction, their hit or miss.

A file cached in blocks (cache/blocks.py) is many entries under block keys, so the
questions asked of a file key (is it resident, `ctl evict PATH`, did this open hit) need
its blocks looked up. These run in the trio thread; `drop_blocks` awaits SSD removals.
"""

from __future__ import annotations

from shadefs.cache.block_keys import block_key
from shadefs.cache.coordinator import Cache

__all__ = ["block_tier", "count_open", "drop_blocks"]


def block_tier(cache: Cache, key: int, size: int, block_size: int) -> int:
    """As `Cache.tier_of` for a block-cached file of `size` bytes: 1 when every block is in
    RAM, 2 when every block is in RAM or on the SSD, else 0 (not cached, or in part)."""
    entries, ssd = cache.entries, cache.ssd
    tier = 1
    for i in range(-(-size // block_size)):
        bkey = block_key(key, i)
        if bkey in entries:
            continue
        if ssd is None or bkey not in ssd.index:
            return 0
        tier = 2
    return tier


async def drop_blocks(cache: Cache, key: int, size: int, block_size: int) -> bool:
    """Drop every block of a file of `size` bytes from both tiers; whether any was held."""
    found = False
    for i in range(-(-size // block_size)):
        bkey = block_key(key, i)
        if bkey in cache.entries:
            cache.remove(bkey)
            cache.evictions += 1
            found = True
        ssd = cache.ssd
        if ssd is not None and bkey in ssd.index:
            found = await ssd.evict(bkey) or found
    return found


def count_open(cache: Cache, key: int, first: int) -> None:
    """Count an open of a block-cached file in the mount's hits and misses, by whether the
    block its first read needed (`first`) was cached in either tier."""
    bkey = block_key(key, first)
    ssd = cache.ssd
    cache.count_block_open(bkey in cache.entries or (ssd is not None and bkey in ssd.index))
