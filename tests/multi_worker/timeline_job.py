"""Run under `mpirun -np 2` with DISTRIB_TIMELINE set: three steps of one all_reduce each, recorded by every rank."""

import numpy as np

import distrib

strategy = distrib.MultiWorkerMirroredStrategy()
for _ in range(3):
    strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.ones(4, np.float32)))
