"""Run under `mpirun -np 2` with one emulated replica per process; rank 0 writes to the JSON file argv[1] whether each
one-replica fast path (reduce_to of one array, all_reduce and all_gather of one value in a run, batch_reduce_to of
plain arrays) gave the general route's result."""

from __future__ import annotations

import json
import sys

import numpy as np

import distrib
from distrib.extended import StrategyExtended

strategy = distrib.MultiWorkerMirroredStrategy()
extended = strategy.extended
rank = extended._group.rank
report: dict = {}


def same(fast, general) -> bool:
    fast, general = np.asarray(fast), np.asarray(general)
    return fast.dtype == general.dtype and fast.shape == general.shape and bool(np.array_equal(fast, general)) \
        and fast.flags.writeable == general.flags.writeable


def error_of(call) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the error is what is compared
        return f"{type(exc).__name__}: {exc}"
    return "no error"


for dtype in ("float32", "float64", "int32", "float16"):
    for shape in ((5,), (2, 3), ()):
        value = (np.arange(int(np.prod(shape))).reshape(shape) * (rank + 1) + 0.5 * (dtype != "int32")).astype(dtype)
        per_replica = strategy.experimental_distribute_values_from_function(lambda ctx: value)
        for op in ("SUM", "MEAN", distrib.ReduceOp.SUM):
            case = f"{op} of {dtype}{list(shape)}"
            fast = extended.reduce_to(op, per_replica, per_replica)
            general = StrategyExtended.reduce_to(extended, op, per_replica, per_replica)
            report[f"reduce_to {case}"] = type(fast) is type(general) is distrib.Mirrored and \
                same(fast.values[0], general.values[0])

            def step(x):
                context = distrib.get_replica_context()
                return context.all_reduce(op, x), context.all_reduce(op, [x])[0]  # a list: the general route

            fast, general = strategy.run(step, args=(per_replica,))
            report[f"run all_reduce {case}"] = same(fast, general)
# all_gather of one array: the same as of a list of it (the general route), along each axis, lengths differing
for dtype in ("float32", "int32", "float16", "bool"):
    for shape, axis in (((5,), 0), ((2, 3), 1), ((2, 3), -2)):
        grown = tuple(n + rank if k == axis % len(shape) else n for k, n in enumerate(shape))  # ragged across ranks
        value = (np.arange(int(np.prod(grown))).reshape(grown) * (rank + 1)).astype(dtype)
        per_replica = strategy.experimental_distribute_values_from_function(lambda ctx: value)

        def gather(x, axis=axis):
            context = distrib.get_replica_context()
            return context.all_gather(x, axis), context.all_gather([x], axis)[0]

        fast, general = strategy.run(gather, args=(per_replica,))
        report[f"all_gather of {dtype}{list(shape)} along {axis}"] = same(fast, general)
scalar = strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(rank))
for axis in (0, 3):
    one = error_of(lambda: strategy.run(lambda x: distrib.get_replica_context().all_gather(np.asarray(x), axis),
                                        args=(scalar,)))
    listed = error_of(lambda: strategy.run(lambda x: distrib.get_replica_context().all_gather([np.asarray(x)], axis),
                                           args=(scalar,)))
    report[f"all_gather error along {axis}"] = one == listed.replace("path [0]", "path <root>") != "no error"
# a step's gradients as `run` returns them with one replica per process, plain arrays, reduced onto variables in
# one batch_reduce_to: checked in bulk, and the same as value by value (the general route)
plain = [(np.arange(6).reshape(2, 3) * (rank + 1) + k).astype(dtype)
         for k, dtype in enumerate(("float32", "int32", "float64", "float16") * 3)]
variables = [extended._create_variable(np.zeros_like(array)) for array in plain]
for op in ("SUM", "MEAN"):
    bulk = extended.batch_reduce_to(op, list(zip(plain, variables)))
    extended._placed_batch = lambda pairs: None  # this instance only: the general route
    general = extended.batch_reduce_to(op, list(zip(plain, variables)))
    del extended._placed_batch
    report[f"batch_reduce_to {op} of plain arrays"] = len(bulk) == len(general) == len(plain) and all(
        type(b) is type(g) is distrib.Mirrored and same(b.values[0], g.values[0]) for b, g in zip(bulk, general))
# plain Python numbers, and the errors, are the general route's too
report["run all_reduce of a float"] = strategy.run(
    lambda: distrib.get_replica_context().all_reduce("SUM", 1.5)) == 3.0
flags = strategy.experimental_distribute_values_from_function(lambda ctx: np.array([True, False]))
report["reduce_to error"] = error_of(lambda: extended.reduce_to("SUM", flags, flags)) == \
    error_of(lambda: StrategyExtended.reduce_to(extended, "SUM", flags, flags))
one_error = error_of(lambda: strategy.run(lambda x: distrib.get_replica_context().all_reduce("SUM", x), args=(flags,)))
list_error = error_of(lambda: strategy.run(lambda x: distrib.get_replica_context().all_reduce("SUM", [x]),
                                          args=(flags,)))
report["all_reduce error"] = one_error == list_error.replace("path [0]", "path <root>")
report["bad op"] = error_of(lambda: extended.reduce_to("MAX", flags, flags)) == \
    error_of(lambda: StrategyExtended.reduce_to(extended, "MAX", flags, flags))
if rank == 0:
    with open(sys.argv[1], "w") as file:
        json.dump({name: bool(ok) for name, ok in report.items()}, file)
