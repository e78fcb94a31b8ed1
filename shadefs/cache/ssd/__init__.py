"""The SSD tier: file contents kept in a local cache directory across mounts.

- `tier`: the tier the coordinator consults: its index, write-behind, restore, watermarks,
  and plans' entries read ahead for the prefetcher;
- `store`: the cache directory, through a descriptor held from mount to unmount: entries,
  the lock, the restore walk;
- `writer`: the write-behind's queue and the tier's own low-priority thread that writes it;
- `ledger`: the budget's counters, kept in the directory;
- `format`: an entry's on-disk format and its checks;
- `owner`: who may own a cache directory.
"""
