"""Run under `mpirun -np 2`; each rank writes to `<argv[1]>.<rank>` what it saw when rank 1's share of the input is
empty from the start: by file (the shard of a one-file dataset) and from a function (`dataset_fn` returns [] for
pipeline 1). Every rank must raise the same ValueError at the first step, and a reduce must then still pair the
ranks' collectives. A worker whose shard runs out later gets empty batches until every worker is out."""

from __future__ import annotations

import json
import sys

import numpy as np

import distrib
from sharded_files import Files

strategy = distrib.MultiWorkerMirroredStrategy(communication_options=distrib.CommunicationOptions(timeout_seconds=20))
rank = strategy.cluster_resolver.task_id
data = np.arange(12, dtype=np.float32)



def outcome(dataset) -> dict:
    steps = 0
    try:
        for batch in dataset:
            strategy.reduce("SUM", batch, axis=0)
            steps += 1
        error = None
    except ValueError as exc:
        error = str(exc)
    after = float(strategy.reduce("SUM", strategy.run(lambda: np.float32(1)), axis=None))  # still in step
    return {"steps": steps, "error": error, "after": after}


report = {
    "by file": outcome(strategy.experimental_distribute_dataset(Files([data[0:4]]))),
    "from function": outcome(strategy.distribute_datasets_from_function(
        lambda ctx: [] if ctx.input_pipeline_id == 1 else [data[0:2]])),
    "runs out later": outcome(strategy.experimental_distribute_dataset(Files([data[0:4], data[4:8], data[8:12]]))),
}
with open(f"{sys.argv[1]}.{rank}", "w") as file:
    json.dump(report, file)
