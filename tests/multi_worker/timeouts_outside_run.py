"""Run under `mpirun -np 2`: the strategy's collective timeout (1 s) bounds the collectives made outside `run` too.

argv[1] names the API; it is called once on both ranks, then rank 1 sleeps instead of calling it again, and rank 0
writes to the JSON file argv[2] the error it got and how long it waited.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import distrib

api, report_path = sys.argv[1], sys.argv[2]
strategy = distrib.MultiWorkerMirroredStrategy(
    communication_options=distrib.CommunicationOptions(timeout_seconds=1))
extended = strategy.extended
values = strategy.experimental_distribute_values_from_function(lambda ctx: np.full(3, 1.0, np.float32))
calls = {
    "Strategy.reduce": lambda: strategy.reduce("MEAN", values, axis=None),
    "Strategy.reduce along an axis": lambda: strategy.reduce("SUM", values, axis=0),
    "Strategy.gather": lambda: strategy.gather(values, axis=0),
    "broadcast_to": lambda: extended.broadcast_to(np.ones(3, np.float32), values),
    "reduce_to a device": lambda: extended.reduce_to("SUM", values, "CPU:0"),
}
calls[api]()
if strategy.cluster_resolver.task_id == 1:
    time.sleep(30)  # the job ends before: rank 0's error aborts it
    sys.exit(0)
began = time.monotonic()
try:
    calls[api]()
except distrib.errors.DeadlineExceededError as exc:
    with open(report_path, "w") as file:
        json.dump({"seconds": time.monotonic() - began, "missing_ranks": list(exc.missing_ranks),
                   "message": str(exc)}, file)
    raise
