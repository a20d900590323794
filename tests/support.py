"""Helpers shared by the tests: other libraries' arrays, PyTorch or a skip, read-only results, four replicas."""

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
from typing import Iterator

import numpy as np
import pytest

import distrib
from distrib.backends.cpu import CpuBackend

DEVICES = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
MPIRUN = shutil.which("mpirun")
# Open MPI 5's mpirun (PRRTE) shows nothing the ranks print once it is interrupted (Ctrl-C)
OPEN_MPI_5 = MPIRUN is not None and "(Open MPI) 5." in subprocess.run([MPIRUN, "--version"], capture_output=True,
                                                                      text=True).stdout
needs_mpirun = pytest.mark.skipif(MPIRUN is None, reason="needs Open MPI's mpirun (apt-get install openmpi-bin "
                                                         "libopenmpi-dev; .ci/run installs it)")


def mpirun_env(**extra: str) -> dict:
    """The environment of the tests' `mpirun -np 2` jobs: 2 emulated replicas per process on every machine (on one
    with a GPU, detection would pick NCCL), mpirun allowed as root and past the core count (Open MPI 4's variable
    and Open MPI 5's); plus `extra`."""
    env = dict(os.environ, DISTRIB_BACKEND="cpu", DISTRIB_CPU_REPLICAS="2", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    env.update(extra)
    return env


def default_sigint() -> None:
    """A child process's `preexec_fn`: SIGINT back to its default, so that the child's Python turns Ctrl-C into
    KeyboardInterrupt even when the tests run with SIGINT ignored (a shell starts background jobs that way)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def interruptible(command: list[str], env: dict | None = None) -> Iterator[subprocess.Popen]:
    """`command` as a child process whose Python turns SIGINT into KeyboardInterrupt (see default_sigint), with
    text pipes; killed on the way out if it is still running."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=default_sigint, env=env)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def per_replica(strategy, fn):
    """A PerReplica holding fn(replica_id) on each replica."""
    return strategy.experimental_distribute_values_from_function(lambda ctx: fn(ctx.replica_id_in_sync_group))


def local(strategy, value):
    return strategy.experimental_local_results(value)


def replica_id():
    return distrib.get_replica_context().replica_id_in_sync_group


def run_joined_by_replica(strategy, joining_replica: int = 0) -> list:
    """Runs a step in which replica `joining_replica` starts a thread named "helper" that calls `strategy.run`,
    and joins it; returns the ContextErrors the helper's run raised (the run cannot start: it would wait for
    the replica that waits for it)."""
    import threading

    errors = []

    def helper():
        try:
            strategy.run(lambda: None)
        except distrib.errors.ContextError as exc:
            errors.append(exc)

    def step():
        if replica_id() == joining_replica:
            thread = threading.Thread(target=helper, name="helper")
            thread.start()
            thread.join()

    strategy.run(step)
    return errors


def blocks_of(strategy):
    """Replica r holds [[0, 1, 2], [3, 4, 5]] + 10 r."""
    return per_replica(strategy, lambda r: np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * r)


def overwrite(array: np.ndarray, value) -> bool:
    """Writes `value` into every element; False when the array is read-only (immutable, like a tensor)."""
    if not array.flags.writeable:
        with pytest.raises(ValueError):
            array[...] = value
        return False
    array[...] = value
    return True


class CallCountingBackend(CpuBackend):
    """The real CPU emulator, recording each all_gather, gather_rows and add_n it runs, with the dtype it moves."""

    def __init__(self):
        super().__init__()
        self.calls = []  # (method, dtype name) per call

    def all_gather(self, flats, devices, *, timeout=None):
        self.calls.append(("all_gather", flats[0].dtype.name))
        return super().all_gather(flats, devices, timeout=timeout)

    def gather_rows(self, rows, *, timeout=None):
        self.calls.append(("gather_rows", rows.dtype.name))
        return super().gather_rows(rows, timeout=timeout)

    def add_n(self, arrays, device):
        self.calls.append(("add_n", np.result_type(*arrays).name))
        return super().add_n(arrays, device)

    def counted(self, method):
        """The dtypes of the `method` calls so far, in call order."""
        return [dtype for name, dtype in self.calls if name == method]


class DLPackOnly:
    """An array from another library that exports itself only through DLPack."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


class CupyLike:
    """A CuPy array as the emulator sees one, without a GPU: `__cuda_array_interface__`, a CUDA DLPack device, and
    `get()`, CuPy's copy to the host."""

    def __init__(self, array, device_id=0):
        self._array, self._device_id = np.asarray(array), device_id

    @property
    def __cuda_array_interface__(self):
        return {"shape": self._array.shape, "typestr": self._array.dtype.str, "data": (0, False), "version": 3}

    def __dlpack_device__(self):
        return 2, self._device_id  # kDLCUDA

    def __dlpack__(self, **kwargs):
        raise BufferError("NumPy cannot read CUDA memory through DLPack")

    def get(self):
        return self._array.copy()


class CudaDLPack:
    """An array on a CUDA device that speaks only DLPack and `__array__`, which copies it to the host (as JAX's
    arrays on a GPU do)."""

    def __init__(self, array, device_id=0):
        self._array, self._device_id = np.asarray(array), device_id

    def __dlpack_device__(self):
        return 2, self._device_id  # kDLCUDA

    def __dlpack__(self, **kwargs):
        raise BufferError("NumPy cannot read CUDA memory through DLPack")

    def __array__(self, dtype=None, copy=None):
        return self._array.copy()


class CudaInterfaceOnly:
    """A GPU array that speaks only `__cuda_array_interface__` (as Numba's device arrays)."""

    def __init__(self, array):
        self._array = np.asarray(array)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self._array.shape, "typestr": self._array.dtype.str, "data": (0, False), "version": 3}

    def copy_to_host(self):
        return self._array.copy()


def import_torch():
    """PyTorch, or a skip saying why it is missing (.ci/run installs the CPU build when PyTorch's index answers)."""
    try:
        import torch
    except Exception as exc:  # absent, or a build that cannot load here (a CUDA build without its libraries)
        pytest.skip(f"PyTorch does not import here ({type(exc).__name__}: {exc}); .ci/run installs the CPU build "
                    "(pip install torch --index-url https://download.pytorch.org/whl/cpu)")
    return torch


def assert_one_process_with_two_replicas(report: dict) -> None:
    """What a rank of `mpirun -np 2 tests/multi_worker/one_replica_strategy.py` saw is what one process with two
    replicas computes (replica r contributes r + 1, or arange(4) * (r + 1))."""
    assert report["replicas"] == 2, report
    assert report["sum"] == [0.0, 3.0, 6.0, 9.0]
    assert report["mean"] == [1.5] * 3
    assert report["int_sum"] == [1, 20]
    assert report["gather"] == [0, 0, 1, 1]
    assert report["large"] == {"min": 3.0, "max": 3.0, "size": 16 << 20}
    assert report["reduce_mean_axis0"] == [0.5, 0.5]
    assert report["initial"] == {"sum": 7.0, "mean": 7.0, "first": 7.0}  # rank 0's initial value, broadcast
    # each replica added replica id + 1: summed, averaged, or replica 0's, the same on both ranks
    assert report["after_updates"] == {"sum": 10.0, "mean": 8.5, "first": 8.0}
    assert report["reduce_of_a_zero_beside_a_one"] == 1.0  # replica 0's 0 plus replica 1's 1
    assert report["sum_after_adding_zero_and_one"] == 11.0


ROOT = pathlib.Path(__file__).resolve().parents[1]


def copy_source_tree(destination: pathlib.Path) -> pathlib.Path:
    """What a build of distrib reads (pyproject.toml, setup.py, README.md, distrib/, kernels/), copied into
    `destination`, which is returned: builds there leave nothing in the clone."""
    destination.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, destination / name)
    for folder in ("distrib", "kernels"):
        shutil.copytree(ROOT / folder, destination / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return destination


def train_refusal(capsys, flags: list[str]) -> str:
    """The one line `distrib train` prints when it refuses `flags` with exit status 2."""
    from distrib.cli.train import main as train_main

    with pytest.raises(SystemExit) as exit_info:
        train_main(flags)
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("distrib train: error: ")
    return line.removeprefix("distrib train: error: ")
