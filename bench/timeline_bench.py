"""What the collective timeline costs: per hook and per strategy.run step, with the timeline off and recording.

python3 bench/timeline_bench.py            # 4 emulated replicas; about a minute
python3 bench/timeline_bench.py --quick

The backend's timed methods are wrapped only while a timeline records (`timeline.instrument`): while it is off the
classes hold their own methods, so a backend call costs nothing more, and what a step still pays is the spans'
check that nothing records. Three measurements, all in one process on the CPU emulator:
1. Per hook: an empty `with timeline.span(...)` while off, against an empty call; and, while recording, a timed
   backend method (packing one 4-element array, which is a view) against the class's own method. The fastest of
   15 loops of 20,000 calls each, since these are tens of nanoseconds to microseconds.
2. `strategy.run` per step for three workloads (an empty merge_call, one all_reduce of 1M float32, a batched
   all_reduce of 200 x 1,000 float32) with the timeline off and recording; off, it checks that every timed method
   is the class's own.
3. Spans per step, counted from the events one recorded step leaves, times the cost of a span while off: the
   timeline's whole cost to a step while off.

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


def hook_costs(folder: str) -> dict[str, float]:
    """An empty span while off, and the cheapest timed backend method (packing one array is a view) while
    recording, each against what it adds to."""
    backend = CpuBackend()
    (buffer,) = plan_concat_split([((4,), np.dtype(np.float32))], 1).buffers
    arrays = [np.ones(4, np.float32)]
    own = CpuBackend.pack
    timeline.start(os.path.join(folder, "hooks.json"))
    try:
        wrapped = CpuBackend.pack
        assert getattr(wrapped, "timed_as", None) == "pack", "pack is not timed while recording"
        recording_ns = best_ns(lambda: wrapped(backend, arrays, buffer, "CPU:0"), number=2000)
    finally:
        timeline.stop()
    bare_ns = best_ns(lambda: own(backend, arrays, buffer, "CPU:0"))

    def with_span():
        with timeline.span("x", "y"):
            pass

    span_ns = best_ns(with_span)
    empty_ns = best_ns(lambda: None)
    return {"span_off_ns": round(span_ns - empty_ns, 1), "backend_hook_recording_ns": round(recording_ns - bare_ns, 1),
            "pack_one_array_ns": round(bare_ns, 1)}


def check_unwrapped() -> None:
    """While no timeline records, every timed backend method is the class's own: a call costs nothing more."""
    wrapped = [name for name in TIMED if hasattr(getattr(CpuBackend, name, None), "timed_as")]
    assert not wrapped, f"timed while no timeline records: {wrapped}"


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


def per_step(repeats: int, seconds: float, folder: str) -> dict[str, dict]:
    strategy = distrib.MirroredStrategy([f"CPU:{i}" for i in range(REPLICAS)])
    out = {}
    for name, step in workloads(strategy).items():
        check_unwrapped()
        row = {"off_us": per_step_us(step, repeats, seconds)}
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
        row["spans_per_step"] = sum(e["ph"] == "X" and e["cat"] in ("run", "merge_call") for e in events)
        row["backend_hooks_per_step"] = len(backend_events)
        out[name] = row
    check_unwrapped()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats of ~0.05 s instead of 7 of ~0.2 s")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    repeats, seconds = (3, 0.05) if args.quick else (7, 0.2)
    with tempfile.TemporaryDirectory() as folder:
        hooks = hook_costs(folder)
        steps = per_step(repeats, seconds, folder)
    print(f"# timeline off: backend methods unwrapped (0 ns), an empty span {hooks['span_off_ns']:.0f} ns; "
          f"recording: a backend hook {hooks['backend_hook_recording_ns']:.0f} ns ({os.cpu_count()} cores, {REPLICAS} emulated "
          f"replicas)")
    print(f"{'workload':<18s} {'off us':>9s} {'recording us':>13s} {'spans':>6s} {'backend hooks':>14s} "
          f"{'off cost':>10s}")
    for name, row in steps.items():
        estimate = row["spans_per_step"] * hooks["span_off_ns"] / 1e3
        row["estimated_off_cost_us"] = round(estimate, 3)
        print(f"{name:<18s} {row['off_us']:9.1f} {row['recording_us']:13.1f} {row['spans_per_step']:6d} "
              f"{row['backend_hooks_per_step']:14d} {estimate:7.2f} us ({estimate / row['off_us']:.2%})")
    date = datetime.date.today().isoformat()
    path = args.json or BENCH / "results" / f"timeline-{date}-cpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"date": date, "device": f"CPU emulator, {REPLICAS} replicas", "cpus": os.cpu_count(),
                                "platform": platform.platform(), "hooks": hooks, "per_step": steps}, indent=1) + "\n")
    print(f"# results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
