"""Run under `mpirun` with a different number of emulated replicas per process (1 and 3): each replica gets the
rows one process with every replica would give it, an all_gather of values whose lengths differ by replica gathers
every replica's in order; the process of one replica gets plain values from `run`, and they reduce, write
variables and train as the other process's PerReplica values do (a plain value counts as each local replica's, on
every process alike).

argv[1] is the report file; each rank writes `<argv[1]>.<rank>`.
"""

import json
import os
import sys

import numpy as np

import distrib

sys.path.insert(0, os.path.dirname(__file__))
import training  # noqa: E402

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
ids = strategy.run(lambda: np.float32(distrib.get_replica_context().replica_id_in_sync_group + 1))
report["reduced"] = [float(strategy.reduce(op, ids, axis=None)) for op in ("SUM", "MEAN")]
with strategy.scope():
    written = [distrib.Variable(np.float32(0), aggregation=aggregation)
               for aggregation in (distrib.VariableAggregation.SUM, distrib.VariableAggregation.MEAN)]
strategy.run(lambda: [v.assign(np.float32(distrib.get_replica_context().replica_id_in_sync_group + 1))
                      for v in written])
report["written"] = [float(v.numpy()) for v in written]
merged = strategy.run(lambda: distrib.get_replica_context().merge_call(  # onto the value itself: a lone replica's
    lambda s, v: s.extended.reduce_to("MEAN", v, destinations=v),          # is a NumPy scalar there
    args=(np.float32(distrib.get_replica_context().replica_id_in_sync_group + 1),)))
report["merged"] = [float(v) for v in strategy.experimental_local_results(merged)]
report["constant"] = [float(strategy.reduce(op, np.float32(2), axis=None)) for op in ("SUM", "MEAN")]
w, b, optimizer = training.build(strategy, seed=rank)
report["losses"] = training.train(strategy, w, b, optimizer, training.batches())
report["w"], report["b"] = w.numpy().tolist(), float(b.numpy())
with open(f"{sys.argv[1]}.{rank}", "w") as file:
    json.dump(report, file)
