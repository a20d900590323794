"""The CUDA backend across MPI processes, without a GPU: a collective past its deadline names the late ranks."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("cupy", reason="CuPy comes with distrib[test]")
MPIRUN = shutil.which("mpirun")
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="needs Open MPI's mpirun (.ci/run installs it)")
PROGRAM = pathlib.Path(__file__).parents[2] / "multi_worker" / "nccl_deadlines.py"


def test_a_collective_a_rank_never_launched_names_it_and_one_every_rank_launched_says_so(tmp_path):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    subprocess.run([MPIRUN, "-np", "2", sys.executable, str(PROGRAM), str(tmp_path / "report.json")], env=env,
                   capture_output=True, text=True, timeout=60)
    report = json.loads((tmp_path / "report.json").read_text())
    stalled = report["stalled"]
    assert stalled["type"] == "DeadlineExceededError"
    assert stalled["message"].startswith("broadcast across processes timed out after 1 s: rank 1 (pid ")
    assert "never reached it (collective #2 of the job's collectives)" in stalled["message"]
    assert stalled["missing_ranks"] == [1] and stalled["missing_replicas"] == [1]
    launched = report["launched_by_all"]
    assert launched["type"] == "DeadlineExceededError" and launched["missing_ranks"] == []
    assert launched["message"].startswith("all_reduce did not complete within 1 s on GPUs [0]")
    assert "Every rank launched it (collective #1" in launched["message"]
    assert report["aborted"] == ["all_reduce", "broadcast"]  # both collectives' communicators were aborted
    assert report["later"].startswith("WorkerFailedError: barrier cannot run: this MPI job already failed.")
