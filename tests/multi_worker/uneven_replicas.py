"""Run under `mpirun` with a different number of emulated replicas per process (1 and 3): each replica gets the
rows one process with every replica would give it, an all_gather of values whose lengths differ by replica gathers
every replica's in order, and a plain value's SUM is refused alike on every process.

argv[1] is the report file; each rank writes `<argv[1]>.<rank>`.
"""

import json
import sys

import numpy as np

import distrib

strategy = distrib.MultiWorkerMirroredStrategy(communication_options=distrib.CommunicationOptions(timeout_seconds=20))
rank = strategy.cluster_resolver.task_id
data = np.arange(12, dtype=np.float32)
dataset = strategy.experimental_distribute_dataset([data[0:7], data[7:12]])
report = {"replicas": strategy.num_replicas_in_sync,
          "batches": [[np.asarray(t).tolist() for t in strategy.experimental_local_results(b)] for b in dataset]}
gathered = strategy.run(lambda: distrib.get_replica_context().all_gather(  # replica r: r + 1 rows of r, [r]
    {"rows": np.full((distrib.get_replica_context().replica_id_in_sync_group + 1, 2),
                     distrib.get_replica_context().replica_id_in_sync_group, np.int32),
     "ids": np.array([distrib.get_replica_context().replica_id_in_sync_group], np.float32)}, axis=0))
report["gathered"] = [{k: np.asarray(v).tolist() for k, v in g.items()}
                      for g in strategy.experimental_local_results(gathered)]
alone = strategy.run(lambda: distrib.get_replica_context().all_gather(  # one value, as long everywhere, along axis 1
    np.full((1, 2), distrib.get_replica_context().replica_id_in_sync_group, np.int64), axis=1))
report["gathered_alone"] = [np.asarray(a).tolist() for a in strategy.experimental_local_results(alone)]
# the process of one replica sums straight from its array, the other packs its three first: the same collective,
# which their announcements must describe alike
report["sums"] = {}
for name, op, value in (("float32 SUM", "SUM", np.ones(3, np.float32)),
                        ("float32 MEAN", "MEAN", np.ones(3, np.float32)), ("int32 SUM", "SUM", np.ones(3, np.int32)),
                        ("int32 MEAN", "MEAN", np.ones(3, np.int32)), ("float16 SUM", "SUM", np.ones(3, np.float16))):
    summed = strategy.run(lambda: distrib.get_replica_context().all_reduce(op, value))
    report["sums"][name] = [np.asarray(v).tolist() for v in strategy.experimental_local_results(summed)]
try:
    strategy.extended.reduce_to("SUM", np.ones(2, np.float32), destinations="CPU:0")
except ValueError as exc:
    report["plain_sum"] = str(exc)
with open(f"{sys.argv[1]}.{rank}", "w") as file:
    json.dump(report, file)
