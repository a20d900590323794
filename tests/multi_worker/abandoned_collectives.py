"""Run under `mpirun -np 2` with 2 emulated replicas per process; rank 0 writes to the JSON file argv[1], per case,
whether a run of rank 1 that fails while one of its replicas waits at a collective (its sibling raised, or returned
without making it) made rank 0, which made that collective, raise CollectiveMismatchError, and whether the next
collective then gave every rank the right sum (before: rank 0's collective paired with rank 1's next one)."""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from mpi4py import MPI

import distrib
from distrib.errors import CollectiveMismatchError, MergeCallMismatchError

strategy = distrib.MultiWorkerMirroredStrategy(
    communication_options=distrib.CommunicationOptions(timeout_seconds=20))
rank = strategy.extended._group.rank
last = strategy.num_replicas_in_sync - 1


def raises(ctx):
    raise ValueError("a bad batch")


def returns(ctx):
    return np.float32(0)


report = {}
for case, misbehave in (("a replica raised", raises), ("a replica returned without it", returns)):
    def step():
        ctx = distrib.get_replica_context()
        if rank == 1 and ctx.replica_id_in_sync_group == last:  # its sibling waits at the all_reduce meanwhile
            time.sleep(0.2)
            return misbehave(ctx)
        return ctx.all_reduce("SUM", np.float32(1))

    MPI.COMM_WORLD.barrier()
    try:
        strategy.run(step)
        raised = False
    except (ValueError, MergeCallMismatchError) as error:
        raised = isinstance(error, CollectiveMismatchError) and "rank 1 (pid " in str(error) if rank == 0 else \
            "a bad batch" in str(error) or isinstance(error, MergeCallMismatchError)
    after = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(100)))
    right = all(float(v) == 100 * (last + 1) for v in strategy.experimental_local_results(after))
    everywhere = MPI.COMM_WORLD.allgather((raised, right))
    report[case] = all(r and ok for r, ok in everywhere)
if rank == 0:
    with open(sys.argv[1], "w") as file:
        json.dump(report, file)
