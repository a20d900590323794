"""Run under `mpirun -np 2` with 2 emulated replicas per process: API checks, conformance, training, checkpoint,
and `distrib train`.

Rank 0 writes what it saw to the JSON file named by argv[1]; argv[2] is the training checkpoint, argv[3] the
`distrib train --out` folder. tests/test_multi_worker.py reads them.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
from mpi4py import MPI

import distrib
from distrib.values import map_structure

sys.path[:0] = [str(pathlib.Path(__file__).parent), str(pathlib.Path(__file__).parents[1])]
import training  # noqa: E402
from nested_values import ragged_nested, same_shaped  # noqa: E402
from conformance_on_workers import everywhere, run_cases  # noqa: E402

comm = MPI.COMM_WORLD
strategy = distrib.MultiWorkerMirroredStrategy()
report: dict = {"repr": repr(strategy), "num_replicas_in_sync": strategy.num_replicas_in_sync}


# -- the API across processes ----------------------------------------------------------------------------------
def step():
    ctx = distrib.get_replica_context()
    rid = ctx.replica_id_in_sync_group
    return {"id": rid, "sum": ctx.all_reduce("SUM", np.float32(rid + 1)),
            "mean_int": ctx.all_reduce("MEAN", np.arange(3) + rid),
            "gathered": ctx.all_gather(np.full((rid + 1, 2), rid, np.float32), axis=0),
            "merged": ctx.merge_call(lambda s, v: s.reduce("SUM", v, axis=None), args=(np.float32(rid),))}


out = strategy.run(step)
report["ids"] = everywhere(strategy.experimental_local_results(out["id"]))
report["local_results"] = len(strategy.experimental_local_results(out["sum"]))
report["sum"] = everywhere(strategy.experimental_local_results(out["sum"]))
report["mean_int"] = everywhere(strategy.experimental_local_results(out["mean_int"]))
report["gathered_rows"] = [g.shape[0] for g in everywhere(strategy.experimental_local_results(out["gathered"]))]
report["merged"] = everywhere(strategy.experimental_local_results(out["merged"]))
values = strategy.experimental_distribute_values_from_function(
    lambda ctx: np.full((2, 2), ctx.replica_id_in_sync_group, np.float32))
report["reduce_mean_axis0"] = strategy.reduce("MEAN", values, axis=0)
report["gather"] = strategy.gather(values, axis=0)

# -- nested values: each dtype's leaves in one collective, lengths along the axis differing between replicas -------
backend = strategy.extended.backend
gathered_dtypes: list = []
backend.all_gather = lambda flats, devices, **kw: gathered_dtypes.append(flats[0].dtype.name) or \
    type(backend).all_gather(backend, flats, devices, **kw)  # counts this process's calls
backend.gather_rows = lambda rows, **kw: gathered_dtypes.append(f"sizes {rows.shape}") or \
    type(backend).gather_rows(backend, rows, **kw)
nested_out = strategy.run(lambda: distrib.get_replica_context().all_gather(
    ragged_nested(distrib.get_replica_context().replica_id_in_sync_group), axis=0))
report["nested_all_gather_dtypes"] = sorted(gathered_dtypes)
del backend.all_gather, backend.gather_rows
report["nested_all_gather"] = everywhere(map_structure(np.asarray, strategy.experimental_local_results(nested_out)))
nested = strategy.experimental_distribute_values_from_function(lambda ctx: ragged_nested(ctx.replica_id_in_sync_group))
report["nested_gather"] = strategy.gather(nested, axis=0)
try:
    strategy.gather({"rows": nested["f32"], "scalar": strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group))}, axis=0)
except ValueError as exc:
    report["nested_gather_of_a_scalar"] = str(exc)
try:  # each process's replicas agree, the processes do not: a typed error on every rank, not a broken gather
    strategy.run(lambda: distrib.get_replica_context().all_gather(
        [np.zeros((1, 3 if comm.rank == 0 else 4), np.float32)], axis=0))
except distrib.errors.CollectiveMismatchError as exc:
    report["all_gather_across_processes_of_other_shapes"] = everywhere([str(exc)])
numbers = {key: nested[key] for key in ("f32", "f16", "i32")}  # bool cannot be summed
report["nested_reduce_mean_axis0"] = strategy.reduce("MEAN", numbers, axis=0)
report["nested_reduce_sum_axis0"] = strategy.reduce("SUM", numbers, axis=0)
report["nested_reduce_mean"] = strategy.reduce("MEAN", strategy.experimental_distribute_values_from_function(
    lambda ctx: same_shaped(ctx.replica_id_in_sync_group)), axis=None)

dataset = [np.arange(14, dtype=np.float32).reshape(7, 2)]
report["batch_rows"] = everywhere([len(b) for b in strategy.experimental_local_results(
    next(iter(strategy.experimental_distribute_dataset(dataset))))])
off = distrib.InputOptions(auto_shard_policy=distrib.AutoShardPolicy.OFF)
report["batch_rows_off"] = [everywhere([len(b) for b in strategy.experimental_local_results(batch)])
                            for batch in strategy.experimental_distribute_dataset(dataset, off)]  # every step
report["resolver"] = [strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id,
                      strategy.cluster_resolver.cluster_spec()]

# -- training 2 processes x 2 replicas, checkpointed halfway by the chief ---------------------------------------
w, b, optimizer = training.build(strategy, seed=comm.rank)
half = training.STEPS // 2
losses = training.train(strategy, w, b, optimizer, training.batches(half))
checkpoint = distrib.Checkpoint(w=w, b=b, optimizer=optimizer, step=half)
checkpoint.save(sys.argv[2])
losses += training.train(strategy, w, b, optimizer, training.batches(training.STEPS - half, first=half))
report["losses"], report["w"], report["b"] = losses, w.numpy().tolist(), float(b.numpy())


# -- the conformance programs, their MirroredStrategy(4 CPUs) replaced by 2 processes x 2 replicas -------------
report["conformance"] = run_cases(comm)

# -- the main job, as `mpirun -np 2 distrib train` runs it --------------------------------------------------------
from distrib.cli.train import main as distrib_train  # noqa: E402

report["distrib_train"] = distrib_train(["--epochs", "1", "--out", sys.argv[3], "--seed", "3"])

if comm.rank == 0:
    pathlib.Path(sys.argv[1]).write_text(json.dumps(report, default=lambda a: np.asarray(a).tolist()))
