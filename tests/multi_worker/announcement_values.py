"""Run under `mpirun -np 2` with DISTRIB_MPI_ANNOUNCEMENTS set: each rank writes to argv[1].<rank> how its
collectives are announced to the peer on its host ("shared-memory" or "messages"), or the error that refused the
variable, after one all-reduce (the channel must work whichever it is)."""

import json
import os
import sys

import numpy as np

import distrib

try:
    strategy = distrib.MultiWorkerMirroredStrategy()
except ValueError as exc:
    report = {"error": f"{type(exc).__name__}: {exc}"}
else:
    channel = strategy.extended.backend.group.collectives
    report = {"announcements": "shared-memory" if channel._near else "messages",
              "sum": strategy.reduce("SUM", strategy.run(lambda: np.float32(1)), axis=None).tolist()}
with open(f"{sys.argv[1]}.{os.environ['OMPI_COMM_WORLD_RANK']}", "w") as file:
    json.dump(report, file)
