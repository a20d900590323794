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
    return interleaved_per_step_us({"step": step}, repeats, min_seconds)["step"]


def interleaved_per_step_us(steps: dict[str, Callable[[], object]], repeats: int = 7,
                            min_seconds: float = 0.2) -> dict[str, float]:
    """`per_step_us` of each of `steps`, their timed loops taken in turn (a, b, a, b, ...): a slow stretch of a
    noisy machine then falls on every step alike instead of on whichever was being timed."""
    counts = {name: _calibrated_steps(step, min_seconds) for name, step in steps.items()}
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            samples[name].append(_timed_loop(step, counts[name]) / counts[name])
    return {name: round(statistics.median(times) * 1e6, 2) for name, times in samples.items()}


def _calibrated_steps(step: Callable[[], object], min_seconds: float) -> int:
    """How many calls of `step` make a loop of about `min_seconds` (found by doubling, which warms it up)."""
    step()
    steps = 1
    while True:
        elapsed = _timed_loop(step, steps)
        if elapsed >= min_seconds / 4:
            break
        steps *= 2
    return max(1, math.ceil(steps * min_seconds / elapsed))


def _timed_loop(step: Callable[[], object], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return time.perf_counter() - start
