"""Per-step time of MirroredStrategy.run on the CPU emulator, beside the NumPy floor and TensorFlow's peer."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # benchmark the checkout this file belongs to, installed or not

import distrib  # noqa: E402
from distrib.backends.parallel import usable_cores  # noqa: E402
from distrib.cli.bench.runners import sum_in_order  # noqa: E402
from measure import (BATCH_COUNT, BATCH_ELEMENTS, VECTOR_ELEMENTS, WORKLOADS,  # noqa: E402
                     interleaved_per_step_us, per_step_us)
from nested import NESTED_LEAVES, NESTED_WORKLOADS, measure_nested  # noqa: E402

TARGET_REPLICAS = 4
SCALING_WORKLOAD = "allreduce_1m"
EXECUTIONS = ("threads", "cooperative")  # MirroredStrategy(replica_execution=...): the default first


def targets_for(cores: int) -> list[tuple[str, str, float]]:
    """(workload, measure, limit) at TARGET_REPLICAS: "ratio" (distrib / floor) and "us" at most the limit;
    "x_eager" and "x_function" (TensorFlow's time / distrib's) at least the limit."""
    return [("allreduce_1m", "ratio", 0.6 if cores >= 4 else 1.0), ("allreduce_1m", "x_eager", 5.0),
            ("allreduce_1m", "x_function", 2.0), ("batch_200x1000", "ratio", 3.0),
            ("batch_200x1000", "x_function", 20.0), ("empty_merge_call", "us", 100.0)]


def distrib_us(row: dict, execution: str) -> float:
    return row["distrib_us" if execution == "threads" else "cooperative_us"]


def all_reduce_step(x):
    return distrib.get_replica_context().all_reduce("SUM", x)


def merge_call_step():
    distrib.get_replica_context().merge_call(lambda strategy: None)


def sum_into(parts: list[np.ndarray], outs: list[np.ndarray], copy_out: bool) -> None:
    """The floor of one all-reduce: n-1 in-place adds into outs[0] (a copy for n=1), then optionally the copies."""
    total = sum_in_order(outs[0], parts)
    if copy_out:
        for out in outs[1:]:
            np.copyto(out, total)


def check_sums(strategy: distrib.MirroredStrategy, result) -> None:
    """Every replica must get 1 + 2 + ... + n, or the timings measure the wrong thing."""
    replicas = strategy.num_replicas_in_sync
    expected = replicas * (replicas + 1) / 2
    for value in strategy.experimental_local_results(result):
        for array in value if isinstance(value, list) else [value]:
            if not np.all(array == expected):
                raise SystemExit(f"distrib's all-reduce gave {array}, expected {expected} everywhere.")


def measure_replicas(replicas: int, repeats: int, min_seconds: float) -> dict[str, dict]:
    """Both replica executions and both floors for every workload at one replica count, on the same inputs:
    {workload: {"distrib_us", "ratio" (threads), "cooperative_us", "cooperative_ratio", "floor_us", ...}}."""
    threads, floors = workload_steps(replicas, "threads")
    cooperative, _ = workload_steps(replicas, "cooperative")
    rows = {}
    for name in WORKLOADS:  # the four timed in turn, so that a slow stretch of the machine hits them alike
        steps = {"distrib_us": threads[name], "cooperative_us": cooperative[name]}
        if floors[name] is not None:
            steps.update(floor_us=partial(floors[name], False), floor_copies_us=partial(floors[name], True))
        row = {"floor_us": None, "floor_copies_us": None, **interleaved_per_step_us(steps, repeats, min_seconds)}
        for key, us in (("ratio", "distrib_us"), ("cooperative_ratio", "cooperative_us")):
            row[key] = None if row["floor_us"] is None else round(row[us] / row["floor_us"], 3)
        rows[name] = row
    return rows


def workload_steps(replicas: int, execution: str) -> tuple[dict, dict]:
    """({workload: one step of distrib}, {workload: its floor(copy_out), or None}) on a strategy of `replicas`
    replicas run with `execution`, its results checked."""
    strategy = distrib.MirroredStrategy([f"CPU:{i}" for i in range(replicas)], replica_execution=execution)
    vector = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(VECTOR_ELEMENTS, ctx.replica_id_in_sync_group + 1, np.float32))
    batch = strategy.experimental_distribute_values_from_function(
        lambda ctx: [np.full(BATCH_ELEMENTS, ctx.replica_id_in_sync_group + 1, np.float32)
                     for _ in range(BATCH_COUNT)])
    check_sums(strategy, strategy.run(all_reduce_step, args=(vector,)))
    check_sums(strategy, strategy.run(all_reduce_step, args=(batch,)))

    vector_parts = list(strategy.experimental_local_results(vector))
    vector_outs = [np.empty(VECTOR_ELEMENTS, np.float32) for _ in range(replicas)]
    batch_parts = [list(column) for column in zip(*strategy.experimental_local_results(batch))]
    batch_outs = [[np.empty(BATCH_ELEMENTS, np.float32) for _ in range(replicas)] for _ in range(BATCH_COUNT)]

    def vector_floor(copy_out: bool) -> None:
        sum_into(vector_parts, vector_outs, copy_out)

    def batch_floor(copy_out: bool) -> None:
        for parts, outs in zip(batch_parts, batch_outs):
            sum_into(parts, outs, copy_out)

    steps = {"allreduce_1m": partial(strategy.run, all_reduce_step, args=(vector,)),
             "batch_200x1000": partial(strategy.run, all_reduce_step, args=(batch,)),
             "empty_merge_call": partial(strategy.run, merge_call_step)}
    return steps, {"allreduce_1m": vector_floor, "batch_200x1000": batch_floor, "empty_merge_call": None}


def run_tf_peer(tf_python: str, repeats: int, min_seconds: float) -> dict:
    """tf_peer.py's JSON, or {"note": why not} when TensorFlow could not be run."""
    command = [tf_python, str(BENCH / "tf_peer.py"), "--repeats", str(repeats), "--min-seconds", str(min_seconds)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"note": f"{' '.join(command)} failed: {exc}"}
    if done.returncode != 0:
        return {"note": f"{' '.join(command)} exited with {done.returncode}: {done.stderr.strip()[-2000:]}"}
    return json.loads(done.stdout)


def evaluate_targets(results: dict, tf: dict, cores: int) -> list[dict]:
    """Every target, for each replica execution."""
    at_target = results.get(TARGET_REPLICAS, {})
    targets = []
    for name, measure, limit in targets_for(cores):
        for execution in EXECUTIONS:
            row = at_target.get(name)
            value = None
            if row is not None and measure == "ratio":
                value = row["ratio" if execution == "threads" else "cooperative_ratio"]
            elif row is not None and measure == "us":
                value = distrib_us(row, execution)
            elif row is not None and "note" not in tf:
                tf_us = tf["eager_us" if measure == "x_eager" else "function_us"][name]
                value = round(tf_us / distrib_us(row, execution), 2)
            at_most = measure in ("ratio", "us")
            passed = None if value is None else value <= limit if at_most else value >= limit
            targets.append({"workload": name, "execution": execution, "replicas": TARGET_REPLICAS, "cores": cores,
                            "measure": measure, "limit": limit, "value": value, "passed": passed})
    return targets


def compare_with_tf(results: dict, tf: dict) -> list[dict]:
    at_target = results.get(TARGET_REPLICAS)
    if at_target is None or "note" in tf:
        return []
    return [{"workload": name, "execution": execution, "mode": mode,
             "distrib_us": distrib_us(at_target[name], execution), "tf_us": tf[key][name],
             "distrib_faster": distrib_us(at_target[name], execution) < tf[key][name]}
            for name in WORKLOADS for execution in EXECUTIONS
            for mode, key in (("eager", "eager_us"), ("tf.function", "function_us"))]


def machine_info(load_at_start: float) -> dict:
    return {"platform": platform.platform(), "cpu_count": os.cpu_count(), "usable_cores": usable_cores(),
            "python": platform.python_version(),
            "numpy": np.__version__, "load_average_1m_at_start": load_at_start}


def checkout_revision() -> str | None:
    """`git describe --always --dirty` of the benchmarked checkout: numbers are only comparable per revision."""
    try:
        return subprocess.run(["git", "-C", str(BENCH.parent), "describe", "--always", "--dirty"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def show(title: str, header: list[str], rows: list[list[str]], caption: str = "", plain: bool = False) -> None:
    """A table through rich when it is installed, else (or with `plain`) aligned plain text."""
    if not plain:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            plain = True
    if plain:
        widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
        print(f"\n{title}")
        for line in [header] + rows:
            print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))
        if caption:
            print(caption)
        return
    table = Table(*header, title=title, caption=caption, caption_justify="left")
    for row in rows:
        table.add_row(*row)
    console = Console()
    console.width = max(console.width, 120)  # piped output defaults to 80 columns, which would cut the numbers
    console.print(table)


def fmt_us(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def target_row(target: dict) -> list[str]:
    limit, value, measure = target["limit"], target["value"], target["measure"]
    if measure == "ratio":
        goal, measured = f"ratio <= {limit:g}x", fmt_ratio(value)
    elif measure == "us":
        goal, measured = f"<= {limit:g} µs", fmt_us(value)
    else:
        mode = "eager" if measure == "x_eager" else "tf.function"
        goal, measured = f">= {limit:g}x faster than TF {mode}", fmt_ratio(value)
    result = "-" if target["passed"] is None else "PASS" if target["passed"] else "FAIL"
    return [target["workload"], target["execution"], str(target["cores"]), goal, measured, result]


def report(results: dict, tf: dict, targets: list[dict], versus_tf: list[dict], scaling: list[dict],
           cores: int) -> None:
    tf_columns = "note" not in tf
    header = ["workload", "replicas", "cores", "threads µs", "cooperative µs", "floor µs", "floor+copies µs",
              "ratio", "cooperative ratio"]
    header += ["TF eager µs", "TF tf.function µs"] if tf_columns else []
    rows = []
    for name in WORKLOADS:
        for replicas, by_workload in results.items():
            row = by_workload[name]
            line = [name, str(replicas), str(cores), fmt_us(row["distrib_us"]), fmt_us(row["cooperative_us"]),
                    fmt_us(row["floor_us"]), fmt_us(row["floor_copies_us"]), fmt_ratio(row["ratio"]),
                    fmt_ratio(row["cooperative_ratio"])]
            if tf_columns:
                at_peer = replicas == tf["replicas"]
                line += [fmt_us(tf["eager_us"][name] if at_peer else None),
                         fmt_us(tf["function_us"][name] if at_peer else None)]
            rows.append(line)
    show("strategy.run, µs per step (median)", header, rows,
         "threads: MirroredStrategy's default, a thread per replica; cooperative: replica_execution="
         "\"cooperative\", every replica a greenlet on the calling thread. ratio = distrib / floor (plain sums: "
         "n-1 in-place np.add, no copies); floor+copies also copies the sum into the other n-1 replicas' outputs.")
    if not tf_columns:
        print(f"TensorFlow columns skipped: {tf['note']}")

    if scaling:
        one = scaling[0]["distrib_us"]
        show(f"{SCALING_WORKLOAD} at {TARGET_REPLICAS} replicas on 1 to {cores} cores (CPU affinity)",
             ["cores", "distrib µs", "floor µs", "ratio", "speed-up over 1 core"],
             [[str(r["cores"]), fmt_us(r["distrib_us"]), fmt_us(r["floor_us"]), fmt_ratio(r["ratio"]),
               fmt_ratio(one / r["distrib_us"])] for r in scaling],
             "floor = the single-threaded plain sums, measured under the same affinity.")
    show(f"Targets at {TARGET_REPLICAS} replicas", ["workload", "execution", "cores", "target", "measured", "result"],
         [target_row(t) for t in targets])
    if versus_tf:
        show(f"distrib vs TensorFlow {tf['tensorflow']} at {TARGET_REPLICAS} replicas, {cores} cores",
             ["workload", "execution", "TF mode", "distrib µs", "TF µs", "distrib faster"],
             [[c["workload"], c["execution"], c["mode"], fmt_us(c["distrib_us"]), fmt_us(c["tf_us"]),
               f"yes ({c['tf_us'] / c['distrib_us']:.2f}x)" if c["distrib_faster"]
               else f"no ({c['distrib_us'] / c['tf_us']:.2f}x slower)"] for c in versus_tf])
        for execution in EXECUTIONS:
            verdict = "yes" if all(c["distrib_faster"] for c in versus_tf if c["execution"] == execution) else "no"
            print(f"distrib ({execution}) faster than TensorFlow on every workload, eager and tf.function: {verdict}")
    elif tf_columns:
        print(f"No comparison with TensorFlow: it runs on {tf['replicas']} replicas, which --replicas leaves out.")


def report_nested(nested: dict, cores: int) -> None:
    show(f"nested structures of {NESTED_LEAVES} leaves (float32, float16, int32), µs per call (median)",
         ["workload", "replicas", "cores", "distrib µs", "µs per leaf"],
         [[name, str(replicas), str(cores), fmt_us(rows[name]["distrib_us"]), fmt_us(rows[name]["us_per_leaf"])]
          for name in NESTED_WORKLOADS for replicas, rows in nested.items()],
         "all_gather_50: strategy.run of a step that all_gathers the 50 leaves (lengths along axis 0 differ by "
         "replica); reduce_50: strategy.reduce(SUM, axis=None); reduce_mean_axis0_50: strategy.reduce(MEAN, axis=0).")


def scaling_core_counts(cores: int) -> list[int]:
    """1, 2, 4, ... below `cores`, then `cores` itself."""
    counts = [1]
    while counts[-1] * 2 < cores:
        counts.append(counts[-1] * 2)
    return counts + ([cores] if cores > 1 else [])


def measure_scaling(cores: int, quick: bool) -> list[dict]:
    """SCALING_WORKLOAD at TARGET_REPLICAS in a fresh process pinned to 1, 2, 4, ... cores, with its floor."""
    if not hasattr(os, "sched_setaffinity"):
        return []
    allowed = sorted(os.sched_getaffinity(0))
    rows = []
    for count in scaling_core_counts(cores):
        command = [sys.executable, str(Path(__file__).resolve()), "--scaling-child"] + (["--quick"] if quick else [])
        done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                              preexec_fn=lambda count=count: os.sched_setaffinity(0, allowed[:count]))
        if done.returncode != 0:
            raise SystemExit(f"the {count}-core scaling run failed: {done.stderr.strip()[-2000:]}")
        row = json.loads(done.stdout)
        rows.append({"cores": count, **row, "ratio": round(row["distrib_us"] / row["floor_us"], 3)})
    return rows


def scaling_child(quick: bool) -> None:
    """Prints SCALING_WORKLOAD's distrib and floor µs at TARGET_REPLICAS as JSON (run under a CPU affinity)."""
    repeats, min_seconds = (3, 0.05) if quick else (7, 0.2)
    strategy = distrib.MirroredStrategy([f"CPU:{i}" for i in range(TARGET_REPLICAS)])
    vector = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(VECTOR_ELEMENTS, ctx.replica_id_in_sync_group + 1, np.float32))
    check_sums(strategy, strategy.run(all_reduce_step, args=(vector,)))
    parts = list(strategy.experimental_local_results(vector))
    outs = [np.empty(VECTOR_ELEMENTS, np.float32) for _ in parts]
    print(json.dumps({"distrib_us": per_step_us(partial(strategy.run, all_reduce_step, args=(vector,)), repeats,
                                                min_seconds),
                      "floor_us": per_step_us(partial(sum_into, parts, outs, False), repeats, min_seconds)}))


def parse_replicas(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",")]
    if any(count < 1 for count in counts):
        raise argparse.ArgumentTypeError(f"replica counts must be positive. Received: {text!r}.")
    return counts


def main() -> None:
    today = datetime.date.today().isoformat()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=parse_replicas, default=[1, 2, 4, 8], help="comma-separated counts")
    parser.add_argument("--quick", action="store_true", help="3 short repeats instead of 7 of ~0.2 s")
    parser.add_argument("--json", type=Path, default=BENCH / "results" / f"strategy-{today}-cpu.json")
    parser.add_argument("--tf-python", help="python of a TensorFlow environment, to run tf_peer.py under")
    parser.add_argument("--no-scaling", action="store_true", help="skip the 1-to-all-cores runs")
    parser.add_argument("--nested-only", action="store_true", help="only the nested workloads (all_gather and "
                        "reduce of 50 leaves); writes no JSON")
    parser.add_argument("--scaling-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scaling_child:
        scaling_child(args.quick)
        return
    cores = usable_cores()
    repeats, min_seconds = (3, 0.05) if args.quick else (7, 0.2)
    load_at_start = round(os.getloadavg()[0], 2)
    if load_at_start > 0.5:  # on a machine with few cores other work inflates every number below
        print(f"warning: load average {load_at_start} at start; timings may be inflated.", file=sys.stderr)
    nested = {replicas: measure_nested(replicas, repeats, min_seconds) for replicas in args.replicas}
    report_nested(nested, cores)
    if args.nested_only:
        return

    results = {}
    for replicas in args.replicas:
        print(f"measuring {replicas} replica(s)...", file=sys.stderr)
        results[replicas] = measure_replicas(replicas, repeats, min_seconds)
    if args.tf_python is None:
        tf = {"note": "no --tf-python given."}
    else:
        print(f"measuring TensorFlow's MirroredStrategy under {args.tf_python}...", file=sys.stderr)
        tf = run_tf_peer(args.tf_python, repeats, min_seconds)
    scaling = []
    if not args.no_scaling:
        print(f"measuring {SCALING_WORKLOAD} on 1 to {cores} cores...", file=sys.stderr)
        scaling = measure_scaling(cores, args.quick)
    targets = evaluate_targets(results, tf, cores)
    versus_tf = compare_with_tf(results, tf)
    report(results, tf, targets, versus_tf, scaling, cores)

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "date": today, "machine": machine_info(load_at_start), "backend": "cpu",
        "distrib": {"version": distrib.__version__, "revision": checkout_revision()},
        "settings": {"repeats": repeats, "min_seconds_per_repeat": min_seconds, "statistic": "median",
                     "vector_elements": VECTOR_ELEMENTS, "batch_count": BATCH_COUNT, "batch_elements": BATCH_ELEMENTS,
                     "ratio": "distrib_us / floor_us (plain sums, no copies)",
                     "executions": {"distrib_us": "replica_execution='threads' (the default)",
                                    "cooperative_us": "replica_execution='cooperative'"}},
        "results": [{"workload": name, "replicas": replicas, "cores": cores, **rows[name]}
                    for name in WORKLOADS for replicas, rows in results.items()],
        "nested": [{"workload": name, "replicas": replicas, "cores": cores, "leaves": NESTED_LEAVES, **rows[name]}
                   for name in NESTED_WORKLOADS for replicas, rows in nested.items()],
        "scaling": scaling, "targets": targets, "tensorflow": tf, "versus_tensorflow": versus_tf,
    }, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
