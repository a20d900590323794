"""NcclAllReduce, HierarchicalCopyAllReduce and ReductionToOneDevice on the CPU emulator, checked against NumPy."""

from __future__ import annotations

import math

import numpy as np
import pytest

import distrib
from distrib.backends.cpu import CpuBackend
from distrib.cross_device_ops import (CollectiveAllReduce, HierarchicalCopyAllReduce, NcclAllReduce,
                                     ReductionToOneDevice)
from distrib.devices import HOST
from distrib.errors import BackendUnavailableError, CollectiveMismatchError
from distrib.options import CommunicationOptions, ReduceOp
from support import CallCountingBackend, overwrite

OPS = [
    pytest.param(lambda: NcclAllReduce(num_packs=0), id="nccl-packs0"),
    pytest.param(lambda: NcclAllReduce(num_packs=1), id="nccl-packs1"),
    pytest.param(lambda: NcclAllReduce(num_packs=3), id="nccl-packs3"),
    pytest.param(lambda: HierarchicalCopyAllReduce(num_packs=1), id="hierarchical-packs1"),
    pytest.param(lambda: HierarchicalCopyAllReduce(num_packs=2), id="hierarchical-packs2"),
    pytest.param(lambda: ReductionToOneDevice(), id="reduction-to-one-device"),
]

# Mixed dtypes (interleaved, so grouping matters), scalars, empty arrays and one value big enough for the pool.
LAYOUT = [
    ((3, 4), "float32"),
    ((), "float64"),
    ((5,), "int32"),
    ((0,), "float32"),
    ((7,), "float16"),
    ((2, 0, 3), "int64"),
    ((), "int64"),
    ((2, 2), "float32"),
    ((40_000,), "float32"),
    ((3,), "float16"),
]


def devices(n: int) -> list[str]:
    return [f"CPU:{i}" for i in range(n)]


def make_values(num_devices: int, layout=LAYOUT, seed: int = 0) -> list[list[np.ndarray]]:
    """`values[v][r]`: value v on replica r. Small integers, so every sum is exact in every dtype."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(-8, 9, size=shape).astype(dtype) for _ in range(num_devices)] for shape, dtype in layout]


def reference(op: ReduceOp, components: list[np.ndarray], all_reduce: bool = False) -> np.ndarray:
    total = np.sum([c.astype(np.float64) for c in components], axis=0)
    dtype = components[0].dtype
    if op is ReduceOp.SUM or (all_reduce and len(components) == 1):  # TensorFlow's shortcut for one replica
        return total.astype(dtype)
    mean = total / len(components)
    return mean.astype(dtype) if dtype.kind == "f" else mean  # integer MEAN is a float, as in TensorFlow


def assert_reduced(op: ReduceOp, result: np.ndarray, components: list[np.ndarray], all_reduce: bool = False):
    """`all_reduce`: onto the components' own devices, where the MEAN of one replica's value is that value."""
    want = reference(op, components, all_reduce)
    assert isinstance(result, np.ndarray)
    assert result.shape == want.shape
    if op is ReduceOp.SUM or components[0].dtype.kind == "f" or (all_reduce and len(components) == 1):
        assert result.dtype == components[0].dtype
    else:
        assert result.dtype.kind == "f"
    if op is ReduceOp.SUM:
        np.testing.assert_array_equal(result, want)
    else:
        np.testing.assert_allclose(result, want, rtol=1e-3 if result.dtype == np.float16 else 1e-6)


class CountingCpuBackend(CpuBackend):
    """The real CPU backend, recording the packs it builds on the first device and its all-reduce calls."""

    def __init__(self):
        super().__init__()
        self.packs = []            # Buffer of each pack built on CPU:0
        self.all_reduce_calls = []  # chunks of each all_reduce call

    def pack(self, arrays, buffer, device):
        if device == "CPU:0":
            self.packs.append(buffer)
            assert all(np.dtype(a.dtype).name == buffer.dtype for a in arrays), "a pack mixes dtypes"
        return super().pack(arrays, buffer, device)

    def all_reduce(self, flats, chunks, devices, mean, *, timeout=None):
        self.all_reduce_calls.append(tuple(chunks))
        return super().all_reduce(flats, chunks, devices, mean, timeout=timeout)

    @property
    def collective_calls(self) -> int:
        return sum(len(chunks) for chunks in self.all_reduce_calls)


# batch_all_reduce gives NumPy's answer


def all_reduce_values(op, backend, reduce_op, values, devs, options):
    """batch_all_reduce with value-major lists (values[v][r] in, results[v][r] out), as these tests build them."""
    per_replica = [list(v) for v in zip(*values)] if values else [[] for _ in devs]
    results = op.batch_all_reduce(backend, reduce_op, per_replica, devs, options)
    return [list(v) for v in zip(*results)] if values else []


@pytest.mark.parametrize("options", [CommunicationOptions(), CommunicationOptions(bytes_per_pack=64)],
                         ids=["one-pack", "bytes_per_pack=64"])
@pytest.mark.parametrize("reduce_op", [ReduceOp.SUM, ReduceOp.MEAN], ids=["SUM", "MEAN"])
@pytest.mark.parametrize("num_devices", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("make_op", OPS)
def test_batch_all_reduce_matches_numpy(make_op, num_devices, reduce_op, options):
    values = make_values(num_devices)
    results = all_reduce_values(make_op(), CpuBackend(), reduce_op, values, devices(num_devices), options)
    assert len(results) == len(values)
    for components, per_device in zip(values, results):
        assert len(per_device) == num_devices
        for result in per_device:
            assert_reduced(reduce_op, result, components, all_reduce=True)


@pytest.mark.parametrize("make_op", OPS)
def test_integer_mean_is_a_float_as_in_tensorflow(make_op):
    values = [[np.array([r + 1, 10 * (r + 1)], np.int32) for r in range(4)],
              [np.array(r + 1, np.int64) for r in range(4)]]
    results = all_reduce_values(make_op(), CpuBackend(), ReduceOp.MEAN, values, devices(4),
                                CommunicationOptions())
    for result in results[0]:
        assert result.dtype.kind == "f"
        np.testing.assert_array_equal(result, [2.5, 25.0])
    for result in results[1]:
        assert isinstance(result, np.ndarray) and result.shape == () and result.dtype.kind == "f"
        assert result == 2.5


@pytest.mark.parametrize("make_op", OPS)
def test_batch_all_reduce_of_no_values_is_empty(make_op):
    assert all_reduce_values(make_op(), CpuBackend(), ReduceOp.SUM, [], devices(2), CommunicationOptions()) == []


# Results are the caller's to keep: they never alias inputs or each other


@pytest.mark.parametrize("reduce_op", [ReduceOp.SUM, ReduceOp.MEAN], ids=["SUM", "MEAN"])
@pytest.mark.parametrize("num_devices", [1, 3])
@pytest.mark.parametrize("make_op", OPS)
def test_batch_all_reduce_never_touches_or_aliases_its_inputs(make_op, num_devices, reduce_op):
    values = make_values(num_devices)
    before = [[c.copy() for c in components] for components in values]
    results = all_reduce_values(make_op(), CpuBackend(), reduce_op, values, devices(num_devices),
                                         CommunicationOptions())
    for components, saved in zip(values, before):
        for component, copy in zip(components, saved):
            np.testing.assert_array_equal(component, copy)  # the op did not write into its inputs
    kept = [[r.copy() for r in per_device] for per_device in results]
    for components in values:
        for component in components:
            component[...] = 99  # the caller reuses its input buffers
    for per_device, saved in zip(results, kept):
        for result, copy in zip(per_device, saved):
            np.testing.assert_array_equal(result, copy)


@pytest.mark.parametrize("reduce_op", [ReduceOp.SUM, ReduceOp.MEAN], ids=["SUM", "MEAN"])
@pytest.mark.parametrize("num_devices", [1, 3])
@pytest.mark.parametrize("make_op", OPS)
def test_writing_one_result_changes_no_other_result_or_input(make_op, num_devices, reduce_op):
    values = make_values(num_devices)
    inputs = [[c.copy() for c in components] for components in values]
    results = all_reduce_values(make_op(), CpuBackend(), reduce_op, values, devices(num_devices),
                                         CommunicationOptions())
    for per_device in results:
        assert len({id(r) for r in per_device}) == num_devices  # each device has its own array
    kept = [[r.copy() for r in per_device] for per_device in results]
    written = {}
    for v, per_device in enumerate(results):
        for r, result in enumerate(per_device):
            sentinel = 100 + len(written)  # distinct per result, exact in float16
            if overwrite(result, sentinel):
                written[v, r] = sentinel
    for v, per_device in enumerate(results):
        for r, result in enumerate(per_device):
            np.testing.assert_array_equal(result, written.get((v, r), kept[v][r]), err_msg=f"value {v} device {r}")
    for components, saved in zip(values, inputs):
        for component, copy in zip(components, saved):
            np.testing.assert_array_equal(component, copy)


# CommunicationOptions.bytes_per_pack and num_packs decide the collective calls

# float32 values of 4, 800, 32 and 128 bytes; the collective path reverses them to TensorFlow's
# documented example [128, 32, 800, 4].
EXAMPLE = [((1,), "float32"), ((200,), "float32"), ((8,), "float32"), ((32,), "float32")]


@pytest.mark.parametrize("bytes_per_pack, packed_bytes", [
    (0, [964]),                    # unset: num_packs=1, one pack
    (200, [960, 4]),               # [[128, 32, 800], [4]]
    (959, [960, 4]),
    (960, [964]),                  # a pack at exactly the limit keeps accepting
    (1, [128, 32, 800, 4]),        # one call per value; no value is split
    (1 << 20, [964]),
])
def test_bytes_per_pack_sets_the_number_of_all_reduce_calls(bytes_per_pack, packed_bytes):
    backend = CountingCpuBackend()
    values = make_values(3, EXAMPLE)
    results = all_reduce_values(NcclAllReduce(num_packs=1), backend, ReduceOp.SUM, values, devices(3),
                                CommunicationOptions(bytes_per_pack=bytes_per_pack))
    assert [b.nbytes for b in backend.packs] == packed_bytes
    assert backend.collective_calls == len(packed_bytes)
    assert backend.all_reduce_calls == [((0, b.size),) for b in backend.packs]
    for components, per_device in zip(values, results):
        for result in per_device:
            assert_reduced(ReduceOp.SUM, result, components)


def test_num_packs_cuts_one_buffer_into_that_many_calls():
    backend = CountingCpuBackend()
    values = make_values(2, [((4,), "float32"), ((6,), "float32")])
    all_reduce_values(NcclAllReduce(num_packs=3), backend, ReduceOp.SUM, values, devices(2), CommunicationOptions())
    assert backend.all_reduce_calls == [((0, 3), (3, 6), (6, 10))]
    assert backend.collective_calls == 3


def test_bytes_per_pack_overrides_num_packs():
    backend = CountingCpuBackend()
    values = make_values(2, EXAMPLE)
    all_reduce_values(NcclAllReduce(num_packs=3), backend, ReduceOp.SUM, values, devices(2),
                                                CommunicationOptions(bytes_per_pack=200))
    assert [b.nbytes for b in backend.packs] == [960, 4]
    assert backend.collective_calls == 2


def test_zero_packs_is_one_call_per_value():
    backend = CountingCpuBackend()
    values = make_values(2, EXAMPLE)
    all_reduce_values(NcclAllReduce(num_packs=0), backend, ReduceOp.SUM, values, devices(2), CommunicationOptions())
    assert [b.nbytes for b in backend.packs] == [4, 800, 32, 128]  # input order
    assert backend.collective_calls == 4


@pytest.mark.parametrize("bytes_per_pack, dtypes", [
    (0, ["float32", "int32", "float16"]),  # num_packs=1: one call per dtype, in order of first appearance
    (4, ["int32", "int32", "float16", "float32", "float32"]),  # reversed, then grouped, then cut at 4 bytes
])
def test_packs_never_mix_dtypes(bytes_per_pack, dtypes):
    backend = CountingCpuBackend()
    layout = [((2,), "float32"), ((2,), "int32"), ((2,), "float32"), ((2,), "float16"), ((2,), "int32")]
    values = make_values(2, layout)
    results = all_reduce_values(NcclAllReduce(num_packs=1), backend, ReduceOp.SUM, values, devices(2),
                                CommunicationOptions(bytes_per_pack=bytes_per_pack))
    assert [b.dtype for b in backend.packs] == dtypes
    assert backend.collective_calls == len(dtypes)
    for components, per_device in zip(values, results):
        for result in per_device:
            assert_reduced(ReduceOp.SUM, result, components)


@pytest.mark.parametrize("bytes_per_pack, packed_bytes", [(0, [964]), (200, [960, 4]), (1, [128, 32, 800, 4])])
def test_bytes_per_pack_bounds_hierarchical_copy_packs(bytes_per_pack, packed_bytes):
    backend = CountingCpuBackend()
    values = make_values(4, EXAMPLE)
    results = all_reduce_values(HierarchicalCopyAllReduce(num_packs=1), backend, ReduceOp.MEAN, values, devices(4),
                                CommunicationOptions(bytes_per_pack=bytes_per_pack))
    assert [b.nbytes for b in backend.packs] == packed_bytes
    for components, per_device in zip(values, results):
        for result in per_device:
            assert_reduced(ReduceOp.MEAN, result, components)


@pytest.mark.parametrize("cls", [NcclAllReduce, HierarchicalCopyAllReduce])
def test_num_packs_is_validated(cls):
    with pytest.raises(ValueError, match="num_packs must be non-negative"):
        cls(num_packs=-1)
    with pytest.raises(TypeError, match="num_packs must be an int"):
        cls(num_packs=1.5)
    with pytest.raises(TypeError, match="num_packs must be an int"):
        cls(num_packs=True)


# reduce_to and broadcast


@pytest.mark.parametrize("shape, dtype, reduce_op", [
    ((), "float32", ReduceOp.SUM), ((), "float32", ReduceOp.MEAN), ((3, 2), "float16", ReduceOp.MEAN),
    ((5,), "int32", ReduceOp.SUM), ((5,), "int32", ReduceOp.MEAN), ((2,), "bool", ReduceOp.SUM)])
def test_one_value_reduced_to_the_host_alone_has_the_bits_it_has_in_a_packed_batch(shape, dtype, reduce_op):
    rng = np.random.default_rng(3)
    values = [(rng.standard_normal(shape) * 50).astype(dtype) for _ in range(3)]
    other = [np.ones(4, dtype) for _ in range(3)]  # packed with the value: the batch's route
    (alone,) = NcclAllReduce().batch_reduce_to_host(CpuBackend(), reduce_op, [[v] for v in values], devices(3))
    batched, _ = NcclAllReduce().batch_reduce_to_host(CpuBackend(), reduce_op, [[v, o] for v, o in zip(values, other)],
                                                      devices(3))
    np.testing.assert_array_equal(alone, batched, strict=True)
    assert type(alone) is np.ndarray


@pytest.mark.parametrize("reduce_op", [ReduceOp.SUM, ReduceOp.MEAN], ids=["SUM", "MEAN"])
@pytest.mark.parametrize("shape", [(2, 3), ()], ids=["matrix", "scalar"])
@pytest.mark.parametrize("dtype", ["float32", "int64"])
@pytest.mark.parametrize("make_op", OPS)
def test_reduce_to_host_and_to_devices(make_op, dtype, shape, reduce_op):
    components = [np.arange(math.prod(shape), dtype=dtype).reshape(shape) + (r + 1) for r in range(4)]
    before = [c.copy() for c in components]
    op = make_op()
    (on_host,) = op.reduce_to(CpuBackend(), reduce_op, components, devices(4), (HOST,))
    assert_reduced(reduce_op, on_host, components)
    on_devices = op.reduce_to(CpuBackend(), reduce_op, components, devices(4), ("CPU:0", "CPU:2"))
    assert len(on_devices) == 2
    for result in on_devices:
        assert_reduced(reduce_op, result, components)
    for component, copy in zip(components, before):
        np.testing.assert_array_equal(component, copy)


@pytest.mark.parametrize("make_op", OPS)
def test_broadcast_gives_each_device_the_value(make_op):
    source = np.arange(40_000, dtype=np.float32)
    results = make_op().broadcast(CpuBackend(), source, devices(3))
    assert len(results) == 3 and len({id(r) for r in results}) == 3
    source[...] = -1
    for result in results:
        np.testing.assert_array_equal(result, np.arange(40_000, dtype=np.float32))


# all_gather concatenates, even when lengths along the axis differ


@pytest.mark.parametrize("lengths", [[2, 2, 2], [2, 0, 3, 1], [0, 0], [5]], ids=str)
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("make_op", OPS)
def test_all_gather_equals_concatenate(make_op, axis, lengths):
    rng = np.random.default_rng(1)
    components = []
    for length in lengths:
        shape = [2, 3, 4]
        shape[axis] = length
        components.append(rng.integers(-50, 50, size=shape).astype(np.float64))
    before = [c.copy() for c in components]
    want = np.concatenate(components, axis=axis)
    results = make_op().all_gather(CpuBackend(), components, devices(len(lengths)), axis)
    assert len(results) == len(lengths)
    for result in results:
        assert result.shape == want.shape and result.dtype == want.dtype
        np.testing.assert_array_equal(result, want)
    for component, copy in zip(components, before):
        np.testing.assert_array_equal(component, copy)
        component[...] = 99
    for result in results:
        np.testing.assert_array_equal(result, want)


@pytest.mark.parametrize("dtype", ["int32", "float16", "bool"])
def test_all_gather_keeps_dtype(dtype):
    components = [np.ones((r + 1, 2), dtype) for r in range(3)]
    for result in NcclAllReduce().all_gather(CpuBackend(), components, devices(3), 0):
        assert result.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(result, np.concatenate(components))


@pytest.mark.parametrize("make_op", [NcclAllReduce, CollectiveAllReduce])
def test_batch_all_gather_sends_every_length_in_one_exchange_and_each_dtype_in_one_call(make_op):
    backend = CallCountingBackend()
    per_replica = [[np.full((r + 1, 2), r, np.float32), np.arange(3 - r, dtype=np.int32),
                    np.full((r, 2), r, np.float32), np.ones((r + 2, 1), np.float16)] for r in range(3)]
    out = make_op().batch_all_gather(backend, per_replica, devices(3), 0)
    assert out[0][3].shape == (9, 1) and out[0][2].tolist() == [[1, 1], [2, 2], [2, 2]]
    for v in range(4):
        np.testing.assert_array_equal(out[2][v], np.concatenate([values[v] for values in per_replica]), strict=True)
    # CollectiveAllReduce exchanges the lengths (other processes' are not here), in one host exchange of int64 rows
    assert backend.counted("gather_rows") == (["int64"] if make_op is CollectiveAllReduce else [])
    assert sorted(backend.counted("all_gather")) == ["float16", "float32", "int32"]


@pytest.mark.parametrize("other, described", [
    (np.zeros((2, 4), np.float32), "rank 2 gathered along axis 0, with 4 elements per row of dtype f4"),
    (np.zeros((2, 3), np.int32), "rank 2 gathered along axis 0, with 3 elements per row of dtype i4")])
def test_batch_all_gather_names_the_replica_and_value_whose_layout_differs(other, described):
    per_replica = [[np.ones(2), np.zeros((1, 3), np.float32)], [np.ones(1), other]]
    with pytest.raises(CollectiveMismatchError, match=r"^all_gather needs the same dtype, axis and shape off the "
                       rf"gather axis on every replica\. Received: replica 1, value 1, {described} vs rank 2 gathered "
                       r"along axis 0, with 3 elements per row of dtype f4\."):
        CollectiveAllReduce().batch_all_gather(CpuBackend(), per_replica, devices(2), 0)


# the collective's timeout reaches the backend, which bounds NCCL with it


class TimeoutRecordingBackend(CpuBackend):
    def __init__(self):
        super().__init__()
        self.timeouts = []

    def all_reduce(self, flats, chunks, devices, mean, *, timeout=None):
        self.timeouts.append(("all_reduce", timeout))
        return super().all_reduce(flats, chunks, devices, mean, timeout=timeout)

    def broadcast(self, array, devices, *, timeout=None):
        self.timeouts.append(("broadcast", timeout))
        return super().broadcast(array, devices, timeout=timeout)


@pytest.mark.parametrize("options, expected", [(CommunicationOptions(timeout_seconds=7), 7),
                                               (CommunicationOptions(timeout_seconds=0), None),
                                               (CommunicationOptions(), None)])
def test_the_options_timeout_reaches_the_backend_collective(options, expected):
    per_replica = [[np.ones(3, np.float32)], [np.ones(3, np.float32)]]
    for op, call in ((NcclAllReduce(), "all_reduce"), (ReductionToOneDevice(), "broadcast")):
        backend = TimeoutRecordingBackend()
        op.batch_all_reduce(backend, ReduceOp.SUM, per_replica, devices(2), options)
        assert backend.timeouts == [(call, expected)]


# CommunicationOptions.implementation decides how NcclAllReduce's packs move


def test_ring_implementation_reduce_scatters_then_all_gathers_with_the_same_sums():
    backend, devs = CountingCpuBackend(), [f"CPU:{i}" for i in range(3)]
    values = [[np.full(5, r + k, np.float32) for r in range(3)] for k in range(2)]
    ring = all_reduce_values(NcclAllReduce(), backend, ReduceOp.SUM, values, devs,
                             CommunicationOptions(implementation="RING"))
    assert backend.all_reduce_calls == []  # no native all-reduce: two phases instead
    auto = all_reduce_values(NcclAllReduce(), backend, ReduceOp.SUM, values, devs, CommunicationOptions())
    for got, want in zip(ring, auto):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


def test_nccl_implementation_on_the_cpu_emulator_fails_at_the_collective():
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"],
                                        communication_options=CommunicationOptions(implementation="NCCL"))
    with pytest.raises(BackendUnavailableError, match=r"^CommunicationImplementation.NCCL needs NCCL between GPUs"):
        strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(1)))


def test_hierarchical_copy_and_reduction_to_one_device_keep_their_algorithm_whatever_the_implementation():
    backend, devs = CpuBackend(), ["CPU:0", "CPU:1"]
    values = [[np.float32(1), np.float32(2)]]
    for op in (HierarchicalCopyAllReduce(), ReductionToOneDevice()):
        result = all_reduce_values(op, backend, ReduceOp.SUM, values, devs, CommunicationOptions(implementation="NCCL"))
        assert [float(x) for x in result[0]] == [3.0, 3.0]


def test_a_one_value_batch_reuses_the_last_plan_only_for_the_same_request():
    backend, devices, op = CpuBackend(2), ["CPU:0", "CPU:1"], distrib.NcclAllReduce()
    chunked = CommunicationOptions(bytes_per_pack=8)
    asked = []
    execute = backend.execute
    backend.execute = lambda plan, *args, **kwargs: asked.append(plan) or execute(plan, *args, **kwargs)
    for value, reduce_op, options in [(np.arange(3, dtype=np.float32), ReduceOp.SUM, CommunicationOptions())] * 2 + [
            (np.arange(3, dtype=np.float64), ReduceOp.SUM, CommunicationOptions()),
            (np.arange(4, dtype=np.float32), ReduceOp.SUM, CommunicationOptions()),
            (np.arange(4, dtype=np.float32).reshape(2, 2), ReduceOp.SUM, CommunicationOptions()),
            (np.arange(4, dtype=np.float32), ReduceOp.MEAN, CommunicationOptions()),
            (np.arange(4, dtype=np.float32), ReduceOp.MEAN, chunked)]:
        out = op.batch_all_reduce(backend, reduce_op, [[value], [value]], devices, options)
        assert asked[-1] is op.all_reduce_plan([(value.shape, value.dtype)], reduce_op, 2, options)
        np.testing.assert_array_equal(out[1][0], value * (2 if reduce_op is ReduceOp.SUM else 1))


@pytest.mark.parametrize("devices", [["CPU:0"], ["CPU:0", "CPU:1"]])
@pytest.mark.parametrize("ops", OPS)
def test_values_in_the_other_byte_order_reduce_to_native_results_on_every_route(devices, ops):
    # as TensorFlow, whose tensors are native: `result.dtype == np.float32` holds whatever order the input had
    strategy = distrib.MirroredStrategy(devices, cross_device_ops=ops())
    swapped = np.dtype(np.float32).newbyteorder("S")
    base = np.arange(6, dtype=np.float32) * 300 + 255
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: (base * (ctx.replica_id_in_sync_group + 1)).astype(swapped))
    ctx = distrib.get_replica_context
    results = [*strategy.extended.reduce_to("SUM", values, values).values,
               *[m.values[0] for m in strategy.extended.batch_reduce_to("SUM", [(values, values)] * 2)],
               strategy.reduce("SUM", values, axis=None),
               *strategy.experimental_local_results(strategy.run(lambda x: ctx().all_reduce("SUM", x), (values,))),
               *strategy.experimental_local_results(strategy.run(lambda x: ctx().all_reduce("SUM", [x])[0],
                                                                 (values,)))]
    total = base * sum(range(1, len(devices) + 1))
    for result in results:
        assert np.asarray(result).dtype == np.float32
        np.testing.assert_array_equal(result, total)


@pytest.mark.parametrize("devices", [["CPU:0"], ["CPU:0", "CPU:1"]])
def test_gathers_of_values_in_the_other_byte_order_give_native_results_ragged_or_not(devices):
    strategy = distrib.MirroredStrategy(devices)
    swapped = np.dtype(np.float32).newbyteorder("S")
    for ragged in (False, True):
        values = strategy.experimental_distribute_values_from_function(
            lambda c: np.full(1 + ragged * c.replica_id_in_sync_group, c.replica_id_in_sync_group + 1, swapped))
        gathered = strategy.run(lambda x: distrib.get_replica_context().all_gather(x, 0), (values,))
        expected = np.concatenate([np.full(1 + ragged * r, r + 1, np.float32) for r in range(len(devices))])
        for result in [*strategy.experimental_local_results(gathered), strategy.gather(values, axis=0)]:
            assert np.asarray(result).dtype == np.float32
            np.testing.assert_array_equal(result, expected)


@pytest.mark.parametrize("device, error", [("nonsense", ValueError), (5, TypeError)])
def test_reduction_to_one_device_checks_its_device_when_made(device, error):
    # before: accepted, and used (or failed in the backend) at the first reduction
    with pytest.raises(error, match=r"ReductionToOneDevice's reduce_to_device must name a device such as 'GPU:0'"):
        ReductionToOneDevice(reduce_to_device=device)
    assert ReductionToOneDevice("/device:CPU:1").reduce_to_device == "CPU:1"
    with pytest.raises(TypeError, match="accumulation_fn must be callable"):
        ReductionToOneDevice(accumulation_fn="sum")


def test_communication_options_are_where_tensorflow_code_looks_for_them():
    assert distrib.experimental.CommunicationOptions is distrib.CommunicationOptions
    assert distrib.experimental.CommunicationImplementation is distrib.CommunicationImplementation
