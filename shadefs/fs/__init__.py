"""The kernel-facing side: pyfuse3 `Operations` and the namespace (inodes, snapshots)."""
