"""Steps/s of distributed input beside iterating the raw dataset, and how much input time prefetch hides."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # benchmark the checkout this file belongs to, installed or not

import distrib  # noqa: E402
from distrib.backends import cuda_problem  # noqa: E402
from distrib.backends.cuda.watchdog import wait_for  # noqa: E402

ROWS, FEATURES = 1024, 256  # one global batch: 1024 x 256 float32 = 1 MiB, plus int32 labels
STEPS = 128  # batches per epoch
TARGET_REPLICAS, TARGET_OVERHEAD = 4, 0.10


class ShuffledBatches:
    """An in-memory dataset: each epoch gathers shuffled rows into fresh 1 MiB batches, as a real loader does."""

    def __init__(self, rows: int = 64 * ROWS):
        rng = np.random.default_rng(0)
        self.x = rng.random((rows, FEATURES), dtype=np.float32)
        self.y = rng.integers(0, 10, rows).astype(np.int32)

    def __iter__(self):
        rng = np.random.default_rng(1)
        for _ in range(STEPS):
            index = rng.integers(0, len(self.x), ROWS)
            yield {"x": self.x[index], "y": self.y[index]}


def epoch_us(iterable, step=None, repeats: int = 7) -> float:
    """Median over `repeats` epochs of the time per step, in microseconds; one warm-up epoch first."""
    samples = []
    for k in range(repeats + 1):
        start = time.perf_counter()
        for batch in iterable:
            if step is not None:
                step(batch)
        if k:
            samples.append((time.perf_counter() - start) / STEPS)
    return round(statistics.median(samples) * 1e6, 1)


def training_step(weights: np.ndarray, strategy):
    """A stand-in for a step's compute: one matmul per replica's slice (BLAS releases the GIL, as real steps do)."""
    def step(batch):
        parts = strategy.experimental_local_results(batch["x"]) if strategy else (batch["x"],)
        for part in parts:
            part @ weights
    return step


def gpu_overlap(batch_mib: int, repeats: int) -> dict:
    """On GPU:0, whether prefetch hides the host-to-device copy: a step should cost ~max(copy, compute)."""
    import cupy
    import cupyx

    strategy = distrib.MirroredStrategy(["GPU:0"])
    rows = batch_mib * (1 << 20) // (FEATURES * 4)
    host = [np.random.default_rng(k).random((rows, FEATURES), dtype=np.float32) for k in range(4)]
    batches = [host[k % len(host)] for k in range(STEPS)]  # fresh host batches, cheap to produce
    weights = cupy.asarray(np.random.default_rng(9).random((FEATURES, FEATURES), dtype=np.float32) / FEATURES)
    stream = cupy.cuda.get_current_stream

    def settle():  # polled, as distrib waits: a blocking wait can take milliseconds to wake
        wait_for([stream()])

    def timed(loop) -> float:
        samples = []
        for k in range(repeats + 1):
            start = time.perf_counter()
            loop()
            if k:
                samples.append((time.perf_counter() - start) / STEPS * 1e6)
        return round(statistics.median(samples), 1)

    def copy_only():
        for batch in batches:
            cupy.asarray(batch)
            settle()

    copy_us = timed(copy_only)
    # The raw ceiling: the same bytes copied from a pinned host buffer allocated once, into one device buffer.
    pinned = cupyx.empty_pinned(host[0].shape, host[0].dtype)
    pinned[...] = host[0]
    target = cupy.empty(host[0].shape, host[0].dtype)

    def pinned_only():
        for _ in batches:
            target.set(pinned)
            settle()

    pinned_us = timed(pinned_only)
    only_input = strategy.experimental_distribute_dataset(batches)

    def distributed_copy_only():  # distrib's input path with nothing else to do: its copy throughput
        for batch in only_input:
            strategy.experimental_local_results(batch)[0]
        strategy.extended.backend.synchronize()

    distributed_copy_us = timed(distributed_copy_only)
    device_batch = cupy.asarray(host[0])
    matmuls = 1
    while True:  # size the step's compute to about the copy's time, where overlap matters most
        start = time.perf_counter()
        for _ in range(matmuls):
            device_batch @ weights
        settle()
        if (time.perf_counter() - start) * 1e6 >= copy_us or matmuls > 4096:
            break
        matmuls *= 2

    def compute(x):
        for _ in range(matmuls):
            x @ weights
        settle()

    compute_us = timed(lambda: [compute(device_batch) for _ in range(STEPS)])
    raw_us = timed(lambda: [compute(cupy.asarray(batch)) for batch in batches])
    dist = strategy.experimental_distribute_dataset(batches)

    def distributed():
        for batch in dist:
            with strategy.extended.backend.device_scope("GPU:0"):
                compute(strategy.experimental_local_results(batch)[0])

    distributed_us = timed(distributed)
    ideal_us = max(pinned_us, compute_us)
    gigabytes = batch_mib * (1 << 20) / 1e9
    result = {"batch_mib": batch_mib, "pageable_copy_us": copy_us, "pinned_copy_us": pinned_us,
              "distributed_copy_us": distributed_copy_us, "compute_us": compute_us,
              "raw_copy_then_compute_us": raw_us, "distributed_prefetch_us": distributed_us, "ideal_us": ideal_us,
              "pinned_GBps": round(gigabytes / pinned_us * 1e6, 1),
              "distributed_GBps": round(gigabytes / distributed_copy_us * 1e6, 1),
              "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    result["targets"] = {
        "input copy at least 90% of raw pinned bandwidth": distributed_copy_us <= pinned_us / 0.9,
        "a step with prefetch at most 1.1 x max(copy, compute)": distributed_us <= 1.1 * ideal_us}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", default="1,2,4,8", help="comma-separated replica counts")
    parser.add_argument("--quick", action="store_true", help="3 epochs per measurement instead of 7")
    parser.add_argument("--json", type=Path, default=None, help="where to write results "
                        "(default bench/results/input-<date>-cpu.json, or -gpu.json with --gpu)")
    parser.add_argument("--gpu", action="store_true", help="measure whether prefetch hides the host-to-device copy "
                        "on GPU:0 instead (needs the CUDA backend)")
    parser.add_argument("--gpu-batch-mib", type=int, default=64, help="batch size for --gpu (default 64 MiB)")
    args = parser.parse_args(argv)
    if args.gpu:
        problem = cuda_problem()
        if problem:
            print(f"--gpu needs the CUDA backend: {problem}.", file=sys.stderr)
            return 2
        result = gpu_overlap(args.gpu_batch_mib, 3 if args.quick else 7)
        print(json.dumps(result, indent=2))
        path = args.json or BENCH / "results" / f"input-{datetime.date.today().isoformat()}-gpu.json"
        path.write_text(json.dumps({"benchmark": "input_bench --gpu",
                                    "date": datetime.datetime.now().isoformat(timespec="seconds"),
                                    "prefetch_overlap": result}, indent=2) + "\n")
        print(f"wrote {path}")
        for name, ok in result["targets"].items():
            print(f"{'PASS' if ok else 'FAIL'}  {name}")
        return 0 if all(result["targets"].values()) else 1
    repeats = 3 if args.quick else 7
    counts = [int(n) for n in args.replicas.split(",")]
    dataset = ShuffledBatches()
    weights = np.random.default_rng(2).random((FEATURES, 512), dtype=np.float32)

    raw = epoch_us(dataset, repeats=repeats)
    rows = []
    for n in counts:
        strategy = distrib.MirroredStrategy([f"CPU:{i}" for i in range(n)])
        dist = strategy.experimental_distribute_dataset(dataset)
        consumed = epoch_us(dist, repeats=repeats)
        rows.append({"replicas": n, "raw_us": raw, "distributed_us": consumed,
                     "overhead": round(consumed / raw - 1, 4), "raw_steps_per_s": round(1e6 / raw),
                     "distributed_steps_per_s": round(1e6 / consumed)})

    # Prefetch: with compute between steps, a distributed step should cost about max(input, compute).
    strategy = distrib.MirroredStrategy([f"CPU:{i}" for i in range(TARGET_REPLICAS)])
    dist = strategy.experimental_distribute_dataset(dataset)
    compute_alone = epoch_us([next(iter(dataset))] * STEPS, training_step(weights, None), repeats)
    overlap = {"input_us": raw, "compute_us": compute_alone,
               "raw_plus_compute_us": epoch_us(dataset, training_step(weights, None), repeats),
               "distributed_plus_compute_us": epoch_us(dist, training_step(weights, strategy), repeats)}
    overlap["ideal_us"] = max(overlap["input_us"], overlap["compute_us"])
    overlap["hidden_fraction"] = round(
        (overlap["raw_plus_compute_us"] - overlap["distributed_plus_compute_us"]) / overlap["input_us"], 3)

    target_row = next((r for r in rows if r["replicas"] == TARGET_REPLICAS), None)
    passed = target_row is not None and target_row["overhead"] <= TARGET_OVERHEAD
    _print(rows, overlap, target_row, passed)
    path = args.json or BENCH / "results" / f"input-{datetime.date.today().isoformat()}-cpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "benchmark": "input_bench", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "numpy": np.__version__, "distrib": distrib.__version__},
        "batch": {"rows": ROWS, "features": FEATURES, "bytes": ROWS * FEATURES * 4 + ROWS * 4, "steps": STEPS},
        "consume_only": rows, "prefetch_overlap": overlap,
        "target": {"replicas": TARGET_REPLICAS, "max_overhead": TARGET_OVERHEAD, "passed": passed},
        "gpu": "not measured: the CUDA backend's host-to-device prefetch needs a GPU"}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


def _print(rows, overlap, target_row, passed) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text without rich
        Console = Table = None
    headers = ["replicas", "raw µs/step", "distributed µs/step", "overhead", "raw steps/s", "distributed steps/s"]
    cells = [[str(r["replicas"]), f"{r['raw_us']:,.1f}", f"{r['distributed_us']:,.1f}", f"{100 * r['overhead']:+.1f}%",
              f"{r['raw_steps_per_s']:,}", f"{r['distributed_steps_per_s']:,}"] for r in rows]
    title = f"Consuming 1 MiB global batches ({ROWS}x{FEATURES} float32 + labels), {STEPS} steps per epoch"
    if Table is not None:
        table = Table(title=title)
        for header in headers:
            table.add_column(header, justify="right")
        for row in cells:
            table.add_row(*row)
        Console().print(table)
    else:
        print(title)
        for row in [headers] + cells:
            print("  ".join(f"{c:>20}" for c in row))
    if target_row is not None:
        print(f"target at {TARGET_REPLICAS} replicas: overhead <= {100 * TARGET_OVERHEAD:.0f}%: "
              f"{100 * target_row['overhead']:+.1f}% {'PASS' if passed else 'FAIL'}")
    print(f"prefetch with a compute step ({TARGET_REPLICAS} replicas): input alone {overlap['input_us']:,.1f} µs, "
          f"compute alone {overlap['compute_us']:,.1f} µs, raw input + compute {overlap['raw_plus_compute_us']:,.1f} "
          f"µs, distributed + compute {overlap['distributed_plus_compute_us']:,.1f} µs (ideal max = "
          f"{overlap['ideal_us']:,.1f} µs); {100 * overlap['hidden_fraction']:.0f}% of the input time hidden")


if __name__ == "__main__":
    sys.exit(main())
