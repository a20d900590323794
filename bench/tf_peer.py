"""TensorFlow's MirroredStrategy on 4 logical CPU devices, timed on strategy_bench.py's workloads; prints JSON."""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # stdout carries the JSON; keep TensorFlow's C++ logs quiet

import tensorflow as tf  # noqa: E402

from measure import BATCH_COUNT, BATCH_ELEMENTS, VECTOR_ELEMENTS, per_step_us  # noqa: E402

REPLICAS = 4


def make_strategy() -> tf.distribute.MirroredStrategy:
    """MirroredStrategy over REPLICAS logical CPU devices carved out of the one physical CPU."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)
    return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])


def all_reduce_step(x):
    return tf.distribute.get_replica_context().all_reduce("SUM", x)


def merge_call_step():
    tf.distribute.get_replica_context().merge_call(lambda strategy: None)


def workloads(strategy: tf.distribute.MirroredStrategy) -> dict:
    """Each workload as (replica fn, args), inputs made on each replica's device as in strategy_bench.py."""
    vector = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.fill([VECTOR_ELEMENTS], float(ctx.replica_id_in_sync_group + 1)))
    batch = strategy.experimental_distribute_values_from_function(
        lambda ctx: [tf.fill([BATCH_ELEMENTS], float(ctx.replica_id_in_sync_group + 1)) for _ in range(BATCH_COUNT)])
    return {
        "allreduce_1m": (all_reduce_step, (vector,)),
        "batch_200x1000": (all_reduce_step, (batch,)),
        "empty_merge_call": (merge_call_step, ()),
    }


def time_workload(strategy: tf.distribute.MirroredStrategy, fn, fn_args: tuple, repeats: int,
                  min_seconds: float) -> tuple[float, float]:
    """Microseconds per step of `strategy.run(fn)` called eagerly, and inside a tf.function."""
    eager = per_step_us(lambda: strategy.run(fn, args=fn_args), repeats, min_seconds)
    compiled = tf.function(lambda *a: strategy.run(fn, args=a))
    return eager, per_step_us(lambda: compiled(*fn_args), repeats, min_seconds)


def check(strategy: tf.distribute.MirroredStrategy, fn, fn_args) -> None:
    """The all-reduce must sum 1 + 2 + ... + REPLICAS on every replica, or the timings measure the wrong thing."""
    expected = REPLICAS * (REPLICAS + 1) / 2
    for value in tf.nest.flatten(strategy.run(fn, args=fn_args)):
        for component in strategy.experimental_local_results(value):
            if not bool(tf.reduce_all(component == expected)):
                raise SystemExit(f"TensorFlow's all-reduce gave {component}, expected {expected} everywhere.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--min-seconds", type=float, default=0.2, help="length of one timed loop")
    args = parser.parse_args()
    tf.get_logger().setLevel("ERROR")  # MirroredStrategy warns on every eager run that eager mode is slow
    strategy = make_strategy()
    eager, function = {}, {}
    for name, (fn, fn_args) in workloads(strategy).items():
        if fn_args:  # the merge_call workload has no inputs and no result to check
            check(strategy, fn, fn_args)
        eager[name], function[name] = time_workload(strategy, fn, fn_args, args.repeats, args.min_seconds)
    print(json.dumps({"tensorflow": tf.__version__, "replicas": REPLICAS,
                      "devices": list(strategy.extended.worker_devices), "eager_us": eager, "function_us": function}))


if __name__ == "__main__":
    main()
