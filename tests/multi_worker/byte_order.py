"""Run under `mpirun -np 2`; rank 0 writes to the JSON file argv[1], per collective, whether values in the other byte
order (`>f4` on a little-endian host) gave what the same values in native order give, in native order as
TensorFlow's tensors are: MPI's datatypes describe native values, so the bytes must not travel as they are."""

from __future__ import annotations

import json
import sys

import numpy as np

import distrib

strategy = distrib.MultiWorkerMirroredStrategy()
extended = strategy.extended
report: dict = {}
BASE = np.arange(6) * 300 + 255  # integers carry from byte to byte as they add


def local(value) -> list[np.ndarray]:
    return [np.asarray(v) for v in strategy.experimental_local_results(value)]


def arrays(nested) -> list:
    return [a for item in nested for a in arrays(item)] if isinstance(nested, list) else [nested]


def step(x):
    context = distrib.get_replica_context()
    return context.all_reduce("SUM", x), context.all_reduce("MEAN", [x, x * 2])[1], context.all_gather(x, 0)


for name in ("float32", "float64", "int32", "int64", "float16"):
    native = np.dtype(name)
    swapped = native.newbyteorder("S")
    results = {}
    for order, dtype in (("native", native), ("swapped", swapped)):
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx, dtype=dtype: (BASE * (ctx.replica_id_in_sync_group + 1)).astype(dtype))
        summed, mean, gathered = strategy.run(step, args=(values,))
        results[order] = [local(extended.reduce_to("SUM", values, values)),
                          local(extended.reduce_to("MEAN", values, values)),
                          [local(m) for m in extended.batch_reduce_to("SUM", [(values, values)] * 2)],
                          np.asarray(strategy.reduce("SUM", values, axis=None)),
                          local(summed), local(mean), local(gathered),
                          local(extended.broadcast_to(np.arange(3).astype(dtype) + extended._group.rank, values))]
    report[name] = all(np.array_equal(a, b) for a, b in zip(results["native"], results["swapped"]))
    report[f"{name} native results"] = all(np.asarray(a).dtype.isnative for a in arrays(results["swapped"]))
    expected = BASE * sum(range(1, strategy.num_replicas_in_sync + 1))
    report[f"{name} sums"] = bool(np.allclose(results["swapped"][0][0], expected, atol=0,  # float16 rounds
                                              rtol=2.0 ** -10 if name == "float16" else 0))

def ragged_gathers(dtype) -> list:
    """all_gather and gather of values whose length differs per replica (replica r has r + 1 rows): some
    processes' parts are packed with padding, others travel as they are."""
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(ctx.replica_id_in_sync_group + 1, BASE[0] * (ctx.replica_id_in_sync_group + 1), dtype))
    gathered = strategy.run(lambda x: distrib.get_replica_context().all_gather(x, 0), args=(values,))
    return local(gathered) + [np.asarray(strategy.gather(values, axis=0))]


for name in ("int64", "float32"):
    native, swapped = ragged_gathers(np.dtype(name)), ragged_gathers(np.dtype(name).newbyteorder("S"))
    report[f"{name} ragged gathers"] = all(np.array_equal(a, b) and b.dtype.isnative
                                           for a, b in zip(native, swapped))
if extended._group.rank == 0:
    with open(sys.argv[1], "w") as file:
        json.dump(report, file)
