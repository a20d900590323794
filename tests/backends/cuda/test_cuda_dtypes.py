"""How each dtype crosses NCCL and the reduce kernel: the wire types, NCCL codes and calls of a plan."""

from __future__ import annotations


import numpy as np
import pytest

from distrib.backends.cuda import dtypes as cuda_dtypes
from distrib.plan import plan_by_size, plan_concat_split

cupy = pytest.importorskip("cupy", reason="CuPy comes with distrib[test]")



# -- dtypes on the wire -----------------------------------------------------------------------------------------------


def test_the_nccl_codes_are_the_ones_nccl_uses():
    from cupy.cuda import nccl

    if not nccl.available:
        pytest.skip("libnccl is not installed here; the codes are checked where it is")
    for name, code in cuda_dtypes.NCCL_TYPES.items():
        assert getattr(nccl, f"NCCL_{name.upper()}") == code, name
    for name, code in cuda_dtypes.NCCL_OPS.items():
        assert getattr(nccl, f"NCCL_{name}") == code, name


NEW, OLD = 22501, 2804  # NCCL 2.25.1 and 2.8.4


@pytest.mark.parametrize("dtype, nccl_type, factor", [
    ("float16", 6, 1), ("bfloat16", 9, 1), ("float32", 7, 1), ("float64", 8, 1), ("int8", 0, 1), ("uint8", 1, 1),
    ("int32", 2, 1), ("uint32", 3, 1), ("int64", 4, 1), ("uint64", 5, 1), ("complex64", 7, 2), ("complex128", 8, 2)])
def test_numeric_dtypes_sum_as_their_nccl_type(dtype, nccl_type, factor):
    assert cuda_dtypes.nccl_reduction(dtype, False, NEW, "all_reduce") == (None, nccl_type, factor, 0, False)


def test_booleans_reduce_as_bytes_with_max_which_is_numpys_logical_or():
    assert cuda_dtypes.nccl_reduction("bool", False, NEW, "all_reduce") == (None, 1, 1, 2, False)
    assert cuda_dtypes.kernel_wire("bool", "add_n") == ("bool", 1, "MAX")


@pytest.mark.parametrize("dtype, wider, code", [("int16", "int32", 2), ("uint16", "uint32", 3)])
def test_16_bit_integers_are_summed_wider_and_cast_back(dtype, wider, code):
    assert cuda_dtypes.nccl_reduction(dtype, False, NEW, "all_reduce") == (wider, code, 1, 0, False)
    wide = np.array([30000, 30000, 30000], dtype).astype(wider).sum().astype(dtype)
    assert wide == np.add(np.add(np.array(30000, dtype), np.array(30000, dtype)), np.array(30000, dtype))


def test_a_mean_uses_nccl_avg_when_the_loaded_nccl_has_it():
    assert cuda_dtypes.nccl_reduction("float32", True, NEW, "all_reduce") == (None, 7, 1, 4, False)
    assert cuda_dtypes.nccl_reduction("float32", True, cuda_dtypes.AVG_MIN_VERSION, "all_reduce").op == 4
    assert cuda_dtypes.nccl_reduction("float32", True, OLD, "all_reduce") == (None, 7, 1, 0, True)
    assert cuda_dtypes.nccl_reduction("complex64", True, OLD, "all_reduce") == (None, 7, 2, 0, True)


def test_bfloat16_needs_nccl_2_10_3():
    with pytest.raises(TypeError, match=r"^all_reduce of bfloat16 needs NCCL 2\.10\.3 or later. Received: NCCL "
                                        r"version code 2804"):
        cuda_dtypes.nccl_reduction("bfloat16", False, OLD, "all_reduce")


def test_a_mean_of_integers_is_not_the_backends_job():
    with pytest.raises(ValueError, match=r"^all_reduce takes a mean of float and complex values only"):
        cuda_dtypes.nccl_reduction("int32", True, NEW, "all_reduce")


@pytest.mark.parametrize("dtype", ["datetime64", "object", "float128" if hasattr(np, "float128") else "str"])
def test_dtypes_without_a_reduction_are_type_errors(dtype):
    name = np.dtype(dtype).name
    with pytest.raises(TypeError, match=rf"^all_reduce on the CUDA backend reduces bfloat16, bool, .* Received: "
                                        rf"dtype {name}\.$"):
        cuda_dtypes.nccl_reduction(name, False, NEW, "all_reduce")
    with pytest.raises(TypeError, match=r"^add_n on the CUDA backend reduces "):
        cuda_dtypes.kernel_wire(name, "add_n")


@pytest.mark.parametrize("num_packs", [1, 2, 3, 7])
def test_the_nccl_calls_of_a_plan_cover_its_buffer_once(num_packs):
    specs = [((3, 5), "complex64"), ((7,), "complex64"), ((), "complex64")]
    (buffer,) = plan_concat_split(specs, num_packs).buffers
    calls = cuda_dtypes.chunk_calls(buffer.chunks, itemsize=8, factor=2)
    assert len(calls) == min(num_packs, buffer.size)
    assert [offset for offset, _ in calls] == [start * 8 for start, _ in buffer.chunks]
    assert sum(count for _, count in calls) == 2 * buffer.size  # float32 pairs
    assert all(count > 0 for _, count in calls)


def test_plans_by_size_give_one_call_per_pack_and_never_mix_dtypes():
    specs = [((100,), "float16"), ((300,), "float32"), ((50,), "float16"), ((10,), "bool")]
    plan = plan_by_size(specs, 256)
    for buffer in plan.buffers:
        wire = cuda_dtypes.nccl_reduction(buffer.dtype, False, NEW, "all_reduce")
        assert cuda_dtypes.chunk_calls(buffer.chunks, np.dtype(buffer.dtype).itemsize, wire.factor) == [
            (0, buffer.size)]
    assert {b.dtype for b in plan.buffers} == {"float16", "float32", "bool"}
