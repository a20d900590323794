"""Run under `mpirun -np 2`; rank 0 writes to the JSON file argv[1], per case, whether the processes passing
different values to one collective (another size, shape, dtype, number of values or op) made every rank raise
CollectiveMismatchError before any byte moved, and whether the next collective then gave every rank the right sum.
Each process's own replicas agree with each other, so only the announcements can tell. The same for broadcasts of
another size, dtype or shape. Then rank 1 refuses its values before a collective that rank 0 makes: rank 0 must
raise too, and both go on in step."""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from mpi4py import MPI

import distrib
from distrib.errors import CollectiveMismatchError

strategy = distrib.MultiWorkerMirroredStrategy(
    communication_options=distrib.CommunicationOptions(timeout_seconds=20))
rank = strategy.extended._group.rank
replicas = strategy.num_replicas_in_sync

CASES = {  # (rank 0's value, rank 1's value, rank 0's op, rank 1's op)
    "size": (np.ones(3, np.float32), np.ones(4, np.float32), "SUM", "SUM"),
    "dtype": (np.ones(4, np.float32), np.ones(4, np.float64), "SUM", "SUM"),
    "integers against floats": (np.ones(4, np.float32), np.ones(4, np.int32), "SUM", "SUM"),
    "number of values": ([np.ones(2, np.float32)], [np.ones(2, np.float32)] * 2, "SUM", "SUM"),
    "op": (np.ones(2, np.float32), np.ones(2, np.float32), "SUM", "MEAN"),
    "the same size in another shape": (np.ones((2, 3), np.float32), np.ones((3, 2), np.float32), "SUM", "SUM"),
    "integers, SUM against MEAN": (np.ones(2, np.int32), np.ones(2, np.int32), "SUM", "MEAN"),
}
APIS = {
    "all_reduce": lambda op, value: strategy.run(lambda: distrib.get_replica_context().all_reduce(op, value)),
    "reduce": lambda op, value: strategy.reduce(
        op, strategy.experimental_distribute_values_from_function(lambda ctx: value), axis=None),
    "all_gather": lambda op, value: strategy.run(lambda: distrib.get_replica_context().all_gather(value, 0)),
}


def raised_everywhere_and_in_step(raised: bool) -> bool:
    """Whether every rank raised as it should (`raised`, this rank's) and the next all_reduce then summed right on
    every rank: the ranks went on in step."""
    after = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.ones(2, np.float32)))
    right = all(np.array_equal(v, [replicas] * 2) for v in strategy.experimental_local_results(after))
    return all(r and ok for r, ok in MPI.COMM_WORLD.allgather((raised, right)))


report = {}
for api, collective in APIS.items():
    for case, (first, second, first_op, second_op) in CASES.items():
        if api == "all_gather" and case in ("op", "integers, SUM against MEAN"):
            continue
        if api == "all_gather" and case == "size":  # lengths along the axis may differ: the rows may not
            first, second = np.ones((2, 3), np.float32), np.ones((2, 4), np.float32)
        try:
            collective(first_op if rank == 0 else second_op, first if rank == 0 else second)
            raised = False
        except CollectiveMismatchError as error:
            raised = str(error).startswith((  # the announcements' check; all_gather's own, of the sizes it exchanges
                "all_reduce across processes: rank ", "all_gather (sizes) across processes: rank ",
                "all_gather needs the same dtype, axis and shape off the gather axis on every replica."))
        report[f"{api}: {case}"] = raised_everywhere_and_in_step(raised)

GATHERS = {  # (rank 0's value and axis, rank 1's): the same elements per row, which the sizes exchanged matched
    # before: each rank read the other's block transposed, or cut in the wrong places, without an error
    "another axis": ((np.arange(4, dtype=np.float32).reshape(2, 2), 0),
                     (np.arange(4, dtype=np.float32).reshape(2, 2), 1)),
    "another shape off the axis": ((np.ones((2, 3, 4), np.float32), 0), (np.ones((2, 4, 3), np.float32), 0)),
}
for case, ((first, first_axis), (second, second_axis)) in GATHERS.items():
    value, axis = (first, first_axis) if rank == 0 else (second, second_axis)
    try:
        strategy.run(lambda: distrib.get_replica_context().all_gather(value, axis))
        raised = False
    except CollectiveMismatchError as error:
        raised = str(error).startswith("all_gather needs the same dtype, axis and shape off the gather axis")
    report[f"all_gather: {case}"] = raised_everywhere_and_in_step(raised)

BROADCASTS = {  # (rank 0's value, rank 1's value): broadcast_to sends rank 0's
    "size": (np.ones(3, np.float32), np.ones(4, np.float32)),
    "dtype": (np.ones(4, np.float32), np.ones(4, np.float64)),
    "the same size in another shape": (np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)),
}
every_replica = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(2, np.float32))
for case, (first, second) in BROADCASTS.items():
    try:
        strategy.extended.broadcast_to(first if rank == 0 else second, every_replica)
        raised = False
    except CollectiveMismatchError as error:
        raised = str(error).startswith("broadcast across processes: rank ")
    report[f"broadcast_to: {case}"] = raised_everywhere_and_in_step(raised)


def refused_value(replica_id: int):
    """Every rank but 0 refuses its values before the collective (its replicas disagree on the dtype; a lone
    replica's value cannot be reduced, or gathered); rank 0's are fine."""
    if rank == 0:
        return np.ones(2, np.float32)
    if strategy.extended._group.replica_counts[1] == 1:
        return np.float32(1) if api == "all_gather" else np.array(["a", "b"])
    return np.ones(2, np.float32 if replica_id == strategy.extended._group.first_replica else np.float64)


REFUSALS = {
    "all_reduce": lambda: strategy.run(lambda: distrib.get_replica_context().all_reduce(
        "SUM", refused_value(distrib.get_replica_context().replica_id_in_sync_group))),
    "reduce": lambda: strategy.reduce("SUM", strategy.experimental_distribute_values_from_function(
        lambda ctx: refused_value(ctx.replica_id_in_sync_group)), axis=None),
    "all_gather": lambda: strategy.run(lambda: distrib.get_replica_context().all_gather(
        refused_value(distrib.get_replica_context().replica_id_in_sync_group), 0)),
    # every replica of rank 1 refuses strings before the rendezvous: before, with several replicas, none announced
    # a refusal, so rank 0's all_reduce paired with rank 1's next one (wrong sums), and its own next one waited
    "all_reduce of strings on every replica": lambda: strategy.run(lambda: distrib.get_replica_context().all_reduce(
        "SUM", np.ones(2, np.float32) if rank == 0 else np.array(["a", "b"]))),
    "reduce_to an unknown device": lambda: strategy.extended.reduce_to(
        "SUM", every_replica, every_replica if rank == 0 else "GPU:7"),
}
for api, collective in REFUSALS.items():
    # rank 1 refuses first, then makes its next collective, the same all_reduce as rank 0's here, at once: before,
    # the two paired up and rank 0 went on one collective behind (its next one waited for good)
    MPI.COMM_WORLD.barrier()
    if rank == 0:
        time.sleep(0.3)
    try:
        collective()
        raised = False
    except (ValueError, TypeError) as error:
        raised = rank != 0 or isinstance(error, CollectiveMismatchError) and "rank 1 (pid " in str(error) and \
            "refused it" in str(error)
    report[f"refused by one process: {api}"] = raised_everywhere_and_in_step(raised)
if rank == 0:
    with open(sys.argv[1], "w") as file:
        json.dump(report, file)
