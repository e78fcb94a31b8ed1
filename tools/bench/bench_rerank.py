"""The `epoch` policy's re-rank after an epoch change, in CPU time of the event loop.

    python tools/bench/bench_rerank.py [--samples 1280000] [--resident 256000 1280000]
        [--jobs 2] [--epochs 5]

Every `--samples` file has its tracker id (a registered dataset); `--resident` of them are
resident in one `epoch` policy, made resident in a shuffled order (as reads make them: the
residency order is not the id order, so the re-rank's gathers and scatters land at random,
unlike tools/bench/bench_loop_lag.py whose resident ids are the first ones). `--jobs` jobs
read; then, `--epochs` times, every job announces its next epoch (the tracker recounts) and
the policy re-ranks its entries (`EpochPolicy._fresh`, what the first access or admission
after the change runs in the event loop). Prints the CPU ms of each re-rank. Issue 20's
goal for any step of the loop is 50 ms. Runs on older trees too (the policy's internals are
only called, not read).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from shadefs.cache.policies import EpochPolicy


def rerank_ms(samples: int, resident: int, jobs: int, epochs: int) -> list[float]:
    policy = EpochPolicy()
    t = policy.tracker
    t.reserve(samples)
    keys = np.arange(samples, dtype=np.int64) + 1000
    t._ids(keys)  # every file has its id, as a registered dataset gives them
    rng = np.random.default_rng(0)
    for k in rng.permutation(keys)[:resident].tolist():
        for job in range(jobs):
            t.read(k, job)
            policy.accessed(k, False, job)
        policy.inserted(k, 1)
    took = []
    for e in range(1, epochs + 1):
        t.announce(e)  # every job's next epoch: the tracker recounts
        cpu = time.thread_time()
        policy._fresh()
        took.append((time.thread_time() - cpu) * 1000)
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1_280_000)
    ap.add_argument("--resident", type=int, nargs="+", default=[256_000, 1_280_000])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5)
    args = ap.parse_args()
    for resident in args.resident:
        ms = rerank_ms(args.samples, min(resident, args.samples), args.jobs, args.epochs)
        each = " ".join(f"{m:.1f}" for m in ms)
        print(
            f"{resident} resident of {args.samples}, {args.jobs} jobs: re-rank ms CPU {each} "
            f"(median {float(np.median(ms)):.1f})"
        )


if __name__ == "__main__":
    main()
