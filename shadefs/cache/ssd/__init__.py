"""The SSD tier: file contents kept in a local cache directory across mounts.

- `tier`: the tier the coordinator consults: its index, write-behind, restore, watermarks,
  and plans' entries read ahead for the prefetcher;
- `store`: the cache directory, through a descriptor held from mount to unmount: entries,
  the lock, the restore walk;
- `ledger`: the budget's counters, kept in the directory;
- `format`: an entry's on-disk format and its checks;
- `owner`: who may own a cache directory.
"""
