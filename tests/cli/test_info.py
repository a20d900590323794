"""`distrib info`: backend and why, GPUs and links from NVML, versions, what is missing; never failing without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from distrib.backends import detect
from distrib.cli import topology
from distrib.install_hint import pip_install

NO_NVML = "import sys; sys.modules['pynvml'] = None; from distrib.cli import main; sys.exit(main(['info']))"


def info(*flags, program=None, env=None, status=0):
    command = [sys.executable, "-c", program] if program else [sys.executable, "-m", "distrib", "info", *flags]
    # the caller's DISTRIB_* settings left out unless given: an exported DISTRIB_BACKEND=cpu names itself as the
    # reason where the tests expect detection's
    inherited = {k: v for k, v in os.environ.items() if k not in ("DISTRIB_BACKEND", "DISTRIB_CPU_REPLICAS")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**inherited, **(env or {})})
    assert result.returncode == status, result.stderr
    return result.stdout


def test_info_says_there_is_no_gpu_instead_of_failing():
    out = info()
    if detect() == "cuda":  # a GPU machine: the same command names its backend and lists the GPUs
        assert "backend: cuda (" in out and "\nGPUs:\n  GPU0: " in out
    else:
        assert "backend: cpu (CUDA unavailable:" in out
        assert "GPUs: none (NVML" in out
    assert "versions:" in out and "numpy" in out


def test_info_without_nvml_names_the_package_to_install():
    assert "pynvml is not installed" in info(program=NO_NVML)


def test_info_reports_an_environment_that_leaves_no_backend_instead_of_a_traceback():
    out = info(env={"DISTRIB_BACKEND": "gpu"}, status=1)
    assert "backend: none (DISTRIB_BACKEND must be 'cpu' or 'cuda'. Received: 'gpu'.)" in out
    assert "default devices: none" in out and "versions:" in out
    facts = json.loads(info("--json", env={"DISTRIB_BACKEND": "cpu", "DISTRIB_CPU_REPLICAS": "0"}, status=1))
    assert facts["backend"] is None and facts["default_devices"] == []
    assert facts["reason"].startswith("DISTRIB_CPU_REPLICAS must be a positive integer of at most 4096")
    # before, the log line "using the cpu backend" came first on stderr, contradicting "backend: none"
    result = subprocess.run([sys.executable, "-m", "distrib", "info"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "DISTRIB_BACKEND": "cpu", "DISTRIB_CPU_REPLICAS": "0"})
    assert result.returncode == 1 and "using the cpu backend" not in result.stderr, result.stderr


def test_every_missing_package_gets_one_pip_command_that_pip_can_read():
    out = info(program="import sys; sys.modules['ml_dtypes'] = None; sys.modules['ray'] = None; "
                       "from distrib.cli import main; sys.exit(main(['info']))")
    assert f"ml_dtypes     for bfloat16 arrays: {pip_install('train')} (or the bench, cuda12 extras)" in out
    assert f"ray           for ParameterServerStrategy: {pip_install('ps')}\n" in out


def test_info_as_json():
    facts = json.loads(info("--json"))
    if detect() == "cuda":
        assert facts["backend"] == "cuda" and facts["gpus"] and facts["gpu_problem"] is None
    else:
        assert facts["backend"] == "cpu" and facts["gpus"] == [] and facts["gpu_problem"]
    assert facts["versions"]["distrib"] and set(facts["missing"]) <= {"cupy", "pynvml", "ml_dtypes", "mpi4py", "ray",
                                                                      "rich", "matplotlib"}
    assert all(entry["extra"].startswith("distrib[") for entry in facts["missing"].values())


def test_the_link_matrix_has_nvidia_smis_layout():
    gpus = [topology.GpuInfo(i, "H100", 80 << 30, "9.0", "Gen5 x16", f"0:{i}", "0-7",
                             ["X" if i == j else "NV18" if {i, j} == {0, 1} else "SYS" for j in range(3)],
                             ["X" if i == j else "OK" for j in range(3)]) for i in range(3)]
    lines = topology.matrix(gpus).splitlines()
    assert lines[0] == "\tGPU0\tGPU1\tGPU2\tCPU Affinity"
    assert lines[1].split("\t") == ["GPU0", " X ", "NV18", "SYS", "0-7"]
    assert lines[3].split("\t") == ["GPU2", "SYS", "SYS", " X ", "0-7"]
    assert "NV#  = Connection traversing a bonded set of # NVLinks" in topology.matrix(gpus)


@pytest.mark.skipif(detect() != "cpu",
                    reason="the emulated replicas' default; GPU replicas run on threads unless a strategy asks otherwise")
def test_info_says_how_emulated_replicas_run_and_why(monkeypatch):
    monkeypatch.delenv("DISTRIB_REPLICA_EXECUTION", raising=False)
    assert json.loads(info("--json"))["replica_execution"].startswith("threads (the default;")
    assert "as `distrib train` does unless it is set" in json.loads(info("--json"))["replica_execution"]
    monkeypatch.setenv("DISTRIB_REPLICA_EXECUTION", "cooperative")
    assert "replica execution: cooperative (DISTRIB_REPLICA_EXECUTION=cooperative)" in info()
    # read in any case and spacing, as DISTRIB_BACKEND is ("Threads" was refused)
    monkeypatch.setenv("DISTRIB_REPLICA_EXECUTION", " Cooperative ")
    assert "replica execution: cooperative (DISTRIB_REPLICA_EXECUTION=cooperative)" in info()
    monkeypatch.setenv("DISTRIB_REPLICA_EXECUTION", " ")
    assert "replica execution: threads (the default;" in info()
    # a value every strategy would refuse: said, and exit status 1 (it was 0)
    monkeypatch.setenv("DISTRIB_REPLICA_EXECUTION", "fibers")
    assert ("replica execution: none (DISTRIB_REPLICA_EXECUTION must be 'threads' or 'cooperative'. Received: "
            "'fibers'.)") in info(status=1)


def test_info_names_the_mpi_library_that_mpirun_would_start(tmp_path):
    from support import MPIRUN

    versions = json.loads(info("--json"))["versions"]
    if MPIRUN is None:
        assert versions["mpi"] is None
    else:  # what `mpirun --version` says, e.g. "mpirun (Open MPI) 4.1.4"
        said = subprocess.run([MPIRUN, "--version"], capture_output=True, text=True, timeout=30).stdout
        assert versions["mpi"] == said.strip().splitlines()[0]
    hidden = json.loads(info("--json", env={"PATH": str(tmp_path)}))["versions"]  # python is run by full path
    assert hidden["mpi"] is None  # no mpirun on PATH and mpi4py.MPI not imported: nothing to name
