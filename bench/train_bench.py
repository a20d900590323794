"""`distrib train` throughput on the emulator, with each replica's share of the cores for BLAS and without, and
with its replicas cooperative (its default on the emulator) or on threads.

Without the share, a BLAS that spreads each matmul over every core oversubscribes them while the replicas
run theirs at once; its spinning threads then wait on each other. The target: 1 replica trains at least half
as fast as 2 (it was 20x slower), measured against the unshared baseline in the same run. The threads column
trains with `DISTRIB_REPLICA_EXECUTION=threads`, the shared BLAS too, for the cost of a thread per replica.

    python bench/train_bench.py [--epochs 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import tempfile
from pathlib import Path

import numpy as np

import distrib
from distrib.cli.train import build_parser, train
from distrib.cli.train_strategy import make_strategy, replicas_at_once, shared_cores

BENCH = Path(__file__).resolve().parent
REPLICAS = (1, 2, 4)
TARGET_RATIO = 0.5  # samples/s at 1 replica over samples/s at 2, both shared


def samples_per_second(replicas: int, epochs: int, shared: bool, out: Path, execution: str | None = None) -> float:
    args = build_parser().parse_args(["--replicas", str(replicas), "--epochs", str(epochs), "--out", str(out),
                                      "--learning-rate", "0.003"])
    previous = os.environ.pop("DISTRIB_REPLICA_EXECUTION", None)
    try:
        if execution is not None:
            os.environ["DISTRIB_REPLICA_EXECUTION"] = execution
        strategy = make_strategy(args)
    finally:
        os.environ.pop("DISTRIB_REPLICA_EXECUTION", None)
        if previous is not None:
            os.environ["DISTRIB_REPLICA_EXECUTION"] = previous
    out.mkdir(parents=True, exist_ok=True)
    with shared_cores(replicas_at_once(strategy)) if shared else contextlib.nullcontext(), contextlib.redirect_stdout(io.StringIO()):
        return train(args, strategy).samples_per_second


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None,
                        help="where to write results (default bench/results/train-<date>-cpu.json)")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for replicas in REPLICAS:
            row = {"replicas": replicas}
            for shared in (False, True):
                key = "shared_samples_per_s" if shared else "unshared_samples_per_s"
                row[key] = round(samples_per_second(replicas, args.epochs, shared, Path(tmp) / f"{replicas}{shared}"))
            row["threads_shared_samples_per_s"] = round(samples_per_second(
                replicas, args.epochs, True, Path(tmp) / f"{replicas}threads", execution="threads"))
            rows.append(row)
    by_replicas = {row["replicas"]: row for row in rows}
    ratio = by_replicas[1]["shared_samples_per_s"] / by_replicas[2]["shared_samples_per_s"]
    print(f"distrib train, {args.epochs} epochs, {os.cpu_count()} cores: samples/s")
    print(f"{'replicas':>8} {'unshared BLAS':>14} {'shared BLAS':>12} {'shared, threads':>16}")
    for row in rows:
        print(f"{row['replicas']:>8} {row['unshared_samples_per_s']:>14,} {row['shared_samples_per_s']:>12,} "
              f"{row['threads_shared_samples_per_s']:>16,}")
    print("replicas cooperative (distrib train's default on the emulator) but in the last column")
    passed = ratio >= TARGET_RATIO
    print(f"1 replica / 2 replicas, shared: {ratio:.2f} (target >= {TARGET_RATIO}): {'PASS' if passed else 'FAIL'}")
    path = args.json or BENCH / "results" / f"train-{datetime.date.today().isoformat()}-cpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "benchmark": "train_bench", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "numpy": np.__version__, "distrib": distrib.__version__,
                    "note": "shared machine: other jobs ran at the same time"},
        "epochs": args.epochs, "rows": rows,
        "target": {"min_ratio_1_to_2_replicas": TARGET_RATIO, "ratio": round(ratio, 3), "passed": passed}},
        indent=2) + "\n")
    print(f"wrote {path}")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
