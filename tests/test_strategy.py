"""MirroredStrategy on four emulated CPU replicas: run, reduce, gather, the extended API, collectives, the default."""

from __future__ import annotations

import collections
import threading

import numpy as np
import pytest

import distrib
from distrib import CommunicationOptions, Mirrored, PerReplica, ReduceOp

pytestmark = pytest.mark.timeout(30)

DEVICES = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
Pair = collections.namedtuple("Pair", "first second")


@pytest.fixture(scope="module")
def strategy():
    return distrib.MirroredStrategy(DEVICES)


def per_replica(strategy, fn):
    """A PerReplica holding fn(replica_id) on each replica."""
    return strategy.experimental_distribute_values_from_function(lambda ctx: fn(ctx.replica_id_in_sync_group))


def local(strategy, value):
    return strategy.experimental_local_results(value)


def replica_id():
    return distrib.get_replica_context().replica_id_in_sync_group


# -- run --------------------------------------------------------------------------------------------------------


def test_run_accepts_args_as_a_list_and_kwargs(strategy):
    value = per_replica(strategy, lambda r: np.float32(r))
    out = strategy.run(lambda x, scale=1: x * scale, args=[value], kwargs={"scale": np.float32(10)})
    assert [float(x) for x in local(strategy, out)] == [0.0, 10.0, 20.0, 30.0]


def test_run_accepts_run_options(strategy):
    out = strategy.run(replica_id, options=distrib.RunOptions())
    assert local(strategy, out) == (0, 1, 2, 3)


def test_replicas_run_concurrently(strategy):
    barrier = threading.Barrier(4, timeout=10)
    out = strategy.run(lambda: barrier.wait() is not None)  # returns only when all four wait at once
    assert out is True


def test_each_replica_runs_on_its_own_named_thread(strategy):
    out = strategy.run(lambda: threading.current_thread().name)
    assert local(strategy, out) == ("distrib-replica-0", "distrib-replica-1", "distrib-replica-2",
                                    "distrib-replica-3")


def test_replica_threads_are_reused_across_runs():
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    before = set(threading.enumerate())
    idents = [local(strategy, strategy.run(threading.get_ident)) for _ in range(5)]
    assert len(set(idents)) == 1
    assert threading.get_ident() not in idents[0]
    started = {t for t in set(threading.enumerate()) - before if t.name.startswith("distrib-replica-")}
    assert {t.ident for t in started} == set(idents[0])


# -- reduce ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blocks(strategy):
    """Replica r holds [[0, 1, 2], [3, 4, 5]] + 10 r."""
    return per_replica(strategy, lambda r: np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * r)


@pytest.mark.parametrize("op, axis, expected", [
    ("SUM", None, [[60, 64, 68], [72, 76, 80]]),
    ("MEAN", None, [[15, 16, 17], [18, 19, 20]]),
    ("SUM", 0, [132, 140, 148]),
    ("MEAN", 0, [16.5, 17.5, 18.5]),
    ("SUM", 1, [192, 228]),
    ("MEAN", 1, [16, 19]),
    ("SUM", -1, [192, 228]),
    ("MEAN", -2, [16.5, 17.5, 18.5]),
    ("SUM", (0, 1), 420),
    ("MEAN", (0, 1), 17.5),
    ("MEAN", (-1, 0), 17.5),
    ("SUM", [1], [192, 228]),
])
def test_reduce_along_an_axis_reduces_within_and_across_replicas(strategy, blocks, op, axis, expected):
    result = strategy.reduce(op, blocks, axis=axis)
    assert isinstance(result, np.ndarray) and result.dtype == np.float32
    np.testing.assert_allclose(result, expected)


def test_reduce_accepts_the_enum_and_any_case(strategy, blocks):
    np.testing.assert_array_equal(strategy.reduce(ReduceOp.MEAN, blocks, axis=0),
                                  strategy.reduce("mean", blocks, axis=0))


def test_reduce_mean_divides_by_the_global_count_of_a_partial_batch(strategy):
    # a last batch of 6 rows split 3/2/1/0: replica r holds 3 - r rows of the value 3 - r; replica 3 has none
    rows = per_replica(strategy, lambda r: np.full((3 - r, 2), 3 - r, np.float32))
    np.testing.assert_allclose(strategy.reduce("MEAN", rows, axis=0), [(9 + 4 + 1) / 6] * 2)
    np.testing.assert_allclose(strategy.reduce("SUM", rows, axis=0), [14, 14])
    np.testing.assert_allclose(strategy.reduce("MEAN", rows, axis=(0, 1)), 14 / 6)


def test_reduce_mean_of_integers_along_an_axis_is_a_float(strategy):
    ints = per_replica(strategy, lambda r: np.array([r, r + 1], np.int32))
    result = strategy.reduce("MEAN", ints, axis=0)
    assert result.dtype.kind == "f"
    assert float(result) == 2.0
    assert strategy.reduce("SUM", ints, axis=0).dtype == np.int32


def test_reduce_of_a_nested_structure_reduces_each_leaf(strategy):
    value = {"a": per_replica(strategy, lambda r: np.float32(r)),
             "b": [per_replica(strategy, lambda r: np.full(2, r, np.int64))]}
    out = strategy.reduce("SUM", value, axis=None)
    assert float(out["a"]) == 6.0
    np.testing.assert_array_equal(out["b"][0], [6, 6])


def test_reduce_of_a_plain_value(strategy):
    assert float(strategy.reduce("MEAN", np.float32(3), axis=None)) == 3.0
    # with an axis, each replica reduces its own copy first, as in TensorFlow: 4 replicas x 3 ones
    assert float(strategy.reduce("SUM", np.ones(3, np.float32), axis=0)) == 12.0
    assert float(strategy.reduce("MEAN", np.ones(3, np.float32), axis=0)) == 1.0
    with pytest.raises(ValueError, match="A non-distributed value cannot be reduced with SUM on 4 replicas"):
        strategy.reduce("SUM", np.float32(3), axis=None)


@pytest.mark.parametrize("axis", [2, -3, (0, 2)])
def test_reduce_rejects_axes_out_of_range(strategy, blocks, axis):
    with pytest.raises(ValueError, match="is out of range for a value of rank 2"):
        strategy.reduce("SUM", blocks, axis=axis)


@pytest.mark.parametrize("axis", [1.0, True, "0"])
def test_reduce_rejects_axes_that_are_not_ints(strategy, blocks, axis):
    with pytest.raises(TypeError, match="axis must be an int, a tuple of ints or None"):
        strategy.reduce("SUM", blocks, axis=axis)


# -- gather -------------------------------------------------------------------------------------------------------


def test_gather_concatenates_along_any_axis(strategy, blocks):
    assert strategy.gather(blocks, axis=0).shape == (8, 3)
    along_last = strategy.gather(blocks, axis=-1)
    assert isinstance(along_last, np.ndarray) and along_last.shape == (2, 12)
    np.testing.assert_array_equal(along_last[0], [0, 1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32])


def test_gather_accepts_sizes_that_differ_along_the_axis_even_empty(strategy):
    value = per_replica(strategy, lambda r: np.full((2, r), r, np.int32))  # replica 0 contributes nothing
    np.testing.assert_array_equal(strategy.gather(value, axis=1), [[1, 2, 2, 3, 3, 3]] * 2)


def test_gather_of_a_nested_structure_gathers_each_leaf(strategy):
    value = {"ids": per_replica(strategy, lambda r: np.array([r])), "plain": np.zeros((1, 2))}
    out = strategy.gather(value, axis=0)
    np.testing.assert_array_equal(out["ids"], [0, 1, 2, 3])
    assert out["plain"].shape == (1, 2)  # a plain value is one component


def test_gather_rejects_shapes_that_differ_off_the_axis(strategy):
    value = per_replica(strategy, lambda r: np.zeros((2, r + 1)))
    with pytest.raises(ValueError, match=r"^Strategy.gather needs shapes that differ only along axis 0\. "
                                         r"Received: replica 1"):
        strategy.gather(value, axis=0)


def test_gather_rejects_scalars(strategy):
    with pytest.raises(ValueError, match="Strategy.gather needs values of rank >= 1"):
        strategy.gather(per_replica(strategy, np.float32), axis=0)


# -- local results and values from a function ---------------------------------------------------------------------


def test_local_results_of_a_list_gives_one_list_per_replica(strategy):
    ids = per_replica(strategy, lambda r: r)
    assert local(strategy, [ids, "shared"]) == ([0, "shared"], [1, "shared"], [2, "shared"], [3, "shared"])


def test_local_results_need_distributed_values_of_one_length(strategy):
    with pytest.raises(ValueError, match="experimental_local_results needs distributed values of one length"):
        local(strategy, [PerReplica([1, 2]), PerReplica([1, 2, 3])])


def test_values_from_function_always_wrap(strategy):
    shared = np.zeros(3)
    value = strategy.experimental_distribute_values_from_function(lambda ctx: shared)
    assert isinstance(value, PerReplica)
    assert all(component is shared for component in value.values)


def test_values_from_function_distributes_nested_values(strategy):
    value = per_replica(strategy, lambda r: {"x": np.float32(r), "tag": f"replica-{r}"})
    assert isinstance(value["x"], PerReplica)
    assert value["tag"].values == ("replica-0", "replica-1", "replica-2", "replica-3")


def test_values_from_function_sees_each_replica_once_in_order(strategy):
    seen = []
    strategy.experimental_distribute_values_from_function(seen.append)
    assert [(c.replica_id_in_sync_group, c.num_replicas_in_sync) for c in seen] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert repr(seen[1]) == "ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=4)"


def test_values_from_function_needs_a_callable(strategy):
    with pytest.raises(TypeError, match="value_fn must be callable"):
        strategy.experimental_distribute_values_from_function([1, 2, 3, 4])


# -- extended: reduce_to, batch_reduce_to, broadcast_to, devices ----------------------------------------------------


def test_reduce_to_a_device_name_gives_a_mirrored_there(strategy, blocks):
    out = strategy.extended.reduce_to("MEAN", blocks, destinations="CPU:1")
    assert type(out) is Mirrored and len(out.values) == 1
    np.testing.assert_array_equal(out.values[0], [[15, 16, 17], [18, 19, 20]])


def test_reduce_to_accepts_tensorflow_device_strings(strategy, blocks):
    out = strategy.extended.reduce_to("SUM", blocks, destinations="/job:localhost/replica:0/task:0/device:CPU:2")
    np.testing.assert_array_equal(out.values[0], [[60, 64, 68], [72, 76, 80]])


def test_reduce_to_of_a_mirrored_value(strategy, blocks):
    mirrored = strategy.extended.reduce_to("SUM", blocks, destinations=blocks)
    assert strategy.extended.reduce_to("MEAN", mirrored, destinations=blocks) is mirrored
    with pytest.raises(ValueError, match=r"reduce_to\(SUM\) of a Mirrored value would count it once per replica"):
        strategy.extended.reduce_to("SUM", mirrored, destinations=blocks)


def test_reduce_to_of_a_plain_value(strategy, blocks):
    assert strategy.extended.reduce_to("SUM", 0, destinations=blocks) == 0
    assert float(strategy.extended.reduce_to("MEAN", np.float32(2), destinations=blocks)) == 2.0
    with pytest.raises(ValueError, match="A non-distributed value cannot be reduced with SUM"):
        strategy.extended.reduce_to("SUM", np.float32(2), destinations=blocks)


@pytest.mark.parametrize("destinations, error, message", [
    (None, ValueError, "destinations must be a device name"),
    (["CPU:0"], ValueError, "destinations can not be a list or tuple"),
    (("CPU:0", "CPU:1"), ValueError, "destinations can not be a list or tuple"),
    (PerReplica([1, 2]), ValueError, "destinations has 2 components but the strategy has 4 replicas"),
    (3, TypeError, "destinations must be a device name"),
])
def test_reduce_to_rejects_bad_destinations(strategy, blocks, destinations, error, message):
    with pytest.raises(error, match=message):
        strategy.extended.reduce_to("SUM", blocks, destinations=destinations)


def test_batch_reduce_to_keeps_the_order_of_mixed_destinations(strategy, blocks):
    ints = per_replica(strategy, lambda r: np.array([r + 1], np.int32))
    options = CommunicationOptions(bytes_per_pack=16)
    out = strategy.extended.batch_reduce_to("MEAN", [(blocks, blocks), (ints, "CPU:0"), (ints, ints)], options)
    assert [len(m.values) for m in out] == [4, 1, 4]
    np.testing.assert_array_equal(out[0].values[3], [[15, 16, 17], [18, 19, 20]])
    assert out[1].values[0].tolist() == [2.5]
    assert [m.tolist() for m in out[2].values] == [[2.5]] * 4


def test_batch_reduce_to_needs_a_list_of_pairs(strategy, blocks):
    with pytest.raises(TypeError, match="value_destination_pairs must be a list of"):
        strategy.extended.batch_reduce_to("SUM", blocks)
    with pytest.raises(TypeError, match=r"value_destination_pairs\[1\] must be a \(value, destinations\) pair"):
        strategy.extended.batch_reduce_to("SUM", [(blocks, blocks), (blocks,)])


def test_broadcast_to_copies_an_array_to_every_device(strategy, blocks):
    source = np.arange(3.0)
    out = strategy.extended.broadcast_to(source, destinations=blocks)
    assert type(out) is Mirrored and len(out.values) == 4
    for copy in out.values:
        np.testing.assert_array_equal(copy, source)
        assert not np.shares_memory(copy, source)


def test_broadcast_to_returns_python_numbers_unchanged(strategy, blocks):
    assert strategy.extended.broadcast_to(3, destinations=blocks) == 3
    assert strategy.extended.broadcast_to(2.5, destinations=blocks) == 2.5


def test_broadcast_to_one_device(strategy):
    out = strategy.extended.broadcast_to(np.ones(2), destinations="CPU:3")
    assert len(out.values) == 1


def test_devices_are_canonical_and_in_replica_order():
    strategy = distrib.MirroredStrategy(["/cpu:2", "/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:1"])
    assert strategy.extended.worker_devices == ("CPU:2", "CPU:0", "CPU:1")
    assert strategy.extended.parameter_devices == ("CPU:2", "CPU:0", "CPU:1")
    assert strategy.num_replicas_in_sync == 3
    assert strategy.extended.experimental_require_static_shapes is False
    out = strategy.run(lambda: distrib.get_replica_context().devices)
    assert local(strategy, out) == (("CPU:2",), ("CPU:0",), ("CPU:1",))


def test_a_strategy_without_devices_uses_emulated_cpus_when_no_gpu_can_run():
    from distrib.backends import cuda_problem

    if cuda_problem() is None:
        pytest.skip("a usable GPU makes MirroredStrategy() pick the GPUs")
    strategy = distrib.MirroredStrategy()
    assert strategy.num_replicas_in_sync >= 1
    assert all(d.startswith("CPU:") for d in strategy.extended.worker_devices)


# -- all_reduce ---------------------------------------------------------------------------------------------------


def test_all_reduce_of_a_nested_structure_keeps_structure_and_dtypes(strategy):
    def step():
        r = replica_id()
        value = {"w": np.full((2, 3), r, np.float32), "b": [np.int32(r + 1), np.float64(r)],
                 "pair": Pair(np.arange(3, dtype=np.int64) * r, None), "empty": ()}
        return distrib.get_replica_context().all_reduce("SUM", value)

    for out in local(strategy, strategy.run(step)):
        assert set(out) == {"w", "b", "pair", "empty"}
        np.testing.assert_array_equal(out["w"], np.full((2, 3), 6, np.float32))
        assert out["w"].dtype == np.float32
        assert out["b"][0] == 10 and out["b"][0].dtype == np.int32
        assert out["b"][1] == 6.0 and out["b"][1].dtype == np.float64
        assert type(out["pair"]) is Pair and out["pair"].second is None
        np.testing.assert_array_equal(out["pair"].first, [0, 6, 12])
        assert out["empty"] == ()


def test_all_reduce_mean_of_integers_gives_floats(strategy):
    out = strategy.run(lambda: distrib.get_replica_context().all_reduce("MEAN", np.array([replica_id()] * 2)))
    for value in local(strategy, out):
        assert value.dtype.kind == "f"
        np.testing.assert_array_equal(value, [1.5, 1.5])


def test_all_reduce_accepts_python_numbers(strategy):
    out = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", [1, 0.5]))
    assert [[float(x) for x in v] for v in local(strategy, out)] == [[4.0, 2.0]] * 4


def test_all_reduce_of_nothing_returns_it(strategy):
    out = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", {"a": [], "b": None}))
    assert out == {"a": [], "b": None}


@pytest.mark.parametrize("options", [None, CommunicationOptions(bytes_per_pack=8),
                                     CommunicationOptions(bytes_per_pack=1 << 20, implementation="RING")])
@pytest.mark.parametrize("cross_device_ops", [distrib.NcclAllReduce(num_packs=0), distrib.NcclAllReduce(num_packs=3),
                                              distrib.ReductionToOneDevice(), distrib.HierarchicalCopyAllReduce()],
                         ids=repr)
def test_all_reduce_gives_the_same_sums_whatever_the_packing(cross_device_ops, options):
    strategy = distrib.MirroredStrategy(DEVICES, cross_device_ops=cross_device_ops)

    def step():
        r = replica_id()
        grads = [np.full(shape, r + k, np.float32) for k, shape in enumerate([(), (3,), (2, 2), (5,), (17,)])]
        return distrib.get_replica_context().all_reduce("MEAN", grads + [np.int32(r)], options=options)

    for out in local(strategy, strategy.run(step)):
        for k, value in enumerate(out[:-1]):
            np.testing.assert_allclose(value, np.full_like(value, 1.5 + k))
        assert float(out[-1]) == 1.5


class RecordingAllReduce(distrib.NcclAllReduce):
    """An NcclAllReduce that records the options each batched all-reduce receives."""

    def __init__(self):
        super().__init__(num_packs=1)
        self.seen = []

    def batch_all_reduce(self, backend, op, values, devices, options):
        self.seen.append(options)
        return super().batch_all_reduce(backend, op, values, devices, options)


def test_all_reduce_options_are_merged_over_the_strategys_with_tensorflows_rule():
    recorder = RecordingAllReduce()
    strategy = distrib.MirroredStrategy(DEVICES, cross_device_ops=recorder, communication_options=CommunicationOptions(
        bytes_per_pack=64, timeout_seconds=30))

    def step():
        ctx = distrib.get_replica_context()
        ctx.all_reduce("SUM", np.float32(1))
        ctx.all_reduce("SUM", np.float32(1), options=CommunicationOptions(timeout_seconds=5, implementation="ring"))
        return ctx.all_reduce("SUM", np.float32(1), options=CommunicationOptions(bytes_per_pack=8))

    strategy.run(step)
    assert recorder.seen == [
        CommunicationOptions(bytes_per_pack=64, timeout_seconds=30),
        CommunicationOptions(bytes_per_pack=64, timeout_seconds=5, implementation="RING"),
        CommunicationOptions(bytes_per_pack=8, timeout_seconds=30),
    ]


def test_all_reduce_rejects_options_of_another_kind(strategy):
    with pytest.raises(TypeError, match="options must be a CommunicationOptions"):
        strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", 1.0, options={"bytes_per_pack": 8}))


# -- all_gather ---------------------------------------------------------------------------------------------------


def test_all_gather_accepts_unequal_sizes_along_the_axis(strategy):
    def step():
        r = replica_id()
        return distrib.get_replica_context().all_gather(
            {"rows": np.full((r, 2), r, np.int32), "cols": np.full((1, r + 1), r, np.float32)}, axis=0)

    # along axis 0 "rows" may differ, but "cols" (1, r+1) differs off the axis
    with pytest.raises(ValueError, match="all_gather needs shapes that differ only along axis 0"):
        strategy.run(step)

    def step_rows():
        r = replica_id()
        return distrib.get_replica_context().all_gather({"rows": np.full((r, 2), r, np.int32)}, axis=0)

    for out in local(strategy, strategy.run(step_rows)):
        np.testing.assert_array_equal(out["rows"], [[1, 1], [2, 2], [2, 2], [3, 3], [3, 3], [3, 3]])
        assert out["rows"].dtype == np.int32


def test_all_gather_along_a_negative_axis(strategy):
    def step():
        r = replica_id()
        return distrib.get_replica_context().all_gather([np.full((2, r + 1), r, np.int64)], axis=-1)

    for (out,) in local(strategy, strategy.run(step)):
        np.testing.assert_array_equal(out, [[0, 1, 1, 2, 2, 2, 3, 3, 3, 3]] * 2)


def test_all_gather_of_nothing_returns_it(strategy):
    assert strategy.run(lambda: distrib.get_replica_context().all_gather([], axis=0)) == []


# -- merge_call ---------------------------------------------------------------------------------------------------


def test_merge_call_regroups_args_and_hands_each_replica_its_share(strategy):
    calls = []
    shared = object()

    def merge_fn(merge_strategy, x, tag, *, scale):
        calls.append((x, tag, scale))
        return PerReplica([v * scale for v in x.values])

    scale = np.float32(10)  # the same object on every replica: merge_fn gets it unwrapped

    def step():
        r = replica_id()
        return distrib.get_replica_context().merge_call(merge_fn, args=(np.float32(r), shared),
                                                        kwargs={"scale": scale})

    out = strategy.run(step)
    assert [float(x) for x in local(strategy, out)] == [0.0, 10.0, 20.0, 30.0]
    ((x, tag, received_scale),) = calls  # merge_fn ran once, for all replicas
    assert isinstance(x, PerReplica) and tag is shared and received_scale is scale


def test_merge_call_result_that_is_not_distributed_goes_to_every_replica(strategy):
    token = object()
    assert strategy.run(lambda: distrib.get_replica_context().merge_call(lambda s: token)) is token


def test_merge_fn_can_use_the_cross_replica_api(strategy):
    def merge_fn(merge_strategy, value):
        return merge_strategy.extended.batch_reduce_to("SUM", [(value, value), (value, value)])

    def step():
        first, second = distrib.get_replica_context().merge_call(merge_fn, args=(np.float32(replica_id()),))
        return first + second

    assert [float(x) for x in local(strategy, strategy.run(step))] == [12.0] * 4


def test_merge_calls_run_in_program_order(strategy):
    order = []

    def step():
        ctx = distrib.get_replica_context()
        for k in range(3):
            ctx.merge_call(lambda s, k=k: order.append(k))
        return ctx.all_reduce("SUM", np.float32(1))

    out = strategy.run(step)
    assert order == [0, 1, 2]
    assert [float(x) for x in local(strategy, out)] == [4.0] * 4


def test_merge_fn_must_be_callable(strategy):
    with pytest.raises(TypeError, match="merge_fn must be callable"):
        strategy.run(lambda: distrib.get_replica_context().merge_call("not a function"))


def test_run_cannot_be_called_from_a_merge_fn(strategy):
    with pytest.raises(RuntimeError, match="Strategy.run cannot be called from inside a merge_call"):
        strategy.run(lambda: distrib.get_replica_context().merge_call(lambda s: s.run(lambda: None)))


# -- the default strategy ---------------------------------------------------------------------------------------------


def test_the_default_strategy_runs_fn_on_the_calling_thread():
    default = distrib.get_strategy()
    assert default.run(lambda x: (x + 1, threading.get_ident()), args=(1,)) == (2, threading.get_ident())
    assert default.num_replicas_in_sync == 1
    assert default.extended.worker_devices == ("CPU:0",)


def test_the_default_strategy_reduces_and_gathers_one_replica():
    default = distrib.get_strategy()
    result = default.reduce("SUM", np.float32(3), axis=None)
    assert isinstance(result, np.ndarray) and float(result) == 3.0
    np.testing.assert_array_equal(default.reduce("MEAN", np.arange(4.0), axis=0), 1.5)
    np.testing.assert_array_equal(default.gather(np.ones(2), axis=0), [1.0, 1.0])
    assert default.experimental_local_results("x") == ("x",)
    assert default.experimental_distribute_values_from_function(lambda ctx: ctx.num_replicas_in_sync).values == (1,)


def test_the_default_replica_context_collectives_return_the_value():
    ctx = distrib.get_replica_context()
    assert float(ctx.all_reduce("MEAN", np.float32(3))) == 3.0
    np.testing.assert_array_equal(ctx.all_gather(np.ones(2), axis=0), [1.0, 1.0])
    assert ctx.devices == ("CPU:0",)


# -- printing -------------------------------------------------------------------------------------------------------


def test_public_objects_print_themselves(strategy):
    assert repr(strategy) == "<MirroredStrategy devices=('CPU:0', 'CPU:1', 'CPU:2', 'CPU:3')>"
    assert repr(strategy.extended) == "<MirroredExtended devices=('CPU:0', 'CPU:1', 'CPU:2', 'CPU:3')>"
    assert repr(distrib.get_strategy()) == "<DefaultStrategy>"
    out = strategy.run(lambda: repr(distrib.get_replica_context()))
    assert local(strategy, out)[2] == "<ReplicaContext replica_id_in_sync_group=2 num_replicas_in_sync=4>"
    assert repr(distrib.NcclAllReduce(num_packs=2)) == "NcclAllReduce(num_packs=2)"
    assert repr(distrib.HierarchicalCopyAllReduce()) == "HierarchicalCopyAllReduce(num_packs=1)"
    assert repr(distrib.ReductionToOneDevice()) == "ReductionToOneDevice(reduce_to_device=None)"
    assert repr(distrib.ValueContext(1, 4)) == "ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=4)"
    assert repr(CommunicationOptions(bytes_per_pack=64)).startswith("CommunicationOptions(bytes_per_pack=64, ")
