"""Run under `mpirun -np 2`; rank 0 writes to the JSON file argv[1], per collective, whether it gave every rank the
same result with MAX_COUNT, the most elements the MPI backend puts in one MPI call, lowered from a C int's
2**31 - 1 to 7: the arrays then travel in pieces, as arrays of more than 2**31 - 1 elements do (too large to
allocate in a test)."""

from __future__ import annotations

import json
import sys

import numpy as np

import distrib
from distrib.backends import mpi

strategy = distrib.MultiWorkerMirroredStrategy()
extended = strategy.extended
rank = extended._group.rank
ring = distrib.CommunicationOptions(implementation="RING")


def values(shape, dtype):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: (np.arange(int(np.prod(shape))).reshape(shape) * (ctx.replica_id_in_sync_group + 1) % 97)
        .astype(dtype))


def results() -> dict:
    ctx = distrib.get_replica_context
    out = {}
    for dtype in ("float32", "float16", "int32", "bool"):
        x = values((3, 17), dtype)
        local = strategy.experimental_local_results
        if dtype != "bool":
            out[f"reduce_to {dtype}"] = local(extended.reduce_to("SUM", x, x))
            out[f"reduce_to MEAN {dtype}"] = local(extended.reduce_to("MEAN", x, x))
            out[f"packed all_reduce {dtype}"] = local(strategy.run(lambda v: ctx().all_reduce("SUM", [v, v * 2]),
                                                                   (x,)))
            out[f"ring all_reduce {dtype}"] = local(strategy.run(lambda v: ctx().all_reduce("SUM", v, ring), (x,)))
            out[f"reduce {dtype}"] = strategy.reduce("SUM", x, axis=None)
        out[f"all_gather {dtype}"] = local(strategy.run(lambda v: ctx().all_gather(v, 0), (x,)))
        ragged = strategy.experimental_distribute_values_from_function(
            lambda ctx: np.ones((ctx.replica_id_in_sync_group + 2, 5), dtype))
        out[f"ragged gather {dtype}"] = strategy.gather(ragged, 0)
        out[f"broadcast {dtype}"] = local(extended.broadcast_to(np.arange(40).astype(dtype) + rank, x))
    return out


reference = results()
mpi.MAX_COUNT = 7
pieced = results()


def arrays(value) -> list:
    return [a for item in value for a in arrays(item)] if isinstance(value, (list, tuple)) else [np.asarray(value)]


report = {name: all(a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
                    for a, b in zip(arrays(reference[name]), arrays(pieced[name])))
          for name in reference}
report["pieces"] = mpi.pieces([(0, 16), (16, 16)]) == [(0, 7), (7, 14), (14, 16), (16, 16)]
everyone = extended._group.comm.gather(report, root=0)  # a broadcast's pieces land on the other rank
if rank == 0:
    with open(sys.argv[1], "w") as file:
        json.dump({name: all(each[name] for each in everyone) for name in report}, file)
