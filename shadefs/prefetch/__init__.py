"""The prefetch part: what will be read, fetched ahead into staging.

- `plans.py`: plans, a known order's files and its readers' cursors;
- `fetching.py`: what the prefetcher and the cache agree on (a fetch call's items and
  results, the tiers, the settings);
- `prefetcher.py`: the staging buffer and the scheduler that fetches a plan's misses
  ahead of its readers, through the fetch callable the cache hands it;
- `speculate.py`: speculative plans, for jobs that announce no order: the files a job has
  not read yet this epoch (the readers' tracker says which); `spec_plans.py`: such a
  plan, consumed by its job's reads in any order.

It plans over the readers part's state and asks the cache only through the callables and
Protocols it is handed: it never imports the coordinator, which owns the prefetcher
(tests/test_structure.py).
"""
