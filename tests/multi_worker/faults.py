"""Run under `mpirun -np 2`: rank 1 fails (argv[1]: "kill" = SIGKILL itself, "stall" = sleep) at the 3rd step;
rank 0 must raise a typed error naming rank 1, which it writes to the JSON file argv[2]."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

import distrib

mode, report_path = sys.argv[1], sys.argv[2]
strategy = distrib.MultiWorkerMirroredStrategy(
    communication_options=distrib.CommunicationOptions(timeout_seconds=float(sys.argv[3])))
rank = strategy.cluster_resolver.task_id


def step():
    return distrib.get_replica_context().all_reduce("SUM", np.ones(1000, np.float32))


began = time.monotonic()
try:
    for i in range(5):
        if i == 2 and rank == 1:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        strategy.run(step)
        began = time.monotonic()
except distrib.errors.DistribError as exc:
    report_path += f".{rank}"
    with open(report_path, "w") as file:
        json.dump({"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - began,
                   "missing_ranks": list(getattr(exc, "missing_ranks", ())), "ranks": list(getattr(exc, "ranks", ()))}, file)
    try:  # the job is broken: a later collective fails at once instead of waiting again
        strategy.run(step)
    except distrib.errors.WorkerFailedError as later:
        with open(report_path + ".later", "w") as file:
            file.write(str(later))
    raise
