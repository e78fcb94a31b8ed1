"""The source part: every access to SRC, the backing tree the mount serves.

- `part`: the `Source` object the other parts call: lookups, listings, opens and reads,
  each in a worker thread under a deadline, and the source's health;
- `paths`: no-follow resolution of paths beneath SRC's descriptor (nothing outside SRC is
  ever read), and what tells two versions of an open file apart;
- `calls`: the worker threads and the one watchdog that keeps every call's deadline;
- `inline`: small files a local SRC has cached, read on the event loop without a thread;
- `reads`: large reads spread in pieces, and read-ahead advice.
"""
