"""Run under `mpirun -np 2`: all-reduce steps until the job is stopped (at most four minutes); rank 0 says when it
is stepping."""

import time

import numpy as np

import distrib

strategy = distrib.MultiWorkerMirroredStrategy()
step = lambda: distrib.get_replica_context().all_reduce("SUM", np.ones(1000, np.float32))  # noqa: E731
strategy.run(step)
if strategy.cluster_resolver.task_id == 0:
    print("stepping", flush=True)
# only a net for a stop that never comes: on a loaded machine mpirun, whose two ranks spin on the cores, forwarded
# "stepping" a minute late once, and the ranks' own deadline then ended the job before the test's Ctrl-C
deadline = time.monotonic() + 240
while time.monotonic() < deadline:
    strategy.run(step)
