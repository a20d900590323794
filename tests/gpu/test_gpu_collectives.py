"""The CUDA backend's collectives on a GPU: NCCL single-rank, the shared-GPU path, strategies, whole plans."""

from __future__ import annotations

import numpy as np
import pytest

import distrib
from distrib.backends import get_backend
from distrib.backends.cpu import CpuBackend
from distrib.plan import plan_concat_split
from gpu_support import DTYPES, FLOATS, assert_same, emulated, host, random, shared_gpu_and_emulator

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")


@pytest.fixture(scope="module")
def backend():
    return get_backend("cuda")


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


@pytest.mark.parametrize("mean", [False, True])
def test_complex64_views_at_an_odd_float32_offset_reduce_on_a_shared_gpu(backend, mean):
    # CuPy's view can place complex64 pairs 4 bytes past their alignment; a pack of one would hand such an array
    # to the reduce kernel, whose 8-byte reads would end the CUDA context
    from distrib.plan import NATIVE, all_reduce_plan

    rng = np.random.default_rng(6)
    datas = [random(rng, 6, "complex64") for _ in range(4)]
    views = [backend.to_device(np.concatenate([[0], d.view(np.float32)]).astype(np.float32), "GPU:0")[1:]
             .view(np.complex64) for d in datas]
    assert all(v.data.ptr % 8 == 4 for v in views)
    plan = all_reduce_plan(plan_concat_split([((6,), np.complex64)], 1), NATIVE, mean, 4)
    got = backend.execute(plan, [[v] for v in views], ["GPU:0"] * 4)
    want = CpuBackend().execute(plan, [[d] for d in datas], [f"CPU:{i}" for i in range(4)])
    assert_same([g.get() for (g,) in got], [np.asarray(w) for (w,) in want], exact=True)
    total = backend.add_n(views, "GPU:0")
    np.testing.assert_array_equal(total.get(), CpuBackend().add_n(datas, "CPU:0"))


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
    for kind, strategy in shared_gpu_and_emulator(4, cross_device_ops=op).items():
        out = strategy.run(step)
        results[kind] = {k: [strategy.extended._backend.to_host(v) for v in strategy.experimental_local_results(out[k])]
                         for k in out}
    for key in results["CPU"]:
        assert_same(results["GPU"][key], results["CPU"][key], exact=True)


@pytest.mark.parametrize("execution", ["threads", "cooperative"])
def test_replicas_sharing_a_gpu_may_take_turns_on_the_calling_thread(execution):
    def step(x):
        ctx = distrib.get_replica_context()
        total = ctx.all_reduce("SUM", x * (ctx.replica_id_in_sync_group + 1))
        merged = ctx.merge_call(lambda strategy, v: strategy.reduce("SUM", v, axis=None), args=(total,))
        weight.assign_add(total)  # a MirroredVariable's write: one merge, every replica's copy written
        return total, merged

    strategies = shared_gpu_and_emulator(4, replica_execution=execution)
    results = {}
    for kind, strategy in strategies.items():
        xp = cupy if kind == "GPU" else np
        with strategy.scope():
            weight = distrib.Variable(xp.zeros(3, np.float32))
        total, merged = strategy.run(step, args=(xp.ones(3, np.float32),))
        host_of = strategy.extended.backend.to_host
        local = strategy.experimental_local_results
        results[kind] = ([host_of(t) for t in local(total)], [host_of(m) for m in local(merged)],
                         [np.asarray(v.numpy()) for v in local(weight)])
        assert strategy.extended.replica_execution == execution
        strategy.close()
    for gpu, cpu in zip(results["GPU"], results["CPU"]):
        assert_same(gpu, cpu, exact=True)


@pytest.mark.parametrize("replicas", [1, 4])
def test_batch_reduce_to_of_arrays_already_on_their_gpus_equals_the_placing_route_and_the_emulator(replicas):
    results = {}
    for kind, strategy in shared_gpu_and_emulator(replicas).items():
        xp = cupy if kind == "GPU" else np
        placed = [strategy.experimental_distribute_values_from_function(  # the backend's own arrays, in place
            lambda ctx, k=k: xp.arange(6, dtype=np.float32) * (ctx.replica_id_in_sync_group + k)) for k in range(3)]
        hosted = strategy.experimental_distribute_values_from_function(  # host arrays: placed on the way
            lambda ctx: np.full(4, ctx.replica_id_in_sync_group + 1, np.int32))
        batches = [[(v, v) for v in placed], [(v, v) for v in (*placed, hosted)]]  # all in place: checked in bulk
        out = [strategy.extended.batch_reduce_to(op, pairs) for pairs in batches for op in ("SUM", "MEAN")]
        results[kind] = [strategy.extended.backend.to_host(a) for reduced in out for m in reduced
                         for a in strategy.experimental_local_results(m)]
        strategy.close()
    assert_same(results["GPU"], results["CPU"], exact=True)


# -- a whole plan in one NCCL group ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("num_packs", [1, 0, 3])
def test_a_whole_plan_in_one_group_equals_pack_by_pack_and_the_emulator(backend, monkeypatch, mean, num_packs):
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
    # the earlier tests' group calls (the previous parametrization's pack-by-pack ones) leave the watchdog only when
    # its thread next polls, some milliseconds later: wait for them, so that only this call's are counted
    backend.synchronize()
    assert launches.pending() == 0
    watched = []
    watch = launches.watch
    monkeypatch.setattr(launches, "watch", lambda entry: (watched.append(entry), watch(entry))[1])
    (grouped,) = backend.execute(plan, on_gpu, ["GPU:0"])
    monkeypatch.undo()
    assert len(watched) == 1  # one group call (one watchdog entry) for the whole plan, not one per pack
    (reference,) = execute_pack_by_pack(backend, plan, on_gpu, ["GPU:0"], None)
    (emulated,) = CpuBackend().execute(plan, [values], ["CPU:0"])
    for got, want, cpu in zip(grouped, reference, emulated):
        assert got.shape == cpu.shape and got.dtype == np.asarray(cpu).dtype
        np.testing.assert_array_equal(got.get(), want.get())
        assert_same([got.get()], [np.asarray(cpu)], exact=True)


def test_later_steps_never_overwrite_a_kept_result_and_members_are_arrays_of_their_own(backend):
    """Output buffers are reused from step to step (backends/cuda/results.py) only once nothing holds them."""
    from distrib.plan import NATIVE, all_reduce_plan

    sizes = (20_000, 3)  # one pack of two members: each is copied out of it
    plan = all_reduce_plan(plan_concat_split([((n,), np.float32) for n in sizes], 1), NATIVE, False, 4)

    def step(k):  # replica r holds k + r everywhere: every sum is 4k + 6
        per_device = [[backend.to_device(np.full(n, k + r, np.float32), "GPU:0") for n in sizes] for r in range(4)]
        return backend.execute(plan, per_device, ["GPU:0"] * 4)

    first = step(0)
    kept_large, kept_small = first[1][0], first[2][1]
    assert kept_small.base is None and kept_large.base is None  # neither keeps the pack alive
    del first
    for k in range(1, 4):
        later = step(k)
        assert all((out.get() == 4 * k + 6).all() for outs in later for out in outs)
        del later
    assert (kept_large.get() == 6).all() and (kept_small.get() == 6).all()
