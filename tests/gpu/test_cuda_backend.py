"""The CUDA backend on a GPU: NCCL single-rank collectives, the same-device path, the watchdog, discovery."""

from __future__ import annotations

import numpy as np
import pytest

import distrib
from distrib.backends import get_backend
from distrib.backends.cuda import nccl as nccl_comms
from distrib.backends.cpu import CpuBackend
from distrib.plan import plan_concat_split
from distrib.errors import CollectiveError, DeadlineExceededError

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
import ml_dtypes  # noqa: E402  (in distrib[test] and the cuda extras: a GPU run must not skip it)

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
          "uint64", "complex64", "complex128", "bool"]
FLOATS = {"float16", "bfloat16", "float32", "float64", "complex64", "complex128"}


def dtype_of(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def random(rng, size: int, name: str) -> np.ndarray:
    dtype = dtype_of(name)
    if dtype.kind == "b":
        return rng.integers(0, 2, size).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(0, 100, size).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(size) + 1j * rng.standard_normal(size)).astype(dtype)
    return rng.standard_normal(size).astype(dtype)


@pytest.fixture(scope="module")
def backend():
    return get_backend("cuda")


def host(arrays) -> list[np.ndarray]:
    return [a.get() for a in arrays]


def emulated(method: str, n: int, *args, **kwargs) -> list[np.ndarray]:
    """The CPU emulator's answer for n devices."""
    cpu = CpuBackend()
    return [np.array(a) for a in getattr(cpu, method)(*args, [f"CPU:{i}" for i in range(n)], **kwargs)]


def assert_same(actual: list[np.ndarray], expected: list[np.ndarray], exact: bool) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        if exact:
            np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), e.reshape(-1).view(np.uint8))  # bit for bit
        else:
            np.testing.assert_allclose(a.astype(np.complex128), e.astype(np.complex128), rtol=1e-2, atol=1e-2)


# -- NCCL, one rank ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("mean", [False, True])
def test_single_rank_all_reduce_through_nccl(backend, name, mean):
    if mean and name not in FLOATS:
        pytest.skip("means are taken of floats only")
    data = random(np.random.default_rng(0), 1001, name)
    flat = backend.to_device(data, "GPU:0")
    chunks = plan_concat_split([((1001,), data.dtype)], 3).buffers[0].chunks
    (out,) = backend.all_reduce([flat], chunks, ["GPU:0"], mean)
    assert out is not flat and out.data.ptr != flat.data.ptr  # never written into the input
    np.testing.assert_array_equal(out.get(), data)
    np.testing.assert_array_equal(flat.get(), data)


@pytest.mark.parametrize("name", DTYPES)
def test_single_rank_all_gather_broadcast_and_reduce_scatter_through_nccl(backend, name):
    data = random(np.random.default_rng(1), 600, name)
    flat = backend.to_device(data, "GPU:0")
    (gathered,) = backend.all_gather([flat], ["GPU:0"])
    np.testing.assert_array_equal(gathered.get(), data)
    (copy,) = backend.broadcast(flat, ["GPU:0"])
    assert copy.data.ptr != flat.data.ptr
    np.testing.assert_array_equal(copy.get(), data)
    (part,) = backend.reduce_scatter([flat], ["GPU:0"])
    np.testing.assert_array_equal(part.get(), data)


def test_broadcast_keeps_the_shape_and_uploads_host_values(backend):
    (out,) = backend.broadcast(np.arange(6.0).reshape(2, 3), ["GPU:0"])
    assert isinstance(out, cupy.ndarray) and out.shape == (2, 3)
    np.testing.assert_array_equal(out.get(), np.arange(6.0).reshape(2, 3))


# -- replicas sharing one GPU: the same-device path matches the CPU emulator bit for bit -------------------------------


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("mean", [False, True])
def test_shared_gpu_all_reduce_equals_the_emulator(backend, name, mean):
    if mean and name not in FLOATS:
        pytest.skip("means are taken of floats only")
    rng = np.random.default_rng(2)
    datas = [random(rng, 777, name) for _ in range(4)]
    flats = [backend.to_device(d, "GPU:0") for d in datas]
    out = backend.all_reduce(flats, [(0, 777)], ["GPU:0"] * 4, mean)
    assert len({o.data.ptr for o in out}) == 4  # each replica owns its result
    assert_same(host(out), emulated("all_reduce", 4, datas, [(0, 777)], mean=mean), exact=True)


@pytest.mark.parametrize("name", DTYPES)
def test_shared_gpu_gather_scatter_and_broadcast_equal_the_emulator(backend, name):
    rng = np.random.default_rng(3)
    datas = [random(rng, 400, name) for _ in range(4)]
    flats = [backend.to_device(d, "GPU:0") for d in datas]
    assert_same(host(backend.all_gather(flats, ["GPU:0"] * 4)), emulated("all_gather", 4, datas), exact=True)
    assert_same(host(backend.reduce_scatter(flats, ["GPU:0"] * 4)), emulated("reduce_scatter", 4, datas), exact=True)
    assert_same(host(backend.broadcast(flats[1], ["GPU:0"] * 4)), [datas[1]] * 4, exact=True)


def test_pack_and_unpack_round_trip_a_plan(backend):
    rng = np.random.default_rng(4)
    shapes = [(3, 4), (), (17,), (2, 2, 2), (0,), (1000,)]
    values = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    for num_packs in (0, 1, 3):
        for buffer in plan_concat_split([(v.shape, v.dtype) for v in values], num_packs).buffers:
            members = [backend.to_device(values[m.index], "GPU:0") for m in buffer.members]
            flat = backend.pack(members, buffer, "GPU:0")
            np.testing.assert_array_equal(flat.get(), np.concatenate([values[m.index].ravel() for m in buffer.members]))
            for member, out in zip(buffer.members, backend.unpack(flat, buffer)):
                np.testing.assert_array_equal(out.get(), values[member.index])


def test_add_n_sums_in_order_with_numpys_promotion(backend):
    arrays = [np.arange(5, dtype=np.int32), np.ones(5, np.float32), np.full(5, 0.5, np.float64)]
    out = backend.add_n([backend.to_device(a, "GPU:0") for a in arrays], "GPU:0")
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out.get(), CpuBackend().add_n(arrays, "CPU:0"))


# -- strategies on one GPU shared by 4 replicas ------------------------------------------------------------------------


@pytest.mark.parametrize("op", [distrib.NcclAllReduce(), distrib.NcclAllReduce(num_packs=0),
                                distrib.HierarchicalCopyAllReduce(num_packs=2), distrib.ReductionToOneDevice()],
                         ids=repr)
@pytest.mark.parametrize("reduce_op", ["SUM", "MEAN"])
def test_cross_device_ops_on_a_shared_gpu_equal_the_emulator(op, reduce_op):
    def step():
        ctx = distrib.get_replica_context()
        r = ctx.replica_id_in_sync_group
        xp = np if ctx.devices[0].startswith("CPU") else cupy
        values = {"w": xp.arange(12, dtype=xp.float32).reshape(3, 4) * (r + 1), "n": xp.int32(r + 1),
                  "h": xp.full(5, r, xp.float16)}
        return ctx.all_reduce(reduce_op, values)

    results = {}
    for devices in (["GPU:0"] * 4, [f"CPU:{i}" for i in range(4)]):
        strategy = distrib.MirroredStrategy(devices, cross_device_ops=op)
        out = strategy.run(step)
        results[devices[0][:3]] = {k: [strategy.extended._backend.to_host(v) for v in
                                       strategy.experimental_local_results(out[k])] for k in out}
    for key in results["CPU"]:
        assert_same(results["GPU"][key], results["CPU"][key], exact=True)


# -- the watchdog and error translation --------------------------------------------------------------------------------

SPIN = r'''
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
'''


def test_a_collective_past_its_deadline_aborts_and_the_next_one_works(backend):
    spin = cupy.RawKernel(SPIN, "spin")
    flat = backend.to_device(np.ones(8, np.float32), "GPU:0")
    with backend.device_scope("GPU:0"):
        spin((1,), (1,), (np.int64(5 * 10**9),))  # seconds of work queued before the all-reduce on the same stream
    backend.all_reduce([flat], [(0, 8)], ["GPU:0"], False, timeout=0.2)  # returns at once: queued behind the spin
    with pytest.raises(DeadlineExceededError, match=r"^all_reduce did not complete within 0\.2 s on GPUs \[0\]"):
        backend.synchronize()  # the next synchronisation point raises what the watchdog found
    backend.synchronize()  # raised once: the backend stays usable
    (out,) = backend.all_reduce([flat], [(0, 8)], ["GPU:0"], False)
    np.testing.assert_array_equal(out.get(), np.ones(8, np.float32))


def test_collectives_return_before_the_gpu_has_run_them(backend):
    spin = cupy.RawKernel(SPIN, "spin")
    flat = backend.to_device(np.ones(8, np.float32), "GPU:0")
    with backend.device_scope("GPU:0"):
        spin((1,), (1,), (np.int64(10**9),))
    outs = [backend.all_reduce([flat], [(0, 8)], ["GPU:0"], False)[0] for _ in range(3)]
    assert backend._comms.watchdog.pending() >= 1  # the caller was not held until completion
    backend.synchronize()
    assert backend._comms.watchdog.pending() == 0
    for out in outs:
        np.testing.assert_array_equal(out.get(), np.ones(8, np.float32))


def test_out_of_memory_is_resource_exhausted_naming_the_operation(backend):
    from distrib.errors import ResourceExhaustedError

    with pytest.raises(ResourceExhaustedError, match="^empty ran out of GPU memory"):
        backend.empty((1 << 50,), np.float32, "GPU:0")  # a petabyte


def test_nccl_errors_become_collective_errors_naming_the_operation(backend):
    comms = nccl_comms.Communicators()
    flat = cupy.ones(4, np.float32)

    def invalid_datatype(rank, comm, stream):
        comm.allReduce(flat.data.ptr, flat.data.ptr, 4, 99, 0, stream)

    with pytest.raises(CollectiveError, match=r"^all_reduce failed on GPUs \[0\]: NCCL reported") as info:
        comms.run("all_reduce", [0], [backend._stream(0)], invalid_datatype, timeout=10)
    assert info.value.status is not None and info.value.__cause__ is not None
    assert not comms._groups  # aborted and forgotten


def test_a_strategy_on_a_gpu_runs_and_reduces_to_host():
    strategy = distrib.MirroredStrategy(["GPU:0", "GPU:0"])
    out = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", cupy.ones(3)))
    assert isinstance(strategy.experimental_local_results(out)[0], cupy.ndarray)
    np.testing.assert_array_equal(strategy.reduce("MEAN", out, axis=None), np.full(3, 2.0))


# -- discovery ---------------------------------------------------------------------------------------------------------


def test_nvml_names_each_gpu_by_the_uuid_cuda_gives_its_ordinal(backend):
    from distrib.backends.cuda.devices import cuda_gpus

    assert [g.uuid for g in backend.gpus] == [g.uuid for g in cuda_gpus()]
    assert backend.default_devices() == tuple(f"GPU:{k}" for k in range(cupy.cuda.runtime.getDeviceCount()))


def test_prefetch_to_device_delivers_the_batches_ordered_on_the_device_stream(backend):
    rng = np.random.default_rng(7)
    batches = [[rng.standard_normal((256, 64)).astype(np.float32), rng.integers(0, 10, 256).astype(np.int32),
                np.zeros((0, 3), np.float32)] for _ in range(6)]
    placed = [backend.prefetch_to_device(batch, "GPU:0") for batch in batches]
    with backend.device_scope("GPU:0"):  # kernels on the device's stream see the copied data without a host wait
        sums = [float(arrays[0].sum()) for arrays in placed]
    for batch, arrays, total in zip(batches, placed, sums):
        for host, device in zip(batch, arrays):
            assert device.shape == host.shape and device.dtype == host.dtype
            np.testing.assert_array_equal(device.get(), host)
        assert total == pytest.approx(float(batch[0].sum()), rel=1e-4)


def test_distributed_dataset_on_the_gpu_matches_the_emulator():
    data = np.arange(40, dtype=np.float32).reshape(20, 2)
    batches = [data[i:i + 7] for i in range(0, 20, 7)]
    gpu = distrib.MirroredStrategy(["GPU:0"] * 4)
    cpu = distrib.MirroredStrategy([f"CPU:{i}" for i in range(4)])
    for on_gpu, on_cpu in zip(gpu.experimental_distribute_dataset(batches), cpu.experimental_distribute_dataset(batches)):
        for a, b in zip(gpu.experimental_local_results(on_gpu), cpu.experimental_local_results(on_cpu)):
            np.testing.assert_array_equal(cupy.asnumpy(a), b)


# -- a whole plan in one NCCL group ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("num_packs", [1, 0, 3])
def test_a_whole_plan_in_one_group_equals_pack_by_pack_and_the_emulator(backend, mean, num_packs):
    from distrib.backends.packed import execute_pack_by_pack
    from distrib.plan import NATIVE, all_reduce_plan, plan_concat_split

    rng = np.random.default_rng(num_packs)
    values = [random(rng, 12, "float32").reshape(3, 4), random(rng, 5, "int16"), random(rng, 7, "int32"),
              random(rng, 3, "bfloat16"), random(rng, 4, "complex64"), random(rng, 6, "bool")]
    if mean:
        values = [v for v in values if v.dtype != np.bool_]
    plan = all_reduce_plan(plan_concat_split([(v.shape, v.dtype) for v in values], num_packs), NATIVE, mean, 1)
    on_gpu = [[backend.to_device(v, "GPU:0") for v in values]]
    launches = backend._comms.watchdog
    (grouped,) = backend.execute(plan, on_gpu, ["GPU:0"])
    assert launches.pending() <= 1  # one group call for the whole plan, not one per pack
    (reference,) = execute_pack_by_pack(backend, plan, on_gpu, ["GPU:0"], None)
    (emulated,) = CpuBackend().execute(plan, [values], ["CPU:0"])
    for got, want, cpu in zip(grouped, reference, emulated):
        assert got.shape == cpu.shape and got.dtype == np.asarray(cpu).dtype
        np.testing.assert_array_equal(got.get(), want.get())
        assert_same([got.get()], [np.asarray(cpu)], exact=True)
