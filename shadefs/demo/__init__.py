"""`shadefs demo` and what it runs on: the digits dataset and training loop (digits), the
run itself (run), its matplotlib figure (plot), and the slow-remote emulator (slowfs,
slowfs_ops) that the demo, the benchmarks and the tests mount as the "remote" source.

Example code for the `torch` extra: nothing in the daemon imports this package.
"""
