"""ReplicaContext on four emulated CPU replicas: all_reduce, all_gather and merge_call."""

from __future__ import annotations

import collections

import numpy as np
import pytest

import distrib
from distrib import CommunicationOptions, PerReplica
from distrib.values import flatten
from support import DEVICES, local, replica_id

pytestmark = pytest.mark.timeout(30)

Pair = collections.namedtuple("Pair", "first second")


def distrib_leaves(structure):
    """The leaves of a nested structure, in the order distrib flattens it."""
    return flatten(structure)[0]


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


def ragged_nested(r):
    """Replica r's nested value: several dtypes, lengths along axis 0 that differ between replicas (some 0)."""
    return {"f32": np.arange(3 * (r + 1), dtype=np.float32).reshape(r + 1, 3) / 7 + r,
            "f16": [np.full((2, 2), r, np.float16), np.full((r, 1), r / 3, np.float16)],
            "i32": (np.arange(r, dtype=np.int32), np.full((1, 4), r, np.int32)),
            "bool": np.array([r % 2 == 0] * (4 - r)),
            "empty": np.zeros((0, 3), np.float32)}


def test_all_gather_of_a_nested_structure_equals_each_leaf_gathered_alone(strategy):
    def step():
        ctx, value = distrib.get_replica_context(), ragged_nested(replica_id())
        return ctx.all_gather(value, axis=0), [ctx.all_gather(leaf, axis=0) for leaf in distrib_leaves(value)]

    replicas = [ragged_nested(r) for r in range(4)]
    expected = [np.concatenate(parts) for parts in zip(*map(distrib_leaves, replicas))]
    for nested, alone in local(strategy, strategy.run(step)):
        for got, by_itself, want in zip(distrib_leaves(nested), alone, expected):
            np.testing.assert_array_equal(got, want, strict=True)
            np.testing.assert_array_equal(by_itself, want, strict=True)
            assert not got.flags.writeable  # a collective's result, as immutable as a tensor
        assert nested["i32"][0].tolist() == [0, 0, 1, 0, 1, 2]


def test_all_gather_of_a_nested_structure_makes_one_backend_all_gather_per_dtype(counting):
    strategy, backend = counting
    strategy.run(lambda: distrib.get_replica_context().all_gather(ragged_nested(replica_id()), axis=0))
    assert sorted(backend.counted("all_gather")) == ["bool", "float16", "float32", "int32"]


def test_all_gather_of_a_nested_structure_along_the_last_axis(strategy):
    def step():
        r = replica_id()
        return distrib.get_replica_context().all_gather(
            [np.full((2, r + 1), r, np.int64), np.full((3, 1), r, np.float16), np.full((2, 2), r, np.int64)], axis=-1)

    for ints, halves, pairs in local(strategy, strategy.run(step)):
        np.testing.assert_array_equal(ints, [[0, 1, 1, 2, 2, 2, 3, 3, 3, 3]] * 2, strict=True)
        np.testing.assert_array_equal(halves, np.array([[0, 1, 2, 3]] * 3, np.float16), strict=True)
        np.testing.assert_array_equal(pairs, [[0, 0, 1, 1, 2, 2, 3, 3]] * 2, strict=True)


def test_all_gather_names_the_scalar_leaf_it_cannot_concatenate(strategy):
    with pytest.raises(ValueError, match=r"^all_gather needs values of rank >= 1 to concatenate along axis 0\. "
                                         r"Received: a scalar at path \['s'\]"):
        strategy.run(lambda: distrib.get_replica_context().all_gather({"s": np.float32(1), "v": np.ones(2)}, 0))


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


def test_merge_call_checks_its_args_and_kwargs(strategy):
    merge_call = lambda **kw: strategy.run(lambda: distrib.get_replica_context().merge_call(lambda s: 1, **kw))
    with pytest.raises(TypeError, match="merge_call's args must be a tuple or list. Received: int."):
        merge_call(args=5)
    with pytest.raises(TypeError, match="merge_call's kwargs must be a dict or None. Received: list."):
        merge_call(kwargs=[1])


def test_run_inside_a_merge_fn_runs_every_replica_as_in_tensorflow(strategy):
    def step():
        return distrib.get_replica_context().merge_call(
            lambda s: s.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(1))))

    assert [float(x) for x in local(strategy, strategy.run(step))] == [4.0] * 4

    def fails():
        raise KeyError("from the nested run")

    with pytest.raises(KeyError, match="from the nested run"):
        strategy.run(lambda: distrib.get_replica_context().merge_call(lambda s: s.run(fails)))
    assert [float(x) for x in local(strategy, strategy.run(step))] == [4.0] * 4  # still usable


def test_a_mismatch_among_a_later_process_replicas_names_their_global_ids():
    # in a multi-worker job the second process's replicas are 2 and 3, not 0 and 1 (its merge compares only them)
    from distrib.replica_context import check_same_layout

    def payload(value):  # (structure, leaves), as each replica hands them to the merge
        leaves, spec = flatten(value)
        return spec, leaves

    payloads = [payload(np.zeros((1, n), np.float32)) for n in (1, 2)]
    with pytest.raises(distrib.errors.CollectiveMismatchError, match=r"Received: replica 3, path <root>, shape \(1, 2\) vs "):
        check_same_layout("all_gather", payloads, gather_axis=0, first=2)
    with pytest.raises(distrib.errors.CollectiveMismatchError, match=r"Received: replica 3, path <root>, shape \(1, 2\) vs "):
        check_same_layout("all_reduce", payloads, first=2)
    structures = [payload({"a": np.zeros(1)}), payload({"b": np.zeros(1)})]
    with pytest.raises(distrib.errors.CollectiveMismatchError, match=r"exists only on replica 2\."):
        check_same_layout("all_reduce", structures, first=2)


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather"])
def test_a_distributed_value_captured_by_the_replica_function_is_named(strategy, collective):
    # before: "Expected an array of numbers. Received: PerReplica that NumPy holds as dtype=object."
    captured = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(2, np.float32))
    call = {"all_reduce": lambda value: distrib.get_replica_context().all_reduce("SUM", value),
            "all_gather": lambda value: distrib.get_replica_context().all_gather(value, 0)}[collective]
    with pytest.raises(TypeError, match=rf"^{collective} takes this replica's own values, not a distributed value "
                                        r"holding every replica's. Received: a PerReplica at path \['a'\]\[1\]. Pass "
                                        r"it to strategy.run in args"):
        strategy.run(lambda: call({"a": [np.ones(2, np.float32), captured]}))
    with pytest.raises(TypeError, match=r"Received: a PerReplica at path <root>"):
        strategy.run(lambda: call(captured))
    out = strategy.run(call, args=(captured,))  # through args: each replica's own component
    assert len(strategy.experimental_local_results(out)) == strategy.num_replicas_in_sync


def test_all_reduce_of_indexed_slices_concatenates_every_replicas_rows_as_tensorflow(strategy):
    # before: the IndexedSlices was taken for a structure of three arrays, and its indices and shape were summed
    def step(op):
        r = distrib.get_replica_context().replica_id_in_sync_group
        rows = distrib.IndexedSlices(np.full((1, 2), r + 1.0, np.float32), np.array([r % 2]), np.array([4, 2]))
        return distrib.get_replica_context().all_reduce(op, rows)

    total = strategy.experimental_local_results(strategy.run(step, args=("SUM",)))[0]
    np.testing.assert_array_equal(total.values, [[1, 1], [2, 2], [3, 3], [4, 4]])
    np.testing.assert_array_equal(total.indices, [0, 1, 0, 1])
    np.testing.assert_array_equal(total.dense_shape, [4, 2])
    mean = strategy.experimental_local_results(strategy.run(step, args=("MEAN",)))[0]
    np.testing.assert_array_equal(mean.values, [[0.25, 0.25], [0.5, 0.5], [0.75, 0.75], [1, 1]])
    assert mean.values.dtype == np.float32


def test_indexed_slices_are_refused_where_collectives_cannot_take_them(strategy):
    rows = distrib.IndexedSlices(np.ones((1, 2), np.float32), np.array([0]))
    with pytest.raises(NotImplementedError, match="all_gather of an IndexedSlices is not supported"):
        strategy.run(lambda: distrib.get_replica_context().all_gather(rows, 0))
    with pytest.raises(TypeError, match="all_reduce takes an IndexedSlices only as the whole value"):
        strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", {"g": rows}))


@pytest.mark.parametrize("replicas", [1, 4])
def test_all_gather_of_strings_is_a_clear_type_error(strategy, replicas):
    # before: "data type 'str32' not understood" from the planner
    target = strategy if replicas == 4 else distrib.MirroredStrategy(["CPU:0"])
    with pytest.raises(TypeError, match=r"all_gather needs arrays of numbers. Received: dtype <U1 at path <root>"):
        target.run(lambda: distrib.get_replica_context().all_gather(np.array(["a", "b"]), 0))


def test_an_array_every_replica_passes_to_a_collective_counts_once_per_replica(strategy):
    # as inside a tf.function, where each replica's copy is its own tensor (README: eager TensorFlow differs)
    captured = np.array([1.0, 2.0], np.float32)
    summed = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", captured))
    gathered = strategy.run(lambda: distrib.get_replica_context().all_gather(captured, axis=0))
    n = strategy.num_replicas_in_sync
    assert [x.tolist() for x in local(strategy, summed)] == [[1.0 * n, 2.0 * n]] * n
    assert local(strategy, gathered)[0].tolist() == [1.0, 2.0] * n
