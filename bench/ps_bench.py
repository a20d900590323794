"""Rows/s of embedding lookups and sparse updates on a table sharded over 2 parameter servers vs one process's NumPy."""

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
from distrib.cluster_resolver import RayClusterResolver  # noqa: E402
from distrib.coordinator import ClusterCoordinator  # noqa: E402
from distrib.experimental.partitioners import FixedShardsPartitioner  # noqa: E402

ROWS, DIM = 200_000, 64  # the table: 200,000 x 64 float32 = 51 MB
BATCH = 4096  # row ids per lookup or update (uniform, repeats allowed)
OPS_PER_CLOSURE, CLOSURES = 8, 48  # one round through the coordinator: 48 closures of 8 operations each
NUM_PS = 2


def _median_rate(run, rows_per_call: int, repeats: int) -> float:
    """Rows per second: `rows_per_call` over the median wall time of `repeats` calls (after one warm-up call)."""
    run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return round(rows_per_call / statistics.median(samples))


def one_process(repeats: int) -> dict:
    """The same table as one NumPy array in this process: fancy-index reads, `np.subtract.at` updates."""
    table = np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32)
    rng = np.random.default_rng(1)
    ids = [rng.integers(0, ROWS, BATCH) for _ in range(OPS_PER_CLOSURE)]
    updates = np.full((BATCH, DIM), 1e-3, np.float32)
    rows = OPS_PER_CLOSURE * BATCH
    return {"lookup_rows_per_s": _median_rate(lambda: [table[i] for i in ids], rows, repeats),
            "update_rows_per_s": _median_rate(lambda: [np.subtract.at(table, i, updates) for i in ids], rows,
                                              repeats)}


class BareShard:
    """The floor: a Ray actor holding half the table as a NumPy array, with no distrib in between."""

    def __init__(self, rows: int):
        self.table = np.random.default_rng(0).standard_normal((rows, DIM)).astype(np.float32)

    def rows(self, ids):
        return self.table[ids]

    def sub(self, ids, updates):
        np.subtract.at(self.table, ids, updates)


def bare_ray(repeats: int) -> dict:
    """The same calls the coordinator makes, on NUM_PS bare Ray actors: each half's ids to its actor, both at once."""
    import ray

    half = ROWS // NUM_PS
    actors = [ray.remote(BareShard).options(num_cpus=0).remote(half) for _ in range(NUM_PS)]
    rng = np.random.default_rng(1)
    ids = [rng.integers(0, ROWS, BATCH) for _ in range(OPS_PER_CLOSURE)]
    updates = np.full((BATCH, DIM), 1e-3, np.float32)

    def lookups():
        for i in ids:
            ray.get([actor.rows.remote(i[i // half == k] % half) for k, actor in enumerate(actors)])

    def updates_():
        for i in ids:
            ray.get([actor.sub.remote(i[i // half == k] % half, updates[i // half == k])
                     for k, actor in enumerate(actors)])

    rows = OPS_PER_CLOSURE * BATCH
    result = {"lookup_rows_per_s": _median_rate(lookups, rows, repeats),
              "update_rows_per_s": _median_rate(updates_, rows, repeats)}
    for actor in actors:
        ray.kill(actor)
    return result


def sharded(workers: int, repeats: int) -> tuple[dict, dict]:
    """The table sharded over NUM_PS servers: driven from the coordinator's process, then by `workers` workers."""
    strategy = distrib.ParameterServerStrategy(RayClusterResolver(num_workers=workers, num_ps=NUM_PS),
                                               variable_partitioner=FixedShardsPartitioner(NUM_PS))
    with strategy.scope():
        table = distrib.Variable(np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32),
                                 name="embeddings")
    rng = np.random.default_rng(1)
    ids = [rng.integers(0, ROWS, BATCH) for _ in range(OPS_PER_CLOSURE)]
    updates = np.full((BATCH, DIM), 1e-3, np.float32)
    rows = OPS_PER_CLOSURE * BATCH
    direct = {"lookup_rows_per_s": _median_rate(lambda: [table.embedding_lookup(i) for i in ids], rows, repeats),
              "update_rows_per_s": _median_rate(lambda: [table.scatter_sub(i, updates) for i in ids], rows,
                                                repeats)}

    coordinator = ClusterCoordinator(strategy)

    def lookups(seed):
        draw = np.random.default_rng(seed)
        for _ in range(OPS_PER_CLOSURE):
            table.embedding_lookup(draw.integers(0, ROWS, BATCH))

    def updates_step(seed):
        draw, delta = np.random.default_rng(seed), np.full((BATCH, DIM), 1e-3, np.float32)
        for _ in range(OPS_PER_CLOSURE):
            table.scatter_sub(draw.integers(0, ROWS, BATCH), delta)

    def round_of(fn):
        def run():
            for k in range(CLOSURES):
                coordinator.schedule(fn, args=(k,))
            coordinator.join()
        return run

    total = CLOSURES * rows
    scheduled = {"lookup_rows_per_s": _median_rate(round_of(lookups), total, repeats),
                 "update_rows_per_s": _median_rate(round_of(updates_step), total, repeats)}
    strategy._cluster.shutdown()
    return direct, scheduled


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None,
                        help="where to write results (default bench/results/ps-<date>-cpu.json)")
    args = parser.parse_args(argv)
    import ray

    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    baseline = one_process(args.repeats)
    rows = [{"setup": "one process, NumPy", **baseline},
            {"setup": f"{NUM_PS} bare Ray actors (the floor)", **bare_ray(args.repeats)}]
    direct, one_worker = sharded(1, args.repeats)
    _, two_workers = sharded(2, args.repeats)
    rows += [{"setup": f"{NUM_PS} ps, calls from the coordinator", **direct},
             {"setup": f"{NUM_PS} ps, 1 worker (scheduled closures)", **one_worker},
             {"setup": f"{NUM_PS} ps, 2 workers (scheduled closures)", **two_workers}]
    for row in rows:
        row["lookup_vs_one_process"] = round(row["lookup_rows_per_s"] / baseline["lookup_rows_per_s"], 3)
        row["update_vs_one_process"] = round(row["update_rows_per_s"] / baseline["update_rows_per_s"], 3)
    scaling = {kind: round(two_workers[kind] / one_worker[kind], 2)
               for kind in ("lookup_rows_per_s", "update_rows_per_s")}
    _print(rows, scaling)
    path = args.json or BENCH / "results" / f"ps-{datetime.date.today().isoformat()}-cpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "benchmark": "ps_bench", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "numpy": np.__version__, "ray": ray.__version__, "distrib": distrib.__version__},
        "table": {"rows": ROWS, "dim": DIM, "dtype": "float32", "num_ps": NUM_PS},
        "operation": {"ids_per_call": BATCH, "calls_per_closure": OPS_PER_CLOSURE, "closures_per_round": CLOSURES},
        "results": rows, "two_vs_one_worker": scaling}, indent=2) + "\n")
    print(f"wrote {path}")
    ray.shutdown()
    return 0


def _print(rows, scaling) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text without rich
        Console = Table = None
    headers = ["setup", "lookup rows/s", "vs one process", "update rows/s", "vs one process"]
    cells = [[r["setup"], f"{r['lookup_rows_per_s']:,}", f"{r['lookup_vs_one_process']:.2f}x",
              f"{r['update_rows_per_s']:,}", f"{r['update_vs_one_process']:.2f}x"] for r in rows]
    title = (f"Embedding table {ROWS:,} x {DIM} float32, {BATCH} ids per call, sharded over {NUM_PS} parameter "
             f"servers")
    if Table is not None:
        table = Table(title=title)
        for k, header in enumerate(headers):
            table.add_column(header, justify="left" if k == 0 else "right")
        for row in cells:
            table.add_row(*row)
        Console(width=120).print(table)
    else:
        print(title)
        for row in [headers] + cells:
            print("  ".join(f"{c:>20}" for c in row))
    print(f"2 workers vs 1: lookups {scaling['lookup_rows_per_s']:.2f}x, updates {scaling['update_rows_per_s']:.2f}x "
          f"(on {os.cpu_count()} CPU cores, shared by the servers, the workers and this process)")


if __name__ == "__main__":
    sys.exit(main())
