"""CUDA torch tensors on the CUDA backend: read in place through DLPack, reduced on the GPU; refused by the emulator."""

from __future__ import annotations

import numpy as np
import pytest

import distrib
from support import import_torch

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")


@pytest.fixture(scope="module")
def torch():
    torch = import_torch()
    if not torch.cuda.is_available():
        pytest.skip(f"this PyTorch build ({torch.__version__}) has no CUDA")
    return torch


@pytest.fixture(scope="module")
def strategy():
    return distrib.MirroredStrategy(["GPU:0", "GPU:0"])


def test_cuda_tensors_become_cupy_arrays_over_the_same_memory(torch):
    from distrib.backends.cuda.arrays import as_cupy, on_gpu

    tensor = torch.arange(6.0, device="cuda", requires_grad=True).reshape(2, 3)
    assert on_gpu(tensor)
    array = as_cupy(tensor)
    assert array.data.ptr == tensor.data_ptr() and array.get().tolist() == tensor.tolist()
    half = torch.tensor([0.5, -2.0], device="cuda", dtype=torch.bfloat16)
    viewed = as_cupy(half)
    assert viewed.dtype == np.dtype(ml_dtypes.bfloat16) and viewed.data.ptr == half.data_ptr()
    assert viewed.get().astype(np.float32).tolist() == [0.5, -2.0]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64"])
def test_cuda_tensors_all_reduce_on_the_gpu(strategy, torch, dtype):
    def replica():
        r = distrib.get_replica_context().replica_id_in_sync_group
        tensor = (torch.arange(6, device="cuda") + r).to(getattr(torch, dtype)).reshape(3, 2).T
        return distrib.get_replica_context().all_reduce("SUM", tensor.requires_grad_(tensor.is_floating_point()))

    results = strategy.experimental_local_results(strategy.run(replica))
    expected = (2 * np.arange(6) + 1).reshape(3, 2).T
    for result in results:
        assert isinstance(result, cupy.ndarray) and result.dtype.name == dtype
        assert result.get().astype(np.float64).tolist() == expected.tolist()


def test_work_queued_on_torchs_stream_finishes_before_the_reduction_reads_it(strategy, torch):
    x = torch.randn(2048, 2048, device="cuda")
    product = x @ x  # queued on torch's stream; the reduction runs on the backend's
    out = strategy.run(lambda: distrib.get_replica_context().all_reduce("MEAN", product))
    np.testing.assert_allclose(strategy.experimental_local_results(out)[0].get(), product.cpu().numpy(), rtol=1e-6)


def test_strategy_reduce_of_cuda_tensors_returns_numpy(strategy, torch):
    values = strategy.experimental_distribute_values_from_function(lambda ctx: torch.ones(3, device="cuda"))
    result = strategy.reduce("SUM", values, axis=None)
    assert type(result) is np.ndarray and result.tolist() == [2.0, 2.0, 2.0]


def test_the_emulator_refuses_cuda_tensors_saying_what_to_do(torch):
    emulator = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    tensor = torch.ones(3, device="cuda")
    with pytest.raises(TypeError, match=r"The CPU emulator reads arrays in host memory; it does not copy device "
                                        r"memory to the host at every step. Received: a torch.Tensor on cuda:0; "
                                        r"pass tensor.cpu\(\)"):
        emulator.run(lambda: distrib.get_replica_context().all_reduce("SUM", tensor))


def test_a_dataset_of_cuda_tensors_stays_on_the_gpu(strategy, torch, monkeypatch):
    backend = strategy.extended.backend

    def no_host_copy(array):
        raise AssertionError("a CUDA tensor of the dataset went through host memory")

    monkeypatch.setattr(backend, "to_host", no_host_copy)
    batch = torch.arange(12.0, device="cuda").reshape(6, 2)
    (per_replica,) = list(strategy.experimental_distribute_dataset([batch]))
    parts = strategy.experimental_local_results(per_replica)
    assert all(isinstance(part, cupy.ndarray) for part in parts)
    monkeypatch.undo()
    np.testing.assert_array_equal(np.concatenate([part.get() for part in parts]), batch.cpu().numpy())
