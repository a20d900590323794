"""Two processes on a GPU machine under `mpirun -np 2`: one NCCL communicator spans both (they may share a GPU)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from support import assert_one_process_with_two_replicas  # noqa: E402

pytestmark = pytest.mark.gpu

HERE = pathlib.Path(__file__).resolve().parents[1] / "multi_worker"
MPIRUN = shutil.which("mpirun")


def mpirun(program: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    if MPIRUN is None:
        pytest.skip("needs an MPI launcher (mpirun) beside mpi4py: apt-get install openmpi-bin libopenmpi-dev")
    # NCCL_SOCKET_IFNAME=lo: the ranks bootstrap over loopback, also on a machine with no other network
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", NCCL_SOCKET_IFNAME=os.environ.get("NCCL_SOCKET_IFNAME", "lo"))
    env.pop("DISTRIB_BACKEND", None)  # the CUDA backend, as a user's job picks it
    return subprocess.run([MPIRUN, "-np", "2", sys.executable, str(HERE / program), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_two_processes_reduce_gather_and_update_variables_through_one_nccl_communicator(tmp_path):
    done = mpirun("one_replica_strategy.py", str(tmp_path / "report.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        report = json.loads((tmp_path / f"report.json.{rank}").read_text())
        assert report["backend"] == "cuda+mpi", report
        assert_one_process_with_two_replicas(report)


@pytest.mark.parametrize("fault, error", [("kill", "WorkerFailedError"), ("stall", "DeadlineExceededError")])
def test_a_failed_rank_gives_the_other_a_typed_error_naming_it_on_nccl(tmp_path, fault, error):
    done = mpirun("faults.py", fault, str(tmp_path / "error.json"), "5", timeout=120)
    assert done.returncode != 0  # the job ends, it does not hang
    report = json.loads((tmp_path / "error.json.0").read_text())
    assert report["type"] == error, done.stdout + done.stderr
    assert "rank 1 (pid" in report["message"]
