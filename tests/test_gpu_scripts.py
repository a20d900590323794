"""The GPU check scripts parse, and the GPU benchmarks refuse a machine without a GPU with a clear line."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from distrib.backends import cuda_problem

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["bench/gpu_check.sh", "bench/gpu_wheels.sh"])
def test_the_gpu_shell_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_gpu_check_runs_every_gpu_benchmark_that_exists():
    text = (ROOT / "bench/gpu_check.sh").read_text()
    for script in ("bench/nccl_bench.py", "bench/input_bench.py"):
        assert script in text and (ROOT / script).is_file()
    assert "-m gpu" in text and "distrib train" in text


@pytest.mark.skipif(cuda_problem() is None, reason="this machine has a GPU: the benchmarks run instead")
@pytest.mark.parametrize("command", [["bench/nccl_bench.py"], ["bench/input_bench.py", "--gpu"]])
def test_gpu_benchmarks_without_a_gpu_exit_2_saying_what_is_missing(command):
    result = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "GPU" in result.stderr and "Traceback" not in result.stderr
