"""The GPU check scripts parse, and the GPU benchmarks refuse a machine without a GPU with a clear line."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

from distrib.backends import cuda_problem

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["bench/gpu_check.sh", "bench/gpu_wheels.sh"])
def test_the_gpu_shell_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_gpu_check_runs_every_gpu_benchmark_that_exists():
    text = (ROOT / "bench/gpu_check.sh").read_text()
    for script in ("bench/nccl_bench.py", "bench/input_bench.py", "bench/gpu_profile.py"):
        assert script in text and (ROOT / script).is_file()
    assert "-m gpu" in text and "distrib train" in text


def gpu_check(*args):
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    command = ["bash", str(ROOT / "bench/gpu_check.sh"), *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_gpu_check_stages_are_the_ones_bench_readme_documents():
    listed = [line.split()[0] for line in gpu_check("--list").stdout.splitlines()]
    readme = (ROOT / "bench/README.md").read_text().split("## gpu_check.sh")[1].split("\n## ")[0]
    documented = re.findall(r"^\| `([a-z-]+)` \|", readme, re.MULTILINE)
    assert listed == documented and "train" in listed


def test_gpu_check_refuses_an_unknown_stage_naming_the_stages():
    result = gpu_check("--stages", "versions,bench")
    assert result.returncode == 2
    assert result.stderr.startswith("gpu_check.sh: unknown stage 'bench'; the stages are install,versions,")


@pytest.mark.skipif(cuda_problem() is None, reason="this machine has a GPU: the stages would run for real")
def test_gpu_check_without_a_gpu_runs_versions_and_skips_the_gpu_stages_into_one_archive(tmp_path):
    out = tmp_path / "out"
    result = gpu_check("--stages", "versions,train", "--out", str(out), "--logs", str(tmp_path / "logs"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gpu-results.tgz", "summary.txt"]
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("PASS  versions")
    assert summary[1].startswith("SKIP  train  (needs the CUDA backend: ")
    with tarfile.open(out / "gpu-results.tgz") as archive:
        assert {"logs/versions.txt", "logs/summary.txt"} <= set(archive.getnames())


@pytest.mark.skipif(cuda_problem() is None, reason="this machine has a GPU: the benchmarks run instead")
@pytest.mark.parametrize("command", [["bench/nccl_bench.py"], ["bench/input_bench.py", "--gpu"]])
def test_gpu_benchmarks_without_a_gpu_exit_2_saying_what_is_missing(command):
    result = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "GPU" in result.stderr and "Traceback" not in result.stderr


def test_gpu_check_skips_a_step_the_budget_has_no_time_left_for(tmp_path):
    result = gpu_check("--stages", "versions", "--budget", "12", "--out", str(tmp_path / "out"),
                       "--logs", str(tmp_path / "logs"))
    assert result.returncode == 0, result.stdout + result.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert summary.startswith("SKIP  versions  (no time left in the --budget of 12 s)")


def _distribution(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip())[0].lower().replace("_", "-")


def test_the_wheels_carried_to_gpu_machines_cover_every_runtime_dependency():
    # the GPU machines install with --no-deps and no index: a dependency missing from the list fails the suite there
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = [line.split("#")[0] for line in (ROOT / "bench/gpu_wheels.txt").read_text().splitlines()]
    carried = {_distribution(line) for line in lines if line.strip()}
    runtime = {_distribution(r) for r in project["dependencies"]} - {"numpy"}  # the image's, which CuPy is built on
    assert runtime <= carried
    assert carried <= runtime | {_distribution(r) for r in project["optional-dependencies"]["test"]}


def test_the_device_calls_bench_readme_plans_cover_every_stage_within_their_limits():
    listed = [line.split()[0] for line in gpu_check("--list").stdout.splitlines()]
    readme = (ROOT / "bench/README.md").read_text().split("## gpu_check.sh")[1].split("\n## ")[0]
    calls = re.findall(r'^# call \d: carry=\["wheels"\], timeout_s=(\d+)\n'
                       r'bash bench/gpu_check\.sh --stages (\S+) --budget (\d+)$', readme, re.MULTILINE)
    assert len(calls) == 2, calls
    planned = []
    for timeout_s, stages, budget in calls:
        stages = stages.split(",")
        assert stages[0] == "install" and set(stages) <= set(listed)
        # the script ends within about 5 s of its budget: its steps keep 15 s for --kill-after and the archive
        assert int(budget) + 25 <= int(timeout_s)
        planned += stages[1:]
        if "full-suite" in stages:
            assert stages[-1] == "full-suite"  # a slow suite cannot starve the benchmarks of its call
    assert sorted(planned) == sorted(set(listed) - {"install"})  # every stage once
    assert sum(int(timeout_s) for timeout_s, _, _ in calls) <= 15 * 60 - 120  # the machine's start fits beside
    assert (ROOT / "bench/gpu_wheels.sh").is_file() and "wheels/" in (ROOT / ".gitignore").read_text()


FAKE_PYTHON = """#!/usr/bin/env bash
# a GPU machine's python for gpu_check.sh: cuda_problem() finds nothing, and every command is recorded, not run
[[ $1 == -c ]] && exit 0
echo "rank=${OMPI_COMM_WORLD_RANK:-none} local=${OMPI_COMM_WORLD_LOCAL_RANK:-none} hostid=${NCCL_HOSTID:-unset}\
 backend=${DISTRIB_BACKEND:-unset} $*" >>"$RECORD"
"""


def fake_gpu_run(tmp_path, stages):
    tmp_path.mkdir(exist_ok=True)
    python, record = tmp_path / "python", tmp_path / "record.txt"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    # a shared host id or a forced backend in the caller's environment must not reach the ranks
    env = {**os.environ, "PYTHON": str(python), "RECORD": str(record), "NCCL_HOSTID": "shared",
           "DISTRIB_BACKEND": "cpu"}
    env.pop("OUT", None)
    result = subprocess.run(["bash", str(ROOT / "bench/gpu_check.sh"), "--stages", stages, "--budget", "200",
                             "--logs", str(tmp_path / "logs")], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return record.read_text().splitlines()


def test_gpu_tests_leave_the_multi_process_tests_to_their_stage_only_when_it_runs(tmp_path):
    alone = fake_gpu_run(tmp_path / "alone", "gpu-tests")
    assert len(alone) == 1 and "-m pytest" in alone[0] and "--ignore" not in alone[0]
    both = fake_gpu_run(tmp_path / "both", "gpu-tests,multi-process")
    assert "--ignore=tests/gpu/test_gpu_multi_process.py" in both[0]
    if shutil.which("mpirun") is not None:
        assert "tests/gpu/test_gpu_multi_process.py" in both[1] and "--ignore" not in both[1]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (Open MPI)")
def test_the_multi_process_bench_runs_two_ranks_without_g_each_free_to_take_its_own_nccl_host_id(tmp_path):
    lines = fake_gpu_run(tmp_path, "multi-process")
    tests, ranks = lines[0], sorted(lines[1:])
    assert tests.startswith("rank=none local=none hostid=unset backend=unset -m pytest ")
    assert tests.endswith(" tests/gpu/test_gpu_multi_process.py")
    assert [line.split(" -m ")[0] for line in ranks] == ["rank=0 local=0 hostid=unset backend=unset",
                                                         "rank=1 local=1 hostid=unset backend=unset"]
    for line in ranks:
        args = line.split(" -m ", 1)[1].split()
        # distrib/cli/bench/job.py refuses -g under mpirun on GPUs: each rank drives its share of the GPUs
        assert args[:3] == ["distrib", "bench", "all_reduce"] and "-g" not in args and "--ngpus" not in args
