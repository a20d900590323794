"""What the collective timeline costs: per hook while off, and per strategy.run step off, stripped and on.

python3 bench/timeline_bench.py            # 4 emulated replicas; about a minute
python3 bench/timeline_bench.py --quick

Three measurements, all in one process on the CPU emulator:
1. One hook while no timeline records: a timed backend method against the same method unwrapped
   (`method.__wrapped__`): packing one 4-element array, which is a view, and an empty `with timeline.span(...)`
   against an empty call;
   the fastest of 15 loops of 20,000 calls each, since these are tens of nanoseconds.
2. `strategy.run` per step for three workloads (an empty merge_call, one all_reduce of 1M float32, a batched
   all_reduce of 200 x 1,000 float32) with the timeline off, with the backend's hooks stripped (the methods
   replaced by their unwrapped originals: the baseline of "no hooks"), and recording.
3. Hooks per step, counted from the events one recorded step leaves, times the per-hook cost of 1.

Writes bench/results/timeline-<date>-cpu.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import timeit
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

import distrib  # noqa: E402
from distrib import timeline  # noqa: E402
from distrib.backends.base import TIMED  # noqa: E402
from distrib.backends.cpu import CpuBackend  # noqa: E402
from distrib.plan import plan_concat_split  # noqa: E402
from measure import BATCH_COUNT, BATCH_ELEMENTS, VECTOR_ELEMENTS, per_step_us  # noqa: E402

REPLICAS = 4


def best_ns(statement, number: int = 20000, repeats: int = 15) -> float:
    """Nanoseconds per call: the fastest of `repeats` loops (the least disturbed by other work on the machine)."""
    return min(timeit.repeat(statement, number=number, repeat=repeats)) / number * 1e9


def hook_costs() -> dict[str, float]:
    """The cheapest timed backend method (packing one array is a view) with and without its hook, and a span."""
    backend = CpuBackend()
    (buffer,) = plan_concat_split([((4,), np.dtype(np.float32))], 1).buffers
    arrays = [np.ones(4, np.float32)]
    wrapped, original = CpuBackend.pack, CpuBackend.pack.__wrapped__
    timed_ns = best_ns(lambda: wrapped(backend, arrays, buffer, "CPU:0"))
    bare_ns = best_ns(lambda: original(backend, arrays, buffer, "CPU:0"))

    def with_span():
        with timeline.span("x", "y"):
            pass

    span_ns = best_ns(with_span)
    empty_ns = best_ns(lambda: None)
    return {"backend_hook_ns": round(timed_ns - bare_ns, 1), "span_ns": round(span_ns - empty_ns, 1),
            "pack_one_array_ns": round(bare_ns, 1)}


def workloads(strategy):
    def all_reduce(x):
        return distrib.get_replica_context().all_reduce("SUM", x)

    vector = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(VECTOR_ELEMENTS, np.float32))
    batch = strategy.experimental_distribute_values_from_function(
        lambda ctx: [np.ones(BATCH_ELEMENTS, np.float32) for _ in range(BATCH_COUNT)])
    return {"empty_merge_call": lambda: strategy.run(
                lambda: distrib.get_replica_context().merge_call(lambda s: None)),
            "allreduce_1m": lambda: strategy.run(all_reduce, args=(vector,)),
            "batch_200x1000": lambda: strategy.run(all_reduce, args=(batch,))}


def stripped():
    """The backend's timed methods replaced by their originals for the duration (the no-hook baseline)."""
    saved = {name: getattr(CpuBackend, name) for name in TIMED}
    for name, method in saved.items():
        setattr(CpuBackend, name, method.__wrapped__)
    return saved


def per_step(repeats: int, seconds: float) -> dict[str, dict]:
    strategy = distrib.MirroredStrategy([f"CPU:{i}" for i in range(REPLICAS)])
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, step in workloads(strategy).items():
            row = {"off_us": per_step_us(step, repeats, seconds)}
            saved = stripped()
            try:
                row["hooks_stripped_us"] = per_step_us(step, repeats, seconds)
            finally:
                for method_name, method in saved.items():
                    setattr(CpuBackend, method_name, method)
            timeline.start(os.path.join(folder, "t.json"))
            try:
                row["recording_us"] = per_step_us(step, repeats, seconds)
            finally:
                timeline.stop()
            timeline.start(os.path.join(folder, "one.json"))
            step()
            events = json.loads(Path(timeline.stop()).read_text())["traceEvents"]
            backend_events = {(e["name"], e["ts"]) for e in events if e["ph"] == "X" and e["cat"] in
                              ("collective", "pack", "plan")}  # one hook call records one event per device
            row["span_hooks_per_step"] = sum(e["ph"] == "X" and e["cat"] in ("run", "merge_call") for e in events)
            row["backend_hooks_per_step"] = len(backend_events)
            out[name] = row
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats of ~0.05 s instead of 7 of ~0.2 s")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    repeats, seconds = (3, 0.05) if args.quick else (7, 0.2)
    hooks = hook_costs()
    steps = per_step(repeats, seconds)
    print(f"# timeline off: a backend hook costs {hooks['backend_hook_ns']:.0f} ns, an empty span "
          f"{hooks['span_ns']:.0f} ns ({os.cpu_count()} cores, {REPLICAS} emulated replicas)")
    print(f"{'workload':<18s} {'off us':>9s} {'stripped us':>12s} {'recording us':>13s} {'hooks':>6s} "
          f"{'est. off cost':>14s}")
    for name, row in steps.items():
        estimate = (row["backend_hooks_per_step"] * hooks["backend_hook_ns"]
                    + row["span_hooks_per_step"] * hooks["span_ns"]) / 1e3
        row["estimated_off_cost_us"] = round(estimate, 2)
        print(f"{name:<18s} {row['off_us']:9.1f} {row['hooks_stripped_us']:12.1f} {row['recording_us']:13.1f} "
              f"{row['backend_hooks_per_step'] + row['span_hooks_per_step']:6d} {estimate:10.2f} us "
              f"({estimate / row['off_us']:.2%})")
    date = datetime.date.today().isoformat()
    path = args.json or BENCH / "results" / f"timeline-{date}-cpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"date": date, "device": f"CPU emulator, {REPLICAS} replicas", "cpus": os.cpu_count(),
                                "platform": platform.platform(), "hooks": hooks, "per_step": steps}, indent=1) + "\n")
    print(f"# results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
