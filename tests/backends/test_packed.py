"""Executing an AllReducePlan pack by pack on the CPU emulator: every method, the calls it makes, NCCL refused."""

from __future__ import annotations

import numpy as np
import pytest

from distrib.backends.cpu import CpuBackend
from distrib.backends.packed import execute_pack_by_pack
from distrib.errors import BackendUnavailableError
from distrib.plan import HIERARCHICAL, NATIVE, NCCL, RING, all_reduce_plan, plan_by_size, plan_concat_split


def devices(n: int) -> list[str]:
    return [f"CPU:{i}" for i in range(n)]



class RecordingCpuBackend(CpuBackend):
    """The real CPU backend, recording which per-pack collectives a plan's execution calls."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def all_reduce(self, flats, chunks, devices, mean, *, timeout=None):
        self.calls.append(("all_reduce", len(chunks)))
        return super().all_reduce(flats, chunks, devices, mean, timeout=timeout)

    def reduce_scatter(self, flats, devices, *, timeout=None):
        self.calls.append(("reduce_scatter", flats[0].size))
        return super().reduce_scatter(flats, devices, timeout=timeout)


SPECS = [((3, 5), "float32"), ((), "int64"), ((7,), "float32"), ((4,), "int32")]


def per_device_values(count: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(count)
    return [[(rng.standard_normal(shape) * 100).astype(dtype) for shape, dtype in SPECS] for _ in range(count)]


@pytest.mark.parametrize("mean", [False, True], ids=["SUM", "MEAN"])
@pytest.mark.parametrize("count", [1, 3, 4])
@pytest.mark.parametrize("method", [RING, HIERARCHICAL])
def test_every_method_gives_the_native_all_reduce(method, count, mean):
    """RING sums in device order as the native all-reduce does, so bit for bit; HIERARCHICAL sums by halves."""
    backend = CpuBackend()
    values = per_device_values(count)
    packing = plan_concat_split(SPECS, 2)
    native = backend.execute(all_reduce_plan(packing, NATIVE, mean, count), values, devices(count))
    other = backend.execute(all_reduce_plan(packing, method, mean, count), values, devices(count))
    for got_device, want_device in zip(other, native):
        for got, want in zip(got_device, want_device):
            assert got.dtype == want.dtype and got.shape == want.shape
            if method == RING:
                np.testing.assert_array_equal(got, want)
            else:
                np.testing.assert_allclose(got, want, rtol=1e-5)


def test_integer_means_are_summed_then_divided_into_floats():
    backend = CpuBackend()
    values = [[np.array([1, 2], np.int32)], [np.array([2, 2], np.int32)]]
    (first, second) = backend.execute(all_reduce_plan(plan_concat_split([((2,), "int32")], 1), NATIVE, True, 2),
                                      values, devices(2))
    np.testing.assert_array_equal(first[0], [1.5, 2.0])
    assert first[0].dtype.kind == "f"


def test_a_ring_plan_reduce_scatters_each_chunk_padded_to_divide_evenly():
    backend = RecordingCpuBackend()
    packing = plan_by_size(SPECS, 40)  # float32 [7] + [3, 5] over 40 bytes: two packs, then the integers
    backend.execute(all_reduce_plan(packing, RING, False, 3), per_device_values(3), devices(3))
    sizes = [buffer.size for buffer in packing.buffers]
    assert backend.calls == [("reduce_scatter", -(-size // 3) * 3) for size in sizes]


def test_a_native_plan_makes_one_all_reduce_per_buffer():
    backend = RecordingCpuBackend()
    packing = plan_concat_split(SPECS, 3)
    backend.execute(all_reduce_plan(packing, NATIVE, False, 2), per_device_values(2), devices(2))
    assert backend.calls == [("all_reduce", len(buffer.chunks)) for buffer in packing.buffers]


def test_an_nccl_plan_is_refused_by_the_cpu_emulator():
    with pytest.raises(BackendUnavailableError, match=r"^CommunicationImplementation.NCCL needs NCCL between GPUs"):
        CpuBackend().execute(all_reduce_plan(plan_concat_split(SPECS, 1), NCCL, False, 2), per_device_values(2),
                             devices(2))


@pytest.mark.parametrize("shape, dtype, mean", [((3, 5), "float32", False), ((3, 5), "float32", True),
                                               ((), "float64", True), ((4,), "int32", False), ((4,), "int32", True),
                                               ((2, 2), "bool", False)])
def test_a_plan_of_one_value_goes_straight_to_the_all_reduce_with_the_results_of_the_packed_route(shape, dtype, mean):
    backend, count = RecordingCpuBackend(), 3
    rng = np.random.default_rng(7)
    values = [[(rng.standard_normal(shape) * 100).astype(dtype)] for _ in range(count)]
    plan = all_reduce_plan(plan_concat_split([(shape, dtype)], 1), NATIVE, mean, count)
    assert plan.single is not None
    results = backend.execute(plan, values, devices(count))
    expected = execute_pack_by_pack(CpuBackend(), plan, values, devices(count), None)
    assert backend.calls == [("all_reduce", 1)]  # one collective, recorded as such (the timeline sees it)
    for (got,), (want,) in zip(results, expected):
        np.testing.assert_array_equal(got, want, strict=True)  # bit for bit, in shape and dtype
        assert not got.flags.writeable  # read-only, as TensorFlow's tensors are
    assert len({id(r[0]) for r in results}) == count  # each device its own view
    with pytest.raises(ValueError, match="read-only"):
        results[0][0][...] = 0
