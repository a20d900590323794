"""torch tensors made ready for DLPack (both backends' door for them), checked with CPU tensors; no GPU needed."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from distrib.backends.torch_tensors import exportable, is_torch_tensor
from support import DLPackOnly, import_torch

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes (NumPy's bfloat16) comes with distrib[test]")


@pytest.fixture(scope="module")
def torch():
    return import_torch()


def read(tensor) -> np.ndarray:
    """What a backend reads: the exported tensor through DLPack, viewed as its NumPy dtype."""
    exported, dtype = exportable(tensor)
    array = np.from_dlpack(exported)
    return array if dtype is None else array.view(dtype)


def test_torch_tensors_and_their_subclasses_are_recognised(torch):
    class Tagged(torch.Tensor):
        pass

    assert is_torch_tensor(torch.ones(1)) and is_torch_tensor(torch.nn.Parameter(torch.ones(1)))
    assert is_torch_tensor(torch.ones(1).as_subclass(Tagged))
    assert not any(is_torch_tensor(v) for v in (np.ones(1), DLPackOnly(np.ones(1)), 1.0, [1.0]))


def test_a_tensor_that_requires_grad_exports_its_values_without_a_copy(torch):
    tensor = torch.arange(4.0, requires_grad=True)
    with pytest.raises((BufferError, RuntimeError)):
        tensor.__dlpack__()  # torch refuses: the reason for detaching first
    array = read(tensor)
    with torch.no_grad():
        tensor[0] = 7.0
    assert array.tolist() == [7.0, 1.0, 2.0, 3.0]  # the tensor's memory, not a copy


@pytest.mark.parametrize("name, bits", [("bfloat16", "int16"), ("float8_e4m3fn", "uint8"), ("float8_e5m2", "uint8")])
def test_dtypes_dlpack_lacks_travel_as_integers_viewed_as_ml_dtypes(torch, name, bits):
    tensor = torch.tensor([0.5, -2.0, 3.0]).to(getattr(torch, name))
    exported, dtype = exportable(tensor)
    assert exported.dtype == getattr(torch, bits) and exported.data_ptr() == tensor.data_ptr()
    assert dtype == np.dtype(getattr(ml_dtypes, name))
    assert read(tensor).astype(np.float32).tolist() == [0.5, -2.0, 3.0]


def test_strided_tensors_export_in_place_and_lazy_views_resolve(torch):
    base = torch.arange(6.0).reshape(2, 3)
    transposed = read(base.T)
    assert transposed.shape == (3, 2) and np.shares_memory(transposed, read(base))
    assert transposed.tolist() == base.T.tolist()
    assert read(torch.tensor([1 + 2j]).conj()).tolist() == [1 - 2j]  # torch refuses to export a conjugate bit
    negated = torch.tensor([1 + 2j]).conj().imag  # a lazy negation, which torch exports with the sign dropped
    assert negated.is_neg() and read(negated).tolist() == [-2.0]
    assert read(torch.tensor(2.5)).shape == ()


def test_importing_the_backends_does_not_import_torch():
    program = ("import sys, distrib, distrib.backends.torch_tensors, distrib.backends.cpu\n"
               "try:\n    import distrib.backends.cuda.arrays\nexcept ImportError:\n    pass  # no CuPy\n"
               "s = distrib.MirroredStrategy(['CPU:0', 'CPU:1'])\n"
               "s.reduce('SUM', s.run(lambda: distrib.get_replica_context().all_reduce('SUM', 1.0)), axis=None)\n"
               "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", program], check=True, capture_output=True, timeout=120)


def test_cpu_tensors_are_not_gpu_arrays_to_the_cuda_backend(torch):
    arrays = pytest.importorskip("distrib.backends.cuda.arrays", reason="CuPy comes with distrib[test]")
    for tensor in (torch.ones(2), torch.ones(2, requires_grad=True), torch.ones(2, dtype=torch.bfloat16)):
        assert not arrays.on_gpu(tensor)
