"""Run under `mpirun -np 2` with argv[1] a case and argv[2] a JSON path: each rank sets a TF_CONFIG for the case,
makes a MultiWorkerMirroredStrategy from a TFConfigClusterResolver, and writes to `<path>.<rank>` what it made of
it: its task and should_checkpoint, or the error the strategy raised."""

from __future__ import annotations

import json
import os
import sys

import distrib
from distrib.cluster_resolver import TFConfigClusterResolver

rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
case, path = sys.argv[1], sys.argv[2]
CONFIGS = {
    "in rank order": {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": rank}},
    "swapped": {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1 - rank}},
    "a chief": {"cluster": {"chief": ["c:1"], "worker": ["a:1"]},
                "task": {"type": "chief" if rank == 0 else "worker", "index": 0}},
    "an evaluator": {"cluster": {"worker": ["a:1", "b:1"], "evaluator": ["e:1"]},
                     "task": {"type": "evaluator" if rank == 1 else "worker", "index": 0}},
}
os.environ["TF_CONFIG"] = json.dumps(CONFIGS[case])
try:
    strategy = distrib.MultiWorkerMirroredStrategy(TFConfigClusterResolver())
    resolver = strategy.cluster_resolver
    outcome = {"task": f"{resolver.task_type}:{resolver.task_id}", "chief": strategy.extended.should_checkpoint}
except ValueError as error:
    outcome = {"error": str(error)}
with open(f"{path}.{rank}", "w") as file:
    json.dump(outcome, file)
