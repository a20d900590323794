"""The CPU emulator backend: its buffer pool, array conversion, pack/unpack and collectives over NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from distrib.backends.cpu import BufferPool, CpuBackend, to_numpy
from distrib.plan import plan_concat_split
from support import DLPackOnly, overwrite

POOLED = BufferPool.MIN_BYTES // 8 * 2  # float64 elements in a buffer large enough to be pooled


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def devices(n: int) -> list[str]:
    return [f"CPU:{i}" for i in range(n)]


# BufferPool


def test_pool_reuses_a_released_buffer():
    pool = BufferPool()
    first = pool.empty((POOLED,), np.float64)
    start = address(first)
    del first
    assert address(pool.empty((POOLED,), np.float64)) == start
    assert address(pool.empty((2 * POOLED,), np.float32)) == start  # same bytes, any dtype and shape
    assert address(pool.empty((POOLED // 4, 4), np.float64)) == start


def test_pool_returns_the_requested_shape_and_dtype():
    pool = BufferPool()
    for shape, dtype in [((POOLED,), np.float64), ((4, POOLED // 4), np.int64), ((3, 4), np.int32), ((0, 5), "f4")]:
        array = pool.empty(shape, dtype)
        assert array.shape == shape and array.dtype == np.dtype(dtype)
        assert array.flags.writeable and array.flags.c_contiguous


HOLDERS = {
    "view of a view": lambda a: a[1:][::2],
    "transposed reshape": lambda a: a.reshape(64, -1).T,
    "memoryview": memoryview,
    "np.frombuffer": lambda a: np.frombuffer(a, dtype=a.dtype),
    "np.from_dlpack": np.from_dlpack,
    "as_strided": lambda a: np.lib.stride_tricks.as_strided(a[3:], shape=(5,), strides=(16,)),
}


@pytest.mark.parametrize("hold", HOLDERS.values(), ids=HOLDERS.keys())
def test_pool_never_hands_out_memory_a_live_view_still_uses(hold):
    pool = BufferPool()
    original = pool.empty((POOLED,), np.float64)
    original[...] = np.arange(POOLED)
    view = hold(original)
    expected = np.array(view, copy=True)
    start = address(original)
    del original
    later = [pool.empty((POOLED,), np.float64) for _ in range(3)]
    for array in later:
        assert address(array) != start
        array[...] = -1
    np.testing.assert_array_equal(np.asarray(view), expected)
    del view, later
    assert address(pool.empty((POOLED,), np.float64)) == start  # released at last: reused


def test_pool_hands_out_distinct_memory_to_live_arrays():
    pool = BufferPool()
    live = [pool.empty((POOLED,), np.float64) for _ in range(BufferPool.MAX_PER_SIZE + 8)]
    for i, array in enumerate(live):
        array[...] = i
    for i, array in enumerate(live):
        assert np.all(array == i)
    assert len({address(a) for a in live}) == len(live)


def test_pool_clear_forgets_buffers():
    pool = BufferPool()
    kept = pool.empty((POOLED,), np.float64)
    kept[...] = 5
    pool.clear()
    fresh = pool.empty((POOLED,), np.float64)
    fresh[...] = 6
    assert np.all(kept == 5)


def test_collective_results_survive_later_collectives_of_the_same_size():
    backend = CpuBackend()
    flats = [np.full(POOLED, r + 1.0) for r in range(3)]
    (first, *_) = backend.all_reduce(flats, [(0, POOLED)], devices(3), False)
    kept = first[2:][::3]  # a view of a view: the only reference left
    del first
    for _ in range(5):
        backend.all_reduce([np.full(POOLED, -7.0)] * 3, [(0, POOLED)], devices(3), False)
        backend.copy(np.zeros(POOLED), "CPU:0")
        backend.add_n([np.ones(POOLED), np.ones(POOLED)], "CPU:0")
    np.testing.assert_array_equal(kept, np.full(kept.shape, 6.0))


# to_numpy


@pytest.mark.parametrize("value, expected", [
    (np.arange(6, dtype=np.int16).reshape(2, 3), np.arange(6, dtype=np.int16).reshape(2, 3)),
    (np.float32(1.5), np.array(1.5, np.float32)),
    (np.bool_(True), np.array(True)),
    (3, np.array(3)),
    (2.5, np.array(2.5)),
    (True, np.array(True)),
    (1 + 2j, np.array(1 + 2j)),
    ([[1, 2], [3, 4]], np.array([[1, 2], [3, 4]])),
    ([0.5, 1], np.array([0.5, 1.0])),
    (DLPackOnly(np.arange(4, dtype=np.float32)), np.arange(4, dtype=np.float32)),
    (DLPackOnly(np.ones((2, 0), np.int64)), np.ones((2, 0), np.int64)),
], ids=["ndarray", "numpy-scalar", "numpy-bool", "int", "float", "bool", "complex", "nested-list", "list",
        "dlpack", "dlpack-empty"])
def test_to_numpy_accepts_array_likes(value, expected):
    array = to_numpy(value)
    assert isinstance(array, np.ndarray)
    assert array.shape == expected.shape and array.dtype == expected.dtype
    np.testing.assert_array_equal(array, expected)


def test_to_numpy_reads_dlpack_without_copying():
    source = np.arange(5.0)
    array = to_numpy(DLPackOnly(source))
    source[0] = 42
    assert array[0] == 42


@pytest.mark.parametrize("value", [["a", "b"], "text", np.str_("x"), b"bytes", {}, {"a": 1}, None, object(),
                                   [[1], [1, 2]], [1, None]],
                         ids=["strings", "string", "numpy-string", "bytes", "empty-dict", "dict", "None", "object",
                              "ragged", "None-inside"])
def test_to_numpy_rejects_non_numbers(value):
    with pytest.raises(TypeError, match="Expected an array"):
        to_numpy(value)


# CpuBackend: construction and devices


def test_default_devices_follow_the_environment(monkeypatch):
    monkeypatch.setenv("DISTRIB_CPU_REPLICAS", "3")
    assert CpuBackend().default_devices() == ("CPU:0", "CPU:1", "CPU:2")
    monkeypatch.delenv("DISTRIB_CPU_REPLICAS")
    assert CpuBackend().default_devices() == ("CPU:0", "CPU:1")
    assert CpuBackend(num_default_replicas=1).default_devices() == ("CPU:0",)


@pytest.mark.parametrize("raw", ["two", "0", "-1", "4097", "1000000000"])
def test_bad_replica_count_is_rejected(monkeypatch, raw):
    monkeypatch.setenv("DISTRIB_CPU_REPLICAS", raw)
    with pytest.raises(ValueError, match=f"^DISTRIB_CPU_REPLICAS must be a positive integer of at most 4096 .*"
                                         f"Received: '{raw}'"):
        CpuBackend()


def test_the_largest_replica_count_is_accepted_and_one_more_refused(monkeypatch):
    monkeypatch.setenv("DISTRIB_CPU_REPLICAS", "4096")
    assert len(CpuBackend().default_devices()) == 4096
    with pytest.raises(ValueError, match=r"^The CPU emulator runs 1 to 4096 replicas \(each a thread of this "
                                         r"process\)\. Received: 4097\.$"):
        CpuBackend(num_default_replicas=4097)


def test_only_cpu_devices_exist():
    backend = CpuBackend()
    backend.check_device("CPU:7")
    with pytest.raises(ValueError, match="The CPU emulator backend has no device 'GPU:0'"):
        backend.check_device("GPU:0")


def test_to_device_and_to_host_give_numpy_arrays():
    backend = CpuBackend()
    assert backend.xp is np
    np.testing.assert_array_equal(backend.to_device([1, 2], "CPU:1"), [1, 2])
    assert isinstance(backend.to_host(np.float64(2.0)), np.ndarray)


# pack and unpack


def test_pack_lays_values_out_at_their_offsets_and_unpack_restores_them():
    backend = CpuBackend()
    values = [np.arange(6.0).reshape(2, 3).T,  # not contiguous
              np.array(7.0),                  # scalar
              np.zeros((0, 4)),               # empty
              np.arange(POOLED, dtype=np.float64)]
    (buffer,) = plan_concat_split([(v.shape, v.dtype) for v in values], 1).buffers
    flat = backend.pack(values, buffer, "CPU:0")
    assert flat.shape == (buffer.size,) and flat.dtype == np.float64
    np.testing.assert_array_equal(flat, np.concatenate([v.ravel() for v in values]))
    unpacked = backend.unpack(flat, buffer)
    assert len(unpacked) == len(values)
    for got, want in zip(unpacked, values):
        assert got.shape == want.shape and not np.shares_memory(got, flat)  # a kept member does not pin the pack
        np.testing.assert_array_equal(got, want)


def test_pack_of_one_value_has_its_contents():
    backend = CpuBackend()
    value = np.arange(12, dtype=np.int32).reshape(3, 4)
    (buffer,) = plan_concat_split([(value.shape, value.dtype)], 0).buffers
    flat = backend.pack([value], buffer, "CPU:0")
    np.testing.assert_array_equal(flat, np.arange(12))
    np.testing.assert_array_equal(backend.unpack(flat, buffer)[0], value)


# collectives


@pytest.mark.parametrize("num_devices", [1, 2, 3, 5])
@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
def test_all_reduce_sums_every_chunk(num_devices, mean):
    backend = CpuBackend()
    flats = [np.arange(10, dtype=np.float32) * (r + 1) for r in range(num_devices)]
    before = [f.copy() for f in flats]
    results = backend.all_reduce(flats, [(0, 3), (3, 6), (6, 10)], devices(num_devices), mean)
    want = np.sum(before, axis=0) / (num_devices if mean else 1)
    assert len(results) == num_devices
    for result in results:
        assert result.dtype == np.float32
        np.testing.assert_allclose(result, want, rtol=1e-6)
    for flat, copy in zip(flats, before):
        np.testing.assert_array_equal(flat, copy)
        flat[...] = -1
    for result in results:
        np.testing.assert_allclose(result, want, rtol=1e-6)  # results do not alias the inputs


def test_all_reduce_results_are_independent_per_device():
    backend = CpuBackend()
    flats = [np.ones(POOLED) for _ in range(3)]
    results = backend.all_reduce(flats, [(0, POOLED)], devices(3), False)
    assert len({id(r) for r in results}) == 3
    if overwrite(results[0], 0.0):
        for result in results[1:]:
            assert np.all(result == 3.0)


def test_all_gather_concatenates_in_device_order():
    backend = CpuBackend()
    flats = [np.full(3, r, np.int64) for r in range(4)]
    for result in backend.all_gather(flats, devices(4)):
        np.testing.assert_array_equal(result, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])


def test_reduce_scatter_gives_device_i_the_ith_slice_of_the_sum():
    backend = CpuBackend()
    flats = [np.arange(6, dtype=np.int32) + 10 * r for r in range(3)]
    before = [f.copy() for f in flats]
    results = backend.reduce_scatter(flats, devices(3))
    total = np.arange(6) * 3 + 30
    assert [r.tolist() for r in results] == [total[0:2].tolist(), total[2:4].tolist(), total[4:6].tolist()]
    assert all(r.dtype == np.int32 for r in results)
    for flat, copy in zip(flats, before):
        np.testing.assert_array_equal(flat, copy)


@pytest.mark.parametrize("elements", [12, 3 << 17], ids=["small", "large"])  # large: slices summed in shares
def test_reduce_scatter_slices_have_the_bits_of_the_in_order_sum_and_are_each_their_own(elements):
    rng = np.random.default_rng(5)
    flats = [rng.standard_normal(elements).astype(np.float32) for _ in range(3)]
    results = CpuBackend().reduce_scatter(flats, devices(3))
    total = (flats[0] + flats[1]) + flats[2]  # device order, as TensorFlow's add_n
    part = elements // 3
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result, total[i * part:(i + 1) * part], strict=True)
        result[0] = 7  # writable, and no other device's slice changes (the ring divides its slice in place)
    assert all(r[1] != 7 for r in results) and [r[0] for r in results] == [7, 7, 7]


def test_reduce_scatter_needs_a_length_divisible_by_the_devices():
    with pytest.raises(ValueError, match="reduce_scatter needs a length divisible by 3 devices"):
        CpuBackend().reduce_scatter([np.ones(4)] * 3, devices(3))


@pytest.mark.parametrize("size", [5, POOLED])
def test_broadcast_copies_the_value_to_every_device(size):
    backend = CpuBackend()
    source = np.arange(size, dtype=np.float64)
    results = backend.broadcast(source, devices(3))
    assert len(results) == 3 and len({id(r) for r in results}) == 3
    source[...] = -1
    for result in results:
        np.testing.assert_array_equal(result, np.arange(size))


def test_add_n_sums_in_order_on_a_new_array():
    backend = CpuBackend()
    arrays = [np.full((2, 2), r, np.int64) for r in (1, 2, 3)]
    total = backend.add_n(arrays, "CPU:0")
    assert total.dtype == np.int64
    np.testing.assert_array_equal(total, np.full((2, 2), 6))
    alone = backend.add_n(arrays[:1], "CPU:0")
    arrays[0][...] = 100
    np.testing.assert_array_equal(alone, np.ones((2, 2)))
    np.testing.assert_array_equal(total, np.full((2, 2), 6))


def test_copy_is_a_new_array():
    backend = CpuBackend()
    source = np.arange(POOLED, dtype=np.float64)
    copy = backend.copy(source, "CPU:1")
    source[...] = 0
    np.testing.assert_array_equal(copy, np.arange(POOLED))

