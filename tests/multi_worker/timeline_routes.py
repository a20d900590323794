"""Run under `mpirun -np 2` with DISTRIB_TIMELINE=<argv[1]>: every route by which MultiWorkerMirroredStrategy sums
across the processes, each inside a span of its own (category "test") named for it, so that the test can count the
collectives each recorded. With one replica per process the usual one first: straight from the array into MPI."""

import numpy as np

import distrib
from distrib import timeline

strategy = distrib.MultiWorkerMirroredStrategy()
values = strategy.experimental_distribute_values_from_function(
    lambda ctx: np.full(4, ctx.replica_id_in_sync_group + 1, np.float32))
halves = strategy.experimental_distribute_values_from_function(
    lambda ctx: np.full(4, ctx.replica_id_in_sync_group + 1, np.float16))


def all_reduce(value):
    return strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", value))


ROUTES = {
    "run: all_reduce": lambda: all_reduce(np.ones(8, np.float32)),
    "run: all_reduce of two values": lambda: all_reduce([np.ones(8, np.float32), np.ones(3, np.float32)]),
    "run: all_reduce of float16": lambda: all_reduce(np.ones(8, np.float16)),
    "run: all_gather": lambda: strategy.run(lambda: distrib.get_replica_context().all_gather(np.ones(2), axis=0)),
    "reduce_to": lambda: strategy.extended.reduce_to("SUM", values, values),
    "reduce_to of float16": lambda: strategy.extended.reduce_to("SUM", halves, halves),
    "reduce_to the host": lambda: strategy.extended.reduce_to("SUM", values, "host"),
    "Strategy.reduce": lambda: strategy.reduce("SUM", values, axis=None),
    "batch_reduce_to": lambda: strategy.extended.batch_reduce_to("SUM", [(values, values), (halves, halves)]),
}
for name, route in ROUTES.items():
    with timeline.span(name, "test"):
        route()
