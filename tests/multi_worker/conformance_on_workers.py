"""The conformance programs on a multi-worker job: a case's MirroredStrategy of as many emulated devices as the
job has replicas becomes the job's MultiWorkerMirroredStrategy, its local results gathered from every process.

`python conformance_on_workers.py REPORT` under `mpirun` runs every case that fits the job's replica count and
writes {case: outcome} to REPORT (rank 0); tests/multi_worker/job.py runs them too, with its other checks.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import numpy as np
from mpi4py import MPI

import distrib
from distrib.values import map_structure

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from test_conformance import CASES, CONFORMANCE, _error_matches, assert_matches  # noqa: E402


def everywhere(values, comm=MPI.COMM_WORLD):
    """This rank's local results joined with every other rank's, in rank order (the test's view, not the API's)."""
    return [v for part in comm.allgather(list(values)) for v in part]


class OnAllWorkers:
    """A `distrib` whose MirroredStrategy of the job's replica count of emulated devices is the job's strategy;
    local results are gathered from every process, so that a case sees what one process with all replicas returns."""

    def __init__(self, replicas: int):
        self._devices = [f"CPU:{i}" for i in range(replicas)]

    def __getattr__(self, name):
        return getattr(distrib, name)

    def MirroredStrategy(self, devices=None, **kwargs):
        if list(devices or []) != self._devices or kwargs:
            raise NotImplementedError(f"this case builds another strategy than {len(self._devices)} emulated "
                                      f"replicas")
        job = distrib.MultiWorkerMirroredStrategy()

        def local_results_of_every_process(value):
            local = distrib.MultiWorkerMirroredStrategy.experimental_local_results(job, value)
            if len(local) != len(job.extended.worker_devices):
                return local  # a value on some devices only (reduce_to onto one): as in one process
            return tuple(everywhere(map_structure(lambda leaf: np.asarray(leaf.numpy() if hasattr(leaf, "numpy")
                                                                          else leaf), list(local))))

        job.experimental_local_results = local_results_of_every_process
        return job


def run_cases(comm=MPI.COMM_WORLD) -> dict[str, str]:
    """Every conformance case's outcome on this job: "ok", "skipped: ...", "differs: ..." or "raised ..."."""
    replicas = comm.allreduce(len(distrib.MultiWorkerMirroredStrategy().extended.worker_devices))
    namespace, outcomes = OnAllWorkers(replicas), {}
    for path in CASES:
        expected = json.loads((CONFORMANCE / "expected" / f"{path.stem}.json").read_text())["result"]
        spec = importlib.util.spec_from_file_location(f"case_{path.stem}", path)
        case = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(case)
        try:
            result = case.run_distrib(namespace, np)
        except NotImplementedError as exc:
            outcomes[path.stem] = f"skipped: {exc}"
            continue
        except Exception as exc:  # noqa: BLE001 - compared with TensorFlow's error below
            ok = isinstance(expected, dict) and "error" in expected and _error_matches(exc, expected)
            outcomes[path.stem] = "ok" if ok else f"raised {type(exc).__name__}: {exc}"
            continue
        try:
            assert_matches(result, expected)
            outcomes[path.stem] = "ok"
        except AssertionError as exc:
            outcomes[path.stem] = f"differs: {exc}"
    return outcomes


if __name__ == "__main__":
    outcomes = run_cases()
    if MPI.COMM_WORLD.rank == 0:
        with open(sys.argv[1], "w") as file:
            json.dump(outcomes, file)
