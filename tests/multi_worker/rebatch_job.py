"""Run under `mpirun` (2 processes x 2 emulated replicas, or processes of 1 and 2 replicas) by
tests/test_multi_worker.py: `experimental_distribute_dataset` with AutoShardPolicy FILE, AUTO (a dataset with a
`shard` method), OFF and DATA, global batches of G = 2 x num_replicas_in_sync rows.

Where a worker reads whole batches (FILE, OFF) it rebatches each into num_replicas_in_sync pieces and its replicas
take the next pieces each step, as TensorFlow's "rebatch, then shard" does, so a step holds G rows over all workers,
not G per worker. Rank 0 writes, per case, every step's rows in global replica order and the rows the step
processed (a SUM across every replica) to argv[1].
"""

from __future__ import annotations

import json
import sys

import numpy as np
from mpi4py import MPI

import distrib
from sharded_files import Files

comm = MPI.COMM_WORLD
strategy = distrib.MultiWorkerMirroredStrategy(communication_options=distrib.CommunicationOptions(timeout_seconds=20))
G = 2 * strategy.num_replicas_in_sync
data = np.arange(4 * G, dtype=np.float32)



def epoch(dataset) -> list:
    steps = []
    for batch in dataset:
        mine = [np.asarray(rows).tolist() for rows in strategy.experimental_local_results(batch)]
        counts = strategy.run(lambda rows: np.float32(len(rows)), args=(batch,))
        steps.append({"rows": [rows for part in comm.allgather(mine) for rows in part],
                      "processed": float(strategy.reduce("SUM", counts, axis=None))})
    return steps


def options(policy: str) -> distrib.InputOptions:
    return distrib.InputOptions(auto_shard_policy=distrib.AutoShardPolicy[policy])


files = Files([data[i * G:(i + 1) * G] for i in range(4)])
batches = [data[0:G], data[G:2 * G]]
report = {"G": G,
          "FILE": epoch(strategy.experimental_distribute_dataset(files, options("FILE"))),
          "AUTO": epoch(strategy.experimental_distribute_dataset(files)),
          "OFF": epoch(strategy.experimental_distribute_dataset(batches, options("OFF"))),
          "DATA": epoch(strategy.experimental_distribute_dataset(batches, options("DATA")))}
if comm.rank == 0:
    with open(sys.argv[1], "w") as file:
        json.dump(report, file)
