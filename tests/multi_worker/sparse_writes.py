"""Run under `mpirun`, or alone as one process: each replica's scatter_* of its own rows into MirroredVariables of
every aggregation; each process writes {case: every local copy's value, or the error's type} to argv[1].<rank>, so
that the test compares a job's copies with one process's of the same total replicas."""

from __future__ import annotations

import json
import sys

import numpy as np

import distrib

strategy = distrib.MultiWorkerMirroredStrategy()
report = {}
for aggregation in ("ONLY_FIRST_REPLICA", "SUM", "MEAN", "NONE"):
    for method in ("scatter_add", "scatter_sub", "scatter_update", "scatter_max", "scatter_mul"):
        with strategy.scope():
            variable = distrib.Variable(np.ones((4, 2), np.float32), aggregation=aggregation)

        def step():  # replica r writes r + 2 to rows r % 4 (and (r + 1) % 4 for odd r): repeated rows across replicas
            r = distrib.get_replica_context().replica_id_in_sync_group
            rows = np.array([r % 4, (r + 1) % 4][:1 + r % 2])
            getattr(variable, method)(distrib.IndexedSlices(np.full((len(rows), 2), r + 2, np.float32), rows))

        try:
            strategy.run(step)
            report[f"{aggregation} {method}"] = [copy.numpy().tolist() for copy in variable.values]
        except (NotImplementedError, ValueError) as error:
            report[f"{aggregation} {method}"] = type(error).__name__
with open(f"{sys.argv[1]}.{strategy.cluster_resolver.task_id}", "w") as file:
    json.dump(report, file)
