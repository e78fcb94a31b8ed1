"""What the daemon tells or asks the kernel: a leaf under every part that needs it.

- `tuning`: the mount's kernel-side settings written through sysfs (read-ahead, FUSE
  queue depth);
- `notify`: notifications into the kernel's caches (dentry and attribute invalidation, a
  small file's pages stored with its open);
- `pages`: which files the kernel may hold pages of, as far as the daemon can tell;
- `no_open`: FUSE no-open mode (`--kernel-hits`), where the kernel opens files itself.
"""
