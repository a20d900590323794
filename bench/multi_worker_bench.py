"""All-reduce across MPI processes: MultiWorkerMirroredStrategy on the CPU emulator beside raw mpi4py `Allreduce`.

Run it as `python bench/multi_worker_bench.py` (it relaunches itself under `mpirun -np 2`) or under your own
`mpirun -np N python bench/multi_worker_bench.py --launched`. Each process drives one emulated replica, so both
columns move the same bytes between the same processes; the raw column is `comm.Allreduce(src, dst, SUM)` on the
very arrays distrib reduces. Both are timed in the same run, interleaved repeat by repeat, as the median of 7
repeats; the target is distrib within 10 % of raw at 1 MB and more. Rank 0 prints the table and writes the JSON
to bench/results/multi-worker-<date>-cpu.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # benchmark the checkout this file belongs to, installed or not

SIZES_MB = (1, 4, 16)
REPEATS, TARGET_OVERHEAD = 9, 0.10


def relaunch(processes: int, argv: list[str]) -> int:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        print("multi_worker_bench needs mpirun (apt-get install openmpi-bin libopenmpi-dev).", file=sys.stderr)
        return 2
    env = dict(os.environ, DISTRIB_CPU_REPLICAS="1", DISTRIB_BACKEND="cpu", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    return subprocess.call([mpirun, "-np", str(processes), sys.executable, __file__, "--launched", *argv], env=env)


def timed(comm, step, steps: int) -> float:
    """Microseconds per call of `step` over `steps` calls, started together on every rank (rank 0's clock)."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    comm.Barrier()
    return (time.perf_counter() - start) / steps * 1e6


def measure(strategy, comm, megabytes: int) -> dict:
    import distrib

    elements = megabytes * (1 << 20) // 4
    source = np.random.default_rng(comm.rank).random(elements, dtype=np.float32)
    raw_out = np.empty_like(source)
    per_replica = strategy.experimental_distribute_values_from_function(lambda ctx: source)
    extended = strategy.extended
    raw = lambda: comm.Allreduce(source, raw_out)  # noqa: E731
    reduce_to = lambda: extended.reduce_to("SUM", per_replica, destinations=per_replica)  # noqa: E731
    in_run = lambda: strategy.run(lambda x: distrib.get_replica_context().all_reduce("SUM", x),  # noqa: E731
                                  args=(per_replica,))
    np.testing.assert_allclose(strategy.experimental_local_results(reduce_to())[0], (raw(), raw_out)[1], rtol=1e-6)
    steps = max(3, int(comm.bcast(0.3 / max(timed(comm, raw, 3) * 1e-6, 1e-6), root=0)))
    samples: dict[str, list[float]] = {"raw": [], "reduce_to": [], "run": []}
    for _ in range(REPEATS):  # interleaved, so that noise from the shared machine hits every column alike
        for name, step in (("raw", raw), ("reduce_to", reduce_to), ("run", in_run)):
            samples[name].append(timed(comm, step, steps))
    median = {name: statistics.median(values) for name, values in samples.items()}
    best = {name: min(values) for name, values in samples.items()}
    return {"megabytes": megabytes, "elements": elements, "steps": steps,
            "raw_allreduce_us": round(median["raw"], 1), "reduce_to_us": round(median["reduce_to"], 1),
            "run_all_reduce_us": round(median["run"], 1),
            "reduce_to_overhead": round(median["reduce_to"] / median["raw"] - 1, 4),
            "run_overhead": round(median["run"] / median["raw"] - 1, 4),
            "best_of_repeats_us": {name: round(value, 1) for name, value in best.items()},
            "best_reduce_to_overhead": round(best["reduce_to"] / best["raw"] - 1, 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2, help="MPI processes when relaunching (default 2)")
    parser.add_argument("--json", type=Path, default=None, help="where to write results (default "
                        "bench/results/multi-worker-<date>-cpu.json)")
    parser.add_argument("--launched", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.launched:
        return relaunch(args.processes, [a for a in (argv or sys.argv[1:]) if not a.startswith("--processes")])
    from mpi4py import MPI

    import distrib

    comm = MPI.COMM_WORLD
    strategy = distrib.MultiWorkerMirroredStrategy()
    rows = [measure(strategy, comm, megabytes) for megabytes in SIZES_MB]
    if comm.rank:
        return 0
    print(f"all-reduce of float32 across {comm.size} processes, 1 emulated replica each, µs per call "
          f"(median of {REPEATS}; raw = mpi4py Allreduce on the same arrays)")
    print(f"{'size':>6} {'raw':>10} {'reduce_to':>10} {'overhead':>9} {'run+all_reduce':>15} {'overhead':>9} "
          f"{'best-of overhead':>17}")
    for row in rows:
        print(f"{row['megabytes']:>4}MB {row['raw_allreduce_us']:>10.1f} {row['reduce_to_us']:>10.1f} "
              f"{row['reduce_to_overhead']:>+9.1%} {row['run_all_reduce_us']:>15.1f} {row['run_overhead']:>+9.1%} "
              f"{row['best_reduce_to_overhead']:>+17.1%}")
    worst = max(row["reduce_to_overhead"] for row in rows)
    print(f"target: reduce_to within {TARGET_OVERHEAD:.0%} of raw at >= 1 MB: "
          f"{'met' if worst <= TARGET_OVERHEAD else 'missed'} (worst {worst:+.1%})")
    path = args.json or BENCH / "results" / f"multi-worker-{datetime.date.today().isoformat()}-cpu.json"
    path.write_text(json.dumps({
        "benchmark": "multi_worker_bench", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"device": "cpu (emulator)", "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "mpi": MPI.Get_library_version().splitlines()[0],
                    "processes": comm.size, "replicas_per_process": 1},
        "rows": rows, "target": {"overhead": TARGET_OVERHEAD, "met": worst <= TARGET_OVERHEAD},
        "note": "shared machine: other work ran at the same time, so timings are noisy"}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
