"""StrategyExtended and ReplicaContext details a TensorFlow program relies on: structures to reduce_to, the
accumulation function of ReductionToOneDevice, one replica's MEAN, destinations of every kind, and TensorFlow's
smaller StrategyExtended methods."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import distrib
from distrib import Mirrored, PerReplica
from support import per_replica

pytestmark = pytest.mark.timeout(30)


def replica_numbers(strategy, dtype=np.float32):
    """Replica r holds r + 1."""
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: np.asarray(ctx.replica_id_in_sync_group + 1, dtype))


# -- reduce_to of a structure -------------------------------------------------------------------------------


@pytest.mark.parametrize("op, want", [("MEAN", 2.5), ("SUM", 10.0)])
def test_reduce_to_reduces_a_structure_leaf_by_leaf(strategy, op, want):
    # before: a dict of PerReplica came back unreduced with MEAN, and SUM called it non-distributed
    value = replica_numbers(strategy)
    out = strategy.extended.reduce_to(op, {"loss": value, "parts": [value, value]}, destinations=value)
    for leaf in (out["loss"], *out["parts"]):
        assert type(leaf) is Mirrored
        assert [float(x) for x in leaf.values] == [want] * 4


def test_a_merge_fn_reduces_its_dict_of_args_onto_one_device_and_every_replica_reads_it(strategy):
    # before: the dict came back unreduced; and a result on one device could not be handed back to four replicas
    def merge_fn(strategy, grads):
        return strategy.extended.reduce_to("MEAN", grads, destinations="CPU:0")

    def step():
        r = np.float32(distrib.get_replica_context().replica_id_in_sync_group + 1)
        out = distrib.get_replica_context().merge_call(merge_fn, args=({"w": r * np.ones(2, np.float32), "b": r},))
        return out["w"] + out["b"]

    results = strategy.experimental_local_results(strategy.run(step))
    assert [x.tolist() for x in results] == [[5.0, 5.0]] * len(results)


def test_batch_reduce_to_refuses_a_structure_in_one_pair(strategy):
    value = replica_numbers(strategy)
    for op in ("MEAN", "SUM"):
        with pytest.raises(TypeError, match=r"batch_reduce_to takes one distributed value per \(value, "
                                            r"destinations\) pair; pair 1's value is a list holding distributed"):
            strategy.extended.batch_reduce_to(op, [(value, value), ([value, value], "host")])


# -- ReductionToOneDevice ------------------------------------------------------------------------------------


def test_reduction_to_one_device_uses_its_accumulation_fn_and_device_for_every_destination():
    # before: only an all-reduce onto the replicas' devices called accumulation_fn; reduce_to another device, the
    # host, or Strategy.reduce summed with add_n
    calls = []

    def elementwise_max(arrays):
        calls.append(len(arrays))
        return np.maximum.reduce(arrays)

    ops = distrib.ReductionToOneDevice(reduce_to_device="CPU:2", accumulation_fn=elementwise_max)
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"], cross_device_ops=ops)
    value = replica_numbers(strategy)
    assert [float(x) for x in strategy.extended.reduce_to("SUM", value, destinations=value).values] == [3.0] * 3
    assert float(strategy.extended.reduce_to("SUM", value, destinations="CPU:1").values[0]) == 3.0
    assert float(strategy.extended.reduce_to("SUM", value, destinations="host").values[0]) == 3.0
    assert float(strategy.reduce("SUM", value, axis=None)) == 3.0
    assert [float(x) for x in strategy.extended.batch_reduce_to("SUM", [(value, "host"), (value, "host")])[1].values] \
        == [3.0]
    assert calls == [3] * 6


# -- one replica's MEAN --------------------------------------------------------------------------------------


def test_the_mean_of_one_replicas_integers_stays_integers_as_tensorflows_shortcut():
    # before: a one-device MirroredStrategy turned integer MEANs into floats where the default strategy did not
    strategy = distrib.MirroredStrategy(["CPU:0"])
    for ops in (distrib.NcclAllReduce(), distrib.HierarchicalCopyAllReduce(), distrib.ReductionToOneDevice()):
        strategy = distrib.MirroredStrategy(["CPU:0"], cross_device_ops=ops)
        out = strategy.run(lambda: distrib.get_replica_context().all_reduce("MEAN", np.array([3, 4], np.int32)))
        assert out.dtype == np.int32 and out.tolist() == [3, 4]
        value = strategy.experimental_distribute_values_from_function(lambda ctx: np.array([3, 4], np.int32))
        reduced = strategy.extended.reduce_to("MEAN", value, destinations=value)
        assert reduced.values[0].dtype == np.int32
    several = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    value = several.experimental_distribute_values_from_function(lambda ctx: np.array([3, 4], np.int32))
    assert several.extended.reduce_to("MEAN", value, destinations=value).values[0].dtype == np.float64


def test_the_mean_of_bfloat16_indexed_slices_stays_bfloat16(strategy):
    # before: bfloat16 (NumPy kind 'V') was divided by an int64 array into float64
    def step():
        rows = distrib.IndexedSlices(np.ones((1, 2), ml_dtypes.bfloat16), np.array([0]), np.array([4, 2]))
        return distrib.get_replica_context().all_reduce("MEAN", rows)

    mean = strategy.experimental_local_results(strategy.run(step))[0]
    assert mean.values.dtype == ml_dtypes.bfloat16
    assert mean.values.astype(np.float32).tolist() == [[0.25, 0.25]] * 4


# -- destinations, colocation, broadcast ------------------------------------------------------------------------


def test_a_plain_variable_is_a_destination_as_in_tensorflows_own_example():
    # the reference's pattern, reduce_to(VariableAggregation.SUM, t, v), under the default strategy
    strategy = distrib.get_strategy()
    v = distrib.Variable(np.zeros(2, np.float32))
    out = strategy.extended.reduce_to("SUM", np.ones(2, np.float32), destinations=v)
    np.testing.assert_array_equal(np.asarray(out.values[0]), [1, 1])
    assert strategy.extended.batch_reduce_to("SUM", [(np.ones(2, np.float32), v)])[0].values[0].tolist() == [1, 1]
    with strategy.extended.colocate_vars_with(v):
        w = distrib.Variable(np.ones(2, np.float32))
    assert w.device == v.device


def test_a_value_on_one_device_is_a_destination_meaning_that_device(strategy, blocks):
    on_one = strategy.extended.reduce_to("SUM", blocks, destinations="CPU:2")
    out = strategy.extended.reduce_to("MEAN", blocks, destinations=on_one)
    assert len(out.values) == 1
    np.testing.assert_array_equal(out.values[0], [[15, 16, 17], [18, 19, 20]])
    with pytest.raises(ValueError, match="destinations has 2 components but the strategy has 4 replicas"):
        strategy.extended.reduce_to("SUM", blocks, destinations=Mirrored([np.zeros(1), np.zeros(1)]))


def test_broadcast_to_returns_python_numbers_and_bools_unchanged(strategy):
    for value in (True, 3, 2.5):
        out = strategy.extended.broadcast_to(value, destinations="CPU:0")
        assert out is value


# -- errors a collective raises -----------------------------------------------------------------------------


def test_the_default_strategys_all_reduce_of_strings_is_a_clear_type_error():
    # before: "Too few leaves for PyTreeSpec" from optree
    ctx = distrib.get_replica_context()
    with pytest.raises(TypeError, match=r"all_reduce needs numeric values\. Received: dtype <U1 at path \['y'\]"):
        ctx.all_reduce("SUM", {"x": np.ones(2), "y": np.array(["a"])})


def test_all_gather_of_indexed_slices_inside_a_structure_is_not_implemented_as_alone(strategy):
    rows = distrib.IndexedSlices(np.ones((1, 2), np.float32), np.array([0]))
    with pytest.raises(NotImplementedError, match=r"all_gather of an IndexedSlices is not supported, as in "
                                                  r"TensorFlow\. Received: one inside"):
        strategy.run(lambda: distrib.get_replica_context().all_gather({"emb": rows}, 0))


def test_reduce_along_an_axis_takes_byte_swapped_arrays_by_their_values(strategy):
    # before: NumPy's "The dtype and signature arguments to ufuncs only select the general DType"
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: (np.arange(3) + ctx.replica_id_in_sync_group).astype(">f4"))
    assert strategy.experimental_local_results(value)[0].dtype.str == ">f4"
    assert float(strategy.reduce("SUM", value, axis=0)) == 3 * 4 + 3 * 6
    assert float(strategy.reduce("MEAN", value, axis=0)) == (3 * 4 + 3 * 6) / 12


def test_a_merge_call_whose_args_differ_says_so(strategy):
    def step():
        r = distrib.get_replica_context().replica_id_in_sync_group
        args = (np.ones(2),) if r == 0 else (np.ones(2), np.ones(2))
        return distrib.get_replica_context().merge_call(lambda strategy, *a: None, args=args)

    with pytest.raises(ValueError, match=r"Every replica must pass merge_call the same structure of args\. "
                                         r"Received: replica 1"):
        strategy.run(step)


# -- TensorFlow's smaller StrategyExtended methods -----------------------------------------------------------------


def test_variable_created_in_scope_and_value_container(strategy):
    with strategy.scope():
        v = distrib.Variable(np.zeros(2, np.float32))
    plain = distrib.Variable(np.zeros(2, np.float32))
    assert strategy.extended.variable_created_in_scope(v)
    assert not strategy.extended.variable_created_in_scope(plain)
    assert not distrib.MirroredStrategy(["CPU:0"]).extended.variable_created_in_scope(v)
    assert distrib.get_strategy().extended.variable_created_in_scope(plain)
    assert not distrib.get_strategy().extended.variable_created_in_scope(v)
    assert all(strategy.extended.value_container(component) is v for component in v.values)
    array = np.zeros(2)
    assert strategy.extended.value_container(array) is array


def test_update_non_slot_runs_once_per_device_in_an_update_context(strategy):
    devices = strategy.extended.non_slot_devices([])
    assert devices == strategy.extended.worker_devices
    seen = []

    def fn(x):
        seen.append((distrib.in_cross_replica_context(), float(x)))
        return x * 2

    out = strategy.extended.update_non_slot(devices, fn, args=(per_replica(strategy, lambda r: np.float32(r)),))
    assert type(out) is Mirrored or type(out) is PerReplica
    assert [float(x) for x in strategy.experimental_local_results(out)] == [0.0, 2.0, 4.0, 6.0]
    assert seen == [(True, 0.0), (True, 1.0), (True, 2.0), (True, 3.0)]
    ungrouped = strategy.extended.update_non_slot(devices, lambda: np.float32(1), group=False)
    assert type(ungrouped) is PerReplica
