"""Where the host time goes on the CUDA path: cProfile of `distrib train`, of a batched all_reduce and of
nccl_bench's per-call targets (needs a GPU).

    python3 bench/gpu_profile.py [--out DIR] [--epochs 20] [--steps 200]

Each workload is first timed without the profiler, then profiled after a warm-up (kernels compiled):
`distrib train` on GPU:0 (1 replica); `strategy.run` of one `all_reduce` of 200 x 1,000 float32 on 4 replicas
sharing GPU:0; and nccl_bench's per-call targets on 1 replica: `CudaBackend.all_reduce` of 4 B, `strategy.run` with
an `all_reduce` of 1M float32, `batch_reduce_to` of 1,000 x 256 float32 packed; each synchronised per step. Writes
`<workload>.prof` (pstats) and `<workload>.txt` (the 40 functions with the most own time, then the 40 with the most
cumulative time) to DIR. Host synchronisations show up as calls of `get`, `synchronize` and `wait` in the tables;
and one more epoch of `distrib train` runs with CuPy's synchronisation detector (`cupyx.allow_synchronize(False)`)
around every `strategy.run` and `reduce_to`, inside the replicas too, printing where the first synchronisation
inside a step happens, if any. Without a GPU it says what is missing and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

BATCH = (4, 200, 1_000)  # replicas sharing GPU:0, arrays per all_reduce, float32 elements per array


def report(profile: cProfile.Profile, out: Path, name: str, headline: str) -> None:
    """Writes the profile and its two tables, and prints them."""
    profile.dump_stats(out / f"{name}.prof")
    text = io.StringIO()
    print(headline, file=text)
    for order in ("tottime", "cumulative"):
        pstats.Stats(profile, stream=text).strip_dirs().sort_stats(order).print_stats(40)
    (out / f"{name}.txt").write_text(text.getvalue())
    print(text.getvalue())


def profile_train(out: Path, epochs: int) -> None:
    from distrib.cli import train as train_module
    from distrib.cli.train import build_parser, train
    from distrib.cli.train_strategy import make_strategy

    train_module.plot_history = lambda history, path: None  # the loss curve's matplotlib would fill the profile

    with tempfile.TemporaryDirectory() as tmp:
        def run(run_epochs: int, profile: cProfile.Profile | None = None):
            args = build_parser().parse_args(["--replicas", "1", "--epochs", str(run_epochs), "--overwrite",
                                              "--out", str(Path(tmp) / "run"), "--learning-rate", "0.003"])
            strategy = make_strategy(args)
            (Path(tmp) / "run").mkdir(exist_ok=True)
            with contextlib.redirect_stdout(io.StringIO()):
                if profile is None:
                    result = train(args, strategy)
                else:
                    with profile:
                        result = train(args, strategy)
            strategy.close()
            return result

        run(1)  # warm-up: compiles the kernels
        plain = run(epochs)
        profile = cProfile.Profile()
        profiled = run(epochs, profile)
        probe_synchronisations(lambda: run(1))
    report(profile, out, "train", f"distrib train, 1 replica on GPU:0, {epochs} epochs: "
                                  f"{plain.samples_per_second:,.0f} samples/s without the profiler, "
                                  f"{profiled.samples_per_second:,.0f} with it")


def probe_synchronisations(train_once) -> None:
    """Runs `train_once()` with CuPy's synchronisation detector on inside every step; prints what it finds."""
    import traceback
    import warnings

    import cupyx

    from distrib.extended import StrategyExtended
    from distrib.strategy import Strategy

    def guarded(function):
        def call(*args, **kwargs):
            with cupyx.allow_synchronize(False):
                return function(*args, **kwargs)
        return call

    run, reduce_to = Strategy.run, StrategyExtended.reduce_to

    def run_guarded(self, fn, args=(), kwargs=None, options=None):
        return guarded(run)(self, guarded(fn), args, kwargs, options)

    Strategy.run, StrategyExtended.reduce_to = run_guarded, guarded(reduce_to)
    try:
        with warnings.catch_warnings():  # the detector warns, at every use, that it will be removed
            warnings.filterwarnings("ignore", message="cupyx.allow_synchronize")
            train_once()
        print("synchronisation probe: no host synchronisation inside strategy.run or reduce_to in an epoch of "
              "distrib train (CuPy's detector sees CuPy's own synchronisations only)")
    except Exception:  # noqa: BLE001 - the probe reports whatever stopped the epoch
        print("synchronisation probe: an epoch of distrib train stopped inside a step:")
        traceback.print_exc(file=sys.stdout)
    finally:
        Strategy.run, StrategyExtended.reduce_to = run, reduce_to


def profile_batched_all_reduce(out: Path, steps: int) -> None:
    import cupy
    import numpy as np

    import distrib

    replicas, count, elements = BATCH
    strategy = distrib.MirroredStrategy(["GPU:0"] * replicas)
    backend = strategy.extended.backend
    batch = strategy.experimental_distribute_values_from_function(
        lambda ctx: [cupy.full(elements, ctx.replica_id_in_sync_group + 1, np.float32) for _ in range(count)])

    def step(xs):
        return distrib.get_replica_context().all_reduce("SUM", xs)

    timed_and_profiled(out, "batched_all_reduce", f"strategy.run + all_reduce of {count} x {elements} float32, "
                       f"{replicas} replicas sharing GPU:0, synchronised per step",
                       lambda: strategy.run(step, args=(batch,)), backend.synchronize, steps)
    strategy.close()


def timed_and_profiled(out: Path, name: str, what: str, step, sync, steps: int) -> None:
    """`step()` then `sync()`, `steps` times: timed without the profiler, then profiled; the report per step."""
    def loop(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            step()
            sync()
        return (time.perf_counter() - start) / n * 1e6

    loop(10)
    plain = loop(steps)
    profile = cProfile.Profile()
    with profile:
        profiled = loop(steps)
    report(profile, out, name, f"{what}: {plain:,.1f} us per step without the profiler, {profiled:,.1f} with it")


def profile_host_overhead(out: Path, steps: int) -> None:
    """The host time of nccl_bench's per-call targets: `CudaBackend.all_reduce` of 4 B, `strategy.run` with one
    all_reduce of 1M float32 on 1 replica, and `batch_reduce_to` of 1,000 x 256 float32 packed, each synchronised."""
    import cupy
    import numpy as np

    import distrib

    strategy = distrib.MirroredStrategy(["GPU:0"], cross_device_ops=distrib.NcclAllReduce(num_packs=1))
    backend = strategy.extended.backend
    sync = backend.synchronize
    tiny = [cupy.ones(1, np.float32)]
    timed_and_profiled(out, "all_reduce_4B", "CudaBackend.all_reduce of 4 B on GPU:0",
                       lambda: backend.all_reduce(tiny, [(0, 1)], ("GPU:0",), False), sync, steps * 10)
    big = cupy.ones(1 << 20, np.float32)
    timed_and_profiled(out, "run_all_reduce_1m", "strategy.run + all_reduce of 1M float32, 1 replica on GPU:0",
                       lambda: strategy.run(lambda x: distrib.get_replica_context().all_reduce("SUM", x),
                                            args=(big,)), sync, steps * 10)
    values = [strategy.experimental_distribute_values_from_function(lambda ctx: cupy.ones(256, np.float32))
              for _ in range(1000)]
    pairs = [(v, v) for v in values]
    timed_and_profiled(out, "batch_reduce_to_1000", "batch_reduce_to of 1,000 x 256 float32 packed, 1 replica",
                       lambda: strategy.extended.batch_reduce_to("SUM", pairs), sync, max(10, steps // 10))
    strategy.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu-profile"))
    parser.add_argument("--epochs", type=int, default=20, help="epochs of distrib train profiled (default 20)")
    parser.add_argument("--steps", type=int, default=200, help="batched all_reduce steps profiled (default 200)")
    args = parser.parse_args(argv)
    from distrib.backends import cuda_problem

    problem = cuda_problem()
    if problem:
        print(f"gpu_profile needs an NVIDIA GPU with CuPy and NCCL, but {problem}.", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    profile_train(args.out, args.epochs)
    profile_batched_all_reduce(args.out, args.steps)
    profile_host_overhead(args.out, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
