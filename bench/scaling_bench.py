"""Per-item cost of an Adam step and of a replica-context all_reduce as variables, leaves and replicas grow."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # benchmark the checkout this file belongs to, installed or not

import distrib  # noqa: E402
from distrib.backends.parallel import usable_cores  # noqa: E402
from distrib.cli.bench.runners import sum_in_order  # noqa: E402
from measure import per_step_us  # noqa: E402
from strategy_bench import checkout_revision, fmt_ratio, fmt_us, machine_info, parse_replicas, show  # noqa: E402

APIS = ("adam_step", "all_reduce_list")
ELEMENTS = 64  # float32 elements per variable or leaf: small, so per-item overhead is what is measured
LINEAR_LIMIT = 1.5  # per-item cost at the largest size may be at most this times that at the smallest
LR, BETA_1, BETA_2, EPSILON = 0.001, 0.9, 0.999, 1e-7


def per_replica_arrays(strategy, count: int) -> distrib.PerReplica:
    """A list of `count` float32 arrays per replica, replica k's all equal to k + 1 (distinct per replica)."""
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: [np.full(ELEMENTS, ctx.replica_id_in_sync_group + 1, np.float32) for _ in range(count)])


def adam_case(strategy, count: int):
    """distrib's Adam step over `count` variables and the NumPy floor doing the same update on as many copies."""
    replicas = strategy.num_replicas_in_sync
    with strategy.scope():
        variables = [distrib.Variable(np.zeros(ELEMENTS, np.float32)) for _ in range(count)]
        optimizer = distrib.optimizers.Adam(LR, BETA_1, BETA_2, EPSILON)
    grads = per_replica_arrays(strategy, count)

    def step(grads):
        optimizer.apply_gradients(zip(grads, variables))

    parts = [list(column) for column in zip(*strategy.experimental_local_results(grads))]  # per variable
    mean = [np.empty(ELEMENTS, np.float32) for _ in range(count)]
    floor_state = [[(np.zeros(ELEMENTS, np.float32), np.zeros(ELEMENTS, np.float32), np.zeros(ELEMENTS, np.float32))
                    for _ in range(replicas)] for _ in range(count)]  # per variable, per copy: (w, m, v)
    steps = [0]

    def floor():
        """The MEAN of each gradient over replicas (in-order sums), then Keras's Adam update of every copy."""
        steps[0] += 1
        one, t = np.float32(1), np.float32(steps[0])
        lr_t = np.float32(LR) * np.sqrt(one - np.float32(BETA_2) ** t) / (one - np.float32(BETA_1) ** t)
        c1, c2, eps = np.float32(1 - BETA_1), np.float32(1 - BETA_2), np.float32(EPSILON)
        for grad_parts, g, copies in zip(parts, mean, floor_state):
            sum_in_order(g, grad_parts)
            g /= np.float32(replicas)
            for w, m, v in copies:
                m += (g - m) * c1
                v += (np.square(g) - v) * c2
                w -= m * lr_t / (np.sqrt(v) + eps)

    def check():
        for _ in range(3):
            strategy.run(step, args=(grads,))
            floor()
        for var, copies in zip(variables, floor_state):
            for copy, (w, _, _) in zip(strategy.experimental_local_results(var), copies):
                if not np.allclose(copy.numpy(), w, rtol=1e-5, atol=1e-7):
                    raise SystemExit(f"distrib's Adam step gave {copy.numpy()[:3]}, the floor {w[:3]}.")

    return (lambda: strategy.run(step, args=(grads,))), floor, check


def all_reduce_case(strategy, count: int):
    """A replica-context all_reduce(SUM) of a list of `count` arrays, and the floor: in-order sums of each."""
    replicas = strategy.num_replicas_in_sync
    values = per_replica_arrays(strategy, count)

    def step(xs):
        return distrib.get_replica_context().all_reduce("SUM", xs)

    parts = [list(column) for column in zip(*strategy.experimental_local_results(values))]
    outs = [np.empty(ELEMENTS, np.float32) for _ in range(count)]

    def floor():
        for leaf_parts, out in zip(parts, outs):
            sum_in_order(out, leaf_parts)

    def check():
        expected = replicas * (replicas + 1) / 2
        for result in strategy.experimental_local_results(strategy.run(step, args=(values,))):
            if len(result) != count or not all(np.all(array == expected) for array in result):
                raise SystemExit(f"distrib's all-reduce did not give {expected} everywhere.")

    return (lambda: strategy.run(step, args=(values,))), floor, check


CASES = {"adam_step": adam_case, "all_reduce_list": all_reduce_case}


def measure(api: str, replicas: int, count: int, repeats: int, min_seconds: float) -> dict:
    strategy = distrib.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    try:
        run, floor, check = CASES[api](strategy, count)
        check()
        distrib_us = per_step_us(run, repeats, min_seconds)
        floor_us = per_step_us(floor, repeats, min_seconds)
    finally:
        strategy.close()
    return {"api": api, "replicas": replicas, "items": count, "distrib_us": distrib_us, "floor_us": floor_us,
            "us_per_item_replica": round(distrib_us / (count * replicas), 3),
            "floor_us_per_item_replica": round(floor_us / (count * replicas), 3),
            "ratio": round(distrib_us / floor_us, 3)}


def evaluate_targets(rows: list[dict], sizes: list[int]) -> list[dict]:
    """Per API and replica count: per-item cost at the largest size within LINEAR_LIMIT x that at the smallest."""
    targets = []
    by_key = {(r["api"], r["replicas"], r["items"]): r for r in rows}
    for api in APIS:
        for replicas in sorted({r["replicas"] for r in rows}):
            small, large = by_key[(api, replicas, sizes[0])], by_key[(api, replicas, sizes[-1])]
            growth = round(large["us_per_item_replica"] / small["us_per_item_replica"], 3)
            targets.append({"api": api, "replicas": replicas, "sizes": [sizes[0], sizes[-1]], "growth": growth,
                            "limit": LINEAR_LIMIT, "passed": growth <= LINEAR_LIMIT})
    return targets


def table(title: str, header: list[str], rows: list[list[str]], caption: str) -> None:
    """A rich table on a terminal; aligned plain text when piped or redirected (logs, CI)."""
    show(title, header, rows, caption, plain=not sys.stdout.isatty())


def report(rows: list[dict], targets: list[dict], cores: int, load: float) -> None:
    table(f"Per-step cost as items and replicas grow (CPU emulator, {cores} cores, load {load} at start)",
          ["api", "replicas", "items", "distrib µs", "µs/item/replica", "floor µs", "floor µs/item/replica",
           "ratio"],
          [[r["api"], str(r["replicas"]), f"{r['items']:,}", fmt_us(r["distrib_us"]),
            f"{r['us_per_item_replica']:.2f}", fmt_us(r["floor_us"]), f"{r['floor_us_per_item_replica']:.3f}",
            fmt_ratio(r["ratio"])] for r in rows],
          "items = variables (adam_step) or leaves (all_reduce_list), each 64 float32; ratio = distrib / floor.")
    table(f"Target: per-item cost at the largest size within {LINEAR_LIMIT}x that at the smallest (linear)",
          ["api", "replicas", "sizes", "growth", "result"],
          [[t["api"], str(t["replicas"]), f"{t['sizes'][0]:,} -> {t['sizes'][1]:,}", fmt_ratio(t["growth"]),
            "PASS" if t["passed"] else "FAIL"] for t in targets],
          "growth = (µs per item per replica at the largest size) / (the same at the smallest).")


def main() -> None:
    today = datetime.date.today().isoformat()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=parse_replicas, default=[1, 2, 4], help="comma-separated counts")
    parser.add_argument("--sizes", type=parse_replicas, default=[10, 100, 1000],
                        help="comma-separated numbers of variables / leaves")
    parser.add_argument("--quick", action="store_true", help="3 short repeats instead of 7 of ~0.2 s")
    parser.add_argument("--json", type=Path, default=BENCH / "results" / f"scaling-{today}-cpu.json")
    args = parser.parse_args()
    sizes = sorted(args.sizes)
    repeats, min_seconds = (3, 0.05) if args.quick else (7, 0.2)
    cores = usable_cores()
    load_at_start = round(os.getloadavg()[0], 2)
    if load_at_start > 0.5:  # on a machine with few cores other work inflates every number below
        print(f"warning: load average {load_at_start} at start; timings may be inflated.", file=sys.stderr)

    rows = []
    for api in APIS:
        for replicas in args.replicas:
            for count in sizes:
                print(f"measuring {api} at {replicas} replica(s), {count} items...", file=sys.stderr)
                rows.append(measure(api, replicas, count, repeats, min_seconds))
    targets = evaluate_targets(rows, sizes)
    report(rows, targets, cores, load_at_start)

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "date": today, "machine": {**machine_info(load_at_start), "load_average_1m_at_end":
                                   round(os.getloadavg()[0], 2)},
        "backend": "cpu", "distrib": {"version": distrib.__version__, "revision": checkout_revision()},
        "settings": {"repeats": repeats, "min_seconds_per_repeat": min_seconds, "statistic": "median",
                     "elements_per_item": ELEMENTS, "dtype": "float32", "sizes": sizes, "replicas": args.replicas,
                     "ratio": "distrib_us / floor_us",
                     "floors": {"adam_step": "per variable: in-order sum of the replicas' gradients / n, then "
                                             "Keras's Adam update of each of the n copies, NumPy in a Python loop",
                                "all_reduce_list": "per leaf: in-order sum of the replicas' arrays into a "
                                                   "preallocated output (a copy for n = 1)"}},
        "results": rows, "targets": targets,
    }, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
