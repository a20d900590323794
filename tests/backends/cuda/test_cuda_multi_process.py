"""The multi-process CUDA backend without a GPU: late ranks named, one job-wide all-reduce, NCCL groups closed."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from distrib.plan import METHODS, NATIVE, all_reduce_plan, plan_concat_split

pytest.importorskip("cupy", reason="CuPy comes with distrib[test]")
MPIRUN = shutil.which("mpirun")
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="needs Open MPI's mpirun (.ci/run installs it)")
PROGRAM = pathlib.Path(__file__).parents[2] / "multi_worker" / "nccl_deadlines.py"
FAULTS = PROGRAM.with_name("nccl_faults.py")


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


@pytest.mark.parametrize("fault", ["stall", "kill", "stall-at-exit"])
def test_a_rank_launching_without_waiting_gets_a_typed_error_naming_a_failed_peer_and_the_job_ends(tmp_path, fault):
    # NCCL launches return at once: without a bound on how far a rank runs ahead, rank 0 would finish its loop
    # and then wait in MPI_Finalize for the stalled rank forever, or be killed by mpirun without an error
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    done = subprocess.run([MPIRUN, "-np", "2", sys.executable, str(FAULTS), fault, str(tmp_path / "error.json"), "2"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    if fault == "stall-at-exit":  # its program ended normally with the collective in flight: printed at exit
        error = next(line for line in done.stderr.splitlines() if line.startswith("distrib.errors."))
        assert error.startswith("distrib.errors.DeadlineExceededError: all_reduce across processes timed out after "
                                "2 s: rank 1 (pid "), done.stderr
        assert not (tmp_path / "error.json.0").exists()
        return
    report = json.loads((tmp_path / "error.json.0").read_text())
    if fault == "stall":
        assert report["type"] == "DeadlineExceededError"
        assert report["message"].startswith("all_reduce across processes timed out after 2 s: rank 1 (pid ")
        assert "never reached it (collective #3 of the job's collectives)" in report["message"]
    else:
        assert report["type"] == "WorkerFailedError"
        assert report["message"].startswith("rank 1 (pid ") and " died" in report["message"]
    assert report["seconds"] < 2 + 3  # within the timeout, plus the launcher's reaction
    later = (tmp_path / "error.json.0.later").read_text()
    assert later.startswith("all_reduce cannot run: this MPI job already failed.")


@pytest.mark.parametrize("method", METHODS)
def test_every_plan_method_runs_as_one_all_reduce_over_the_whole_job(monkeypatch, method):
    # pack by pack, a ring or hierarchical plan would take this process's GPUs for the whole group
    from distrib.backends.cuda.backend import CudaBackend
    from distrib.backends.cuda.multi_process import MultiProcessCudaBackend

    handed = []
    monkeypatch.setattr(CudaBackend, "execute", lambda self, plan, per_device, devices, *, timeout=None:
                        handed.append(plan) or [[None] * 2 for _ in devices])
    backend = object.__new__(MultiProcessCudaBackend)  # no GPU here: only the plan it hands on is looked at
    plan = all_reduce_plan(plan_concat_split([((6,), np.dtype("float32"))] * 2, 1), method, False, 2)
    backend.execute(plan, [[None, None]] * 2, ["GPU:0", "GPU:1"])
    (whole,) = handed
    assert whole.method == NATIVE and whole.packing is plan.packing and not whole.mean


class OneRank:
    """A one-process job's group, as JobCommunicators uses it (run the call, broadcast to itself), whose replica
    is numbered past the job's end, so that NCCL refuses it on a machine with a GPU too."""

    rank, num_replicas, first_replica = 0, 1, 1

    def __init__(self):
        self.comm = self
        self.drains = []

    def run(self, what, call, timeout):
        call()

    def bcast(self, value, root):
        return value


def test_joining_the_communicator_closes_its_nccl_group_when_it_fails():
    from cupy.cuda import nccl
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    from distrib.backends.cuda.multi_process import JobCommunicators
    from distrib.backends.cuda.nccl import Clique
    from distrib.errors import CollectiveError

    with pytest.raises((CollectiveError, CUDARuntimeError)):  # NCCL refuses rank 1 of 1; without a GPU, CUDA fails
        JobCommunicators(OneRank(), [0])._create(Clique((0,)), "all_reduce")
    with pytest.raises(nccl.NcclError):  # no group is left open to hold back this thread's later NCCL calls
        nccl.groupEnd()


class OneDeadPeer(OneRank):
    """A job whose rank 1, on this host, has died."""

    broken = None

    def dead_local_ranks(self):
        return (1,)

    def describe(self, ranks):
        return "rank 1 (pid 4242)"


class EveryPeerAlive(OneDeadPeer):
    def dead_local_ranks(self):
        return ()


def test_nccl_reporting_a_remote_error_names_the_rank_that_died_as_a_worker_failure():
    from cupy.cuda import nccl

    from distrib.backends.cuda.multi_process import JobCommunicators
    from distrib.errors import CollectiveError, WorkerFailedError

    remote = nccl.NcclError(6)  # NCCL_ERROR_REMOTE_ERROR: "remote process exited or there was a network error"
    group = OneDeadPeer()
    error = JobCommunicators(group, [0])._failed("all_reduce", (0,), remote)
    assert isinstance(error, WorkerFailedError) and error is group.broken
    assert str(error).startswith("rank 1 (pid 4242) died: all_reduce on GPUs [0] failed (")
    assert error.ranks == (1,)
    # every peer alive: NCCL's own error, as in one process
    assert type(JobCommunicators(EveryPeerAlive(), [0])._failed("all_reduce", (0,), remote)) is CollectiveError
