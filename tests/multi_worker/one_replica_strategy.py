"""Run under `mpirun -np 2`, one replica per process: MultiWorkerMirroredStrategy's collectives and variable updates.

On the emulator over MPI (DISTRIB_BACKEND=cpu DISTRIB_CPU_REPLICAS=1) and on a GPU machine, where both processes
join one NCCL communicator (two processes may share one GPU: each gets its own NCCL_HOSTID). argv[1] is the
report file; each rank writes `<argv[1]>.<rank>` with what it saw, as JSON.
"""

import json
import sys

import numpy as np

import distrib

strategy = distrib.MultiWorkerMirroredStrategy(  # a regression fails within seconds rather than hanging
    communication_options=distrib.CommunicationOptions(timeout_seconds=20))
rank = strategy.cluster_resolver.task_id
backend = strategy.extended.backend
host = lambda value: backend.to_host(strategy.experimental_local_results(value)[0]).tolist()  # noqa: E731
report = {"backend": backend.name, "replicas": strategy.num_replicas_in_sync,
          "devices": list(strategy.extended.worker_devices)}


def collectives():
    ctx = distrib.get_replica_context()
    rid = ctx.replica_id_in_sync_group
    return {"sum": ctx.all_reduce("SUM", np.arange(4, dtype=np.float32) * (rid + 1)),
            "mean": ctx.all_reduce("MEAN", np.full(3, rid + 1, np.float64)),
            "int_sum": ctx.all_reduce("SUM", np.array([rid, 10], np.int64)),
            "gather": ctx.all_gather(np.array([rid, rid], np.int32), axis=0),
            "large": ctx.all_reduce("SUM", np.full(16 << 20, rid + 1, np.float32))}  # 64 MB: NCCL's chunking


out = strategy.run(collectives)
large = backend.to_host(strategy.experimental_local_results(out.pop("large"))[0])
report.update({key: host(value) for key, value in out.items()})
report["large"] = {"min": float(large.min()), "max": float(large.max()), "size": int(large.size)}
per_replica = strategy.experimental_distribute_values_from_function(
    lambda ctx: np.full((2, 2), ctx.replica_id_in_sync_group, np.float32))
report["reduce_mean_axis0"] = backend.to_host(strategy.reduce("MEAN", per_replica, axis=0)).tolist()
# each variable starts from rank 0's initial value; then each replica (one per process) adds replica id + 1,
# a plain value in its process, combined across the processes by the variable's aggregation
with strategy.scope():
    variables = {name: distrib.Variable(np.float32(7 + rank), aggregation=aggregation) for name, aggregation in (
        ("sum", distrib.VariableAggregation.SUM), ("mean", distrib.VariableAggregation.MEAN),
        ("first", distrib.VariableAggregation.ONLY_FIRST_REPLICA))}
report["initial"] = {name: float(v.numpy()) for name, v in variables.items()}


def update():
    delta = np.float32(distrib.get_replica_context().replica_id_in_sync_group + 1)
    for v in variables.values():
        v.assign_add(delta)


strategy.run(update)
report["after_updates"] = {name: float(v.numpy()) for name, v in variables.items()}


def zero_on_rank_0():  # replica 0 contributes 0, a plain value like any other: every process takes part
    rid = distrib.get_replica_context().replica_id_in_sync_group
    variables["sum"].assign_add(np.float32(rid))
    return distrib.get_replica_context().merge_call(lambda s, x: s.reduce("SUM", x, axis=None),
                                                    args=(np.float32(rid),))


report["reduce_of_a_zero_beside_a_one"] = float(backend.to_host(strategy.run(zero_on_rank_0)))
report["sum_after_adding_zero_and_one"] = float(variables["sum"].numpy())
with open(f"{sys.argv[1]}.{rank}", "w") as file:
    json.dump(report, file)
