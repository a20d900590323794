"""The workloads' sizes and the timing loop, shared by strategy_bench.py and tf_peer.py (which runs without distrib)."""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

WORKLOADS = ("allreduce_1m", "batch_200x1000", "empty_merge_call")
VECTOR_ELEMENTS = 1_000_000  # allreduce_1m: one float32 array of this many elements per replica
BATCH_COUNT, BATCH_ELEMENTS = 200, 1_000  # batch_200x1000: this many float32 arrays of this many elements


def per_step_us(step: Callable[[], object], repeats: int = 7, min_seconds: float = 0.2) -> float:
    """Median over `repeats` timed loops of `step()`, in microseconds per call (to 0.01 µs).

    The loop length is calibrated so that one loop lasts about `min_seconds`; the calibration loops double as
    the warm-up (first calls start threads, trace functions and fill buffer pools).
    """
    step()
    steps = 1
    while True:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds / 4:
            break
        steps *= 2
    steps = max(1, math.ceil(steps * min_seconds / elapsed))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        samples.append((time.perf_counter() - start) / steps)
    return round(statistics.median(samples) * 1e6, 2)
