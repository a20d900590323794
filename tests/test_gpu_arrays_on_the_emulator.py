"""GPU arrays given to the CPU emulator (CuPy, CUDA torch tensors, any producer of `__cuda_array_interface__` or of
CUDA DLPack): one TypeError wherever they enter, saying how to copy them to the host or to use GPU devices, instead
of a device-to-host copy at every step. No GPU is needed: stand-ins speak the protocols as GPU arrays do."""

from __future__ import annotations

import numpy as np
import pytest

import distrib
from distrib.backends.cpu import to_numpy
from distrib.backends.device_memory import gpu_location
from support import CudaDLPack, CudaInterfaceOnly, CupyLike, DLPackOnly, import_torch, per_replica

REFUSED = r"The CPU emulator reads arrays in host memory; it does not copy device memory to the host at every step. "


@pytest.fixture(scope="module")
def strategy():
    return distrib.MirroredStrategy(["CPU:0", "CPU:1"])


@pytest.mark.parametrize("array, received", [
    (CupyLike(np.ones(3)), r"Received: a support.CupyLike on cuda:0; pass array.get\(\), or name GPU devices"),
    (CudaDLPack(np.ones(3), device_id=1), r"Received: a support.CudaDLPack on cuda:1; pass a copy in host memory"),
    (CudaInterfaceOnly(np.ones(3)), r"Received: a support.CudaInterfaceOnly on a CUDA device; pass a copy in host"),
], ids=["cupy-like", "dlpack", "cuda-array-interface"])
def test_every_kind_of_gpu_array_is_refused_naming_its_type_and_device(array, received):
    with pytest.raises(TypeError, match=REFUSED + received):
        to_numpy(array)


def test_a_real_cupy_array_is_refused_without_a_gpu_or_a_driver():
    cupy = pytest.importorskip("cupy", reason="CuPy comes with distrib[test]")
    host = np.zeros(4, np.float32)  # CuPy over host memory: the array exists, reading its device needs a driver
    memory = cupy.cuda.memory.UnownedMemory(host.ctypes.data, host.nbytes, host, device_id=0)
    array = cupy.ndarray((4,), np.float32, memptr=cupy.cuda.memory.MemoryPointer(memory, 0))
    with pytest.raises(TypeError, match=REFUSED + r"Received: a cupy.ndarray on (cuda:0|a CUDA device); pass "
                                                  r"array.get\(\)"):
        to_numpy(array)


def test_host_arrays_are_not_gpu_arrays():
    assert gpu_location(np.ones(3)) is None
    assert gpu_location(DLPackOnly(np.ones(3))) is None  # DLPack on the CPU
    assert gpu_location([1.0, 2.0]) is None and gpu_location(3.0) is None


@pytest.mark.parametrize("enter", [
    lambda s, a: s.run(lambda: distrib.get_replica_context().all_reduce("SUM", a)),
    lambda s, a: s.reduce("SUM", per_replica(s, lambda r: a), axis=None),
    lambda s, a: s.reduce("MEAN", per_replica(s, lambda r: a), axis=0),
    lambda s, a: s.gather(per_replica(s, lambda r: a), axis=0),
    lambda s, a: s.extended.reduce_to("SUM", per_replica(s, lambda r: a), "CPU:0"),
], ids=["all_reduce", "reduce", "reduce-axis", "gather", "reduce_to"])
def test_the_emulator_refuses_a_gpu_array_wherever_it_enters(strategy, enter):
    with pytest.raises(TypeError, match=REFUSED):
        enter(strategy, CupyLike(np.ones(3, np.float32)))


def test_a_variable_refuses_a_gpu_array_as_its_value(strategy):
    with strategy.scope():
        with pytest.raises(TypeError, match=REFUSED):
            distrib.Variable(CupyLike(np.ones(3, np.float32)))
        v = distrib.Variable(np.zeros(3, np.float32))
    with pytest.raises(TypeError, match=REFUSED):
        v.assign(CudaDLPack(np.ones(3, np.float32)))
    assert v.numpy().tolist() == [0.0, 0.0, 0.0]


def test_a_dataset_of_gpu_arrays_is_refused_naming_the_path(strategy):
    dataset = [{"x": CupyLike(np.ones((4, 2), np.float32))}]
    with pytest.raises(TypeError, match=REFUSED + r".* At path \['x'\] of a dataset element."):
        next(iter(strategy.experimental_distribute_dataset(dataset)))


def test_a_gpu_array_copied_to_the_host_is_taken(strategy):
    out = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", CupyLike(np.ones(3)).get()))
    assert strategy.experimental_local_results(out)[0].tolist() == [2.0, 2.0, 2.0]


def test_a_torch_tensor_on_the_cpu_is_read_in_place():
    torch = import_torch()
    tensor = torch.ones(3)
    assert gpu_location(tensor) is None
    assert np.shares_memory(to_numpy(tensor), tensor.numpy())
