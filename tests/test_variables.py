"""Variables on four emulated CPU replicas: creation, the write rules of every aggregation in every context, reads,
copy on write, extended.update, colocate_vars_with, regroup, and reductions of variables.

The rules are TensorFlow's (values.py, values_util.py; section 4 of semantics.md). A few cells are also checked
against TensorFlow's own output by the conformance cases; these tests walk every cell.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import distrib
from distrib import (Mirrored, MirroredVariable, PerReplica, SyncOnReadVariable, Variable, VariableAggregation,
                     VariableSynchronization)

pytestmark = pytest.mark.timeout(30)

DEVICES = ("CPU:0", "CPU:1", "CPU:2", "CPU:3")
NONE, SUM, MEAN, FIRST = (VariableAggregation.NONE, VariableAggregation.SUM, VariableAggregation.MEAN,
                          VariableAggregation.ONLY_FIRST_REPLICA)
ALL_AGGREGATIONS = [NONE, SUM, MEAN, FIRST]
ON_READ = VariableSynchronization.ON_READ
WRITES = ["assign", "assign_add", "assign_sub"]


@pytest.fixture(scope="module")
def strategy():
    return distrib.MirroredStrategy(list(DEVICES))


@pytest.fixture(scope="module")
def two_replicas():
    return distrib.MirroredStrategy(["CPU:0", "CPU:1"])


def replica_id() -> int:
    return distrib.get_replica_context().replica_id_in_sync_group


def mirrored(strategy, value=10.0, aggregation=NONE, dtype=np.float32):
    with strategy.scope():
        return distrib.Variable(np.asarray(value, dtype), aggregation=aggregation)


def sync_on_read(strategy, value=0.0, aggregation=SUM, dtype=np.float32):
    with strategy.scope():
        return distrib.Variable(np.asarray(value, dtype), synchronization=ON_READ, aggregation=aggregation)


def copies(variable) -> list:
    """Every component's current value, in replica order (read directly, without aggregation)."""
    return [component.numpy().tolist() for component in variable.values]


def replica_reads(strategy, variable) -> list:
    """What each replica reads inside strategy.run."""
    return [np.asarray(x).tolist() for x in strategy.experimental_local_results(strategy.run(variable.read_value))]


def set_copies(strategy, variable, values) -> None:
    """Gives replica i's copy values[i] (a replica-context assign: local only for NONE and for SyncOnRead)."""
    strategy.run(lambda: variable.assign(np.float32(values[replica_id()])))


def address(array) -> int:
    return array.__array_interface__["data"][0]


# -- creation ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("synchronization", ["AUTO", "ON_WRITE"])
def test_variable_under_scope_is_a_mirrored_variable(strategy, synchronization):
    with strategy.scope():
        v = distrib.Variable(np.float32(1), synchronization=synchronization)
    assert type(v) is MirroredVariable
    assert isinstance(v, distrib.DistributedVariable)
    assert v.synchronization is VariableSynchronization.ON_WRITE
    assert v.aggregation is NONE


def test_on_read_variable_under_scope_is_a_sync_on_read_variable(strategy):
    with strategy.scope():
        v = distrib.Variable(np.float32(1), synchronization=ON_READ, aggregation=SUM)
    assert type(v) is SyncOnReadVariable
    assert v.synchronization is ON_READ
    assert v.aggregation is SUM


def test_variable_outside_any_scope_is_a_plain_variable():
    v = distrib.Variable(np.float32(1), aggregation=SUM)
    assert type(v) is Variable
    assert v.device == "CPU:0"
    assert v.assign_add(np.float32(2)).numpy() == 3.0


def test_synchronization_none_is_rejected_under_scope(strategy):
    with strategy.scope(), pytest.raises(ValueError, match="synchronization=NONE"):
        distrib.Variable(np.float32(1), synchronization=VariableSynchronization.NONE)


@pytest.mark.parametrize("synchronization", ["ON_WRITE", "ON_READ"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_])
def test_mean_aggregation_needs_a_float_dtype(strategy, synchronization, dtype):
    with strategy.scope(), pytest.raises(ValueError, match="MEAN needs a floating-point"):
        distrib.Variable(np.zeros(2, dtype), synchronization=synchronization, aggregation=MEAN)


def test_integer_variables_accept_sum_and_only_first_replica(strategy):
    assert mirrored(strategy, 1, SUM, np.int32).dtype == np.int32
    assert mirrored(strategy, 1, FIRST, np.int64).dtype == np.int64


def test_enum_arguments_accept_strings_in_any_case(strategy):
    with strategy.scope():
        v = distrib.Variable(np.float32(0), synchronization="on_read", aggregation="Mean")
    assert type(v) is SyncOnReadVariable
    assert v.aggregation is MEAN


@pytest.mark.parametrize("argument", ["synchronization", "aggregation"])
def test_unknown_enum_strings_are_rejected(strategy, argument):
    with strategy.scope(), pytest.raises(ValueError, match=f"{argument} must be one of"):
        distrib.Variable(np.float32(0), **{argument: "sometimes"})


def test_callable_initial_value_is_called_once_and_every_replica_starts_equal(strategy):
    rng = np.random.default_rng(0)
    calls = []

    def init():
        calls.append(1)
        return rng.standard_normal(3).astype(np.float32)

    with strategy.scope():
        v = distrib.Variable(init)
    assert len(calls) == 1
    first = v.values[0].numpy()
    for component in v.values:
        np.testing.assert_array_equal(component.numpy(), first)


def test_replicas_start_as_independent_copies(strategy):
    v = mirrored(strategy, [1.0, 2.0])
    assert len({address(c.read_value()) for c in v.values}) == 4  # four buffers, not one shared


def test_components_are_named_after_the_variable_and_placed_on_the_strategys_devices(strategy):
    with strategy.scope():
        v = distrib.Variable(np.float32(0), name="bias")
    assert v.name == "bias"
    assert [c.name for c in v.values] == ["bias/replica_0", "bias/replica_1", "bias/replica_2", "bias/replica_3"]
    assert v.devices == DEVICES == strategy.extended.worker_devices
    assert tuple(c.device for c in v.values) == DEVICES
    assert all(type(c) is Variable for c in v.values)


def test_default_name_is_variable(strategy):
    v = mirrored(strategy)
    assert v.name == "Variable"
    assert v.values[2].name == "Variable/replica_2"


def test_a_variable_created_inside_strategy_run_is_one_mirrored_variable(strategy):
    variable = strategy.run(lambda: distrib.Variable(np.float32(3), aggregation="MEAN"))
    assert isinstance(variable, distrib.MirroredVariable) and variable.aggregation is distrib.VariableAggregation.MEAN
    assert copies(variable) == [3.0] * 4


def test_trainable_shape_dtype_and_name(strategy):
    with strategy.scope():
        w = distrib.Variable(np.zeros((2, 3)), name="w", dtype=np.float32)
        step = distrib.Variable(np.int64(0), name="step", trainable=False)
    assert (w.trainable, w.shape, w.dtype, w.name) == (True, (2, 3), np.float32, "w")
    assert (step.trainable, step.shape, step.dtype) == (False, (), np.int64)
    assert [c.trainable for c in step.values] == [False] * 4
    assert all(c.dtype == np.float32 and c.shape == (2, 3) for c in w.values)


def test_numpy_and_array_conversion_give_host_copies(strategy):
    v = mirrored(strategy, [1.0, 2.0])
    host = v.numpy()
    assert isinstance(host, np.ndarray) and host.dtype == np.float32
    host[0] = 99.0  # a private copy: the variable is unchanged
    assert copies(v) == [[1.0, 2.0]] * 4
    assert np.asarray(v, dtype=np.float64).dtype == np.float64
    assert np.asarray(v).tolist() == [1.0, 2.0]


def test_arithmetic_operators_use_the_current_value(strategy):
    v = mirrored(strategy, [2.0, 4.0])
    assert (v + 1).tolist() == [3.0, 5.0]
    assert (1 + v).tolist() == [3.0, 5.0]
    assert (v - 1).tolist() == [1.0, 3.0]
    assert (10 - v).tolist() == [8.0, 6.0]
    assert (v * 2).tolist() == [4.0, 8.0]
    assert (2 * v).tolist() == [4.0, 8.0]
    assert (v / 2).tolist() == [1.0, 2.0]
    assert (8 / v).tolist() == [4.0, 2.0]
    assert (-v).tolist() == [-2.0, -4.0]
    assert float(v @ np.array([1.0, 1.0], np.float32)) == 6.0
    assert float(np.array([1.0, 0.0], np.float32) @ v) == 2.0
    assert float(v[1]) == 4.0
    out = strategy.run(lambda: v * (replica_id() + 1))  # in a replica: the local copy
    assert [x.tolist() for x in strategy.experimental_local_results(out)] == [
        [2.0, 4.0], [4.0, 8.0], [6.0, 12.0], [8.0, 16.0]]


def test_repr_names_the_class_shape_dtype_and_devices(strategy):
    with strategy.scope():
        v = distrib.Variable(np.zeros(3, np.float32), name="w")
        s = distrib.Variable(np.int32(0), name="n", synchronization=ON_READ, aggregation=SUM)
    assert repr(v) == ("<MirroredVariable 'w' shape=(3,) dtype=float32 "
                       "devices=('CPU:0', 'CPU:1', 'CPU:2', 'CPU:3')>")
    assert repr(s).startswith("<SyncOnReadVariable 'n' shape=() dtype=int32 devices=")
    assert repr(v.values[1]) == "<Variable 'w/replica_1' shape=(3,) dtype=float32 device=CPU:1>"


def test_plain_variable_writes_check_shape_and_dtype():
    v = distrib.Variable(np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match=r"shape \(2, 2\)"):  # before: broadcast along the leading axis
        v.assign(np.ones(2, np.float32))
    v.assign(np.float32(1))  # a scalar fills it
    assert v.numpy().tolist() == [[1.0, 1.0], [1.0, 1.0]]
    with pytest.raises(ValueError, match=r"shape \(2, 2\)"):
        v.assign(np.ones(3, np.float32))
    counter = distrib.Variable(np.int32(0))
    with pytest.raises(TypeError, match="cannot write dtype float64"):
        counter.assign_add(0.5)


def test_integers_that_do_not_fit_the_variables_dtype_are_refused_not_wrapped(strategy):
    # before: 300 became 44 in an int8 variable and 2**40 became 0 in an int32 one, with no word
    with pytest.raises(TypeError, match=r"Variable\(dtype=int8\) cannot write integers outside int8's range "
                                        r"\[-128, 127\]. Received: values from -1 to 300"):
        distrib.Variable([300, -1], dtype=np.int8)
    with strategy.scope():
        v = distrib.Variable(np.zeros(2, np.int32), name="count")
        with pytest.raises(TypeError, match=r"assign cannot write integers outside int32's range"):
            v.assign([1, 2**40])
        v.assign(np.array([1, -5], np.int64))  # int64 values that fit are written
        with pytest.raises(TypeError, match=r"assign_add cannot write integers outside int32's range"):
            v.assign_add(np.array([2**31, 0]))
    assert [x.numpy().tolist() for x in v.values] == [[1, -5]] * len(v.values)
    small = distrib.Variable(np.zeros(2, np.int8))
    with pytest.raises(TypeError, match=r"values from -129 to 0 \(int64\)"):
        small.assign(np.array([-129, 0]))
    assert small.numpy().tolist() == [0, 0]


def test_variable_arguments_are_checked_under_a_scope(strategy):
    with strategy.scope():
        with pytest.raises(TypeError, match=r"distrib.Variable\(\): got an unexpected keyword argument 'foo'"):
            distrib.Variable(1.0, foo=1)  # before: named StrategyExtended._create_variable()
        with pytest.raises(TypeError, match=r"takes no device: the strategy places its variables"):
            distrib.Variable(1.0, device="CPU:1")


# -- MirroredVariable ------------------------------------------------------------------------------------------
# Starting from 10 on every copy, replica r writes r + 1 (1, 2, 3, 4 on the four replicas).

MIRRORED_REPLICA_WRITES = [
    # NONE: no aggregation, so each replica changes only its own copy
    (NONE, "assign", [1.0, 2.0, 3.0, 4.0]),
    (NONE, "assign_add", [11.0, 12.0, 13.0, 14.0]),
    (NONE, "assign_sub", [9.0, 8.0, 7.0, 6.0]),
    # SUM: 1 + 2 + 3 + 4 = 10 applied to every copy
    (SUM, "assign", [10.0] * 4),
    (SUM, "assign_add", [20.0] * 4),
    (SUM, "assign_sub", [0.0] * 4),
    # MEAN: (1 + 2 + 3 + 4) / 4 = 2.5 applied to every copy
    (MEAN, "assign", [2.5] * 4),
    (MEAN, "assign_add", [12.5] * 4),
    (MEAN, "assign_sub", [7.5] * 4),
    # ONLY_FIRST_REPLICA: replica 0's value (1) applied to every copy
    (FIRST, "assign", [1.0] * 4),
    (FIRST, "assign_add", [11.0] * 4),
    (FIRST, "assign_sub", [9.0] * 4),
]


@pytest.mark.parametrize("aggregation, method, expected", MIRRORED_REPLICA_WRITES,
                         ids=[f"{a.name}-{m}" for a, m, _ in MIRRORED_REPLICA_WRITES])
def test_mirrored_variable_write_in_replica_context(strategy, aggregation, method, expected):
    v = mirrored(strategy, 10.0, aggregation)
    strategy.run(lambda: getattr(v, method)(np.float32(replica_id() + 1)))
    assert copies(v) == expected
    assert replica_reads(strategy, v) == expected


@pytest.mark.parametrize("method, expected", [("assign", 3.0), ("assign_add", 13.0), ("assign_sub", 7.0)])
@pytest.mark.parametrize("aggregation", ALL_AGGREGATIONS, ids=lambda a: a.name)
def test_mirrored_variable_write_in_cross_replica_context_sets_every_copy(strategy, aggregation, method, expected):
    v = mirrored(strategy, 10.0, aggregation)
    with strategy.scope():
        assert getattr(v, method)(np.float32(3)) is v
    assert copies(v) == [expected] * 4


def test_mirrored_variable_write_outside_any_scope_is_cross_replica(strategy):
    v = mirrored(strategy, 10.0, SUM)
    v.assign_add(1.0)
    assert copies(v) == [11.0] * 4


def test_mean_assign_add_of_1_2_3_4_adds_2_5_to_every_copy(strategy):
    v = mirrored(strategy, [0.0, 100.0], MEAN)
    strategy.run(lambda: v.assign_add(np.full(2, replica_id() + 1, np.float32)))
    assert copies(v) == [[2.5, 102.5]] * 4


def test_replica_context_write_returns_the_value_it_left_which_later_writes_never_change(strategy):
    # as TensorFlow's: before, the variable itself came back, so a kept history of step results read the last value
    for aggregation in (SUM, MEAN, FIRST):
        v = mirrored(strategy, 0.0, aggregation)
        history = [strategy.run(lambda: v.assign_add(np.full((), replica_id() + 1, np.float32)))
                   for _ in range(3)]
        delta = {SUM: 10.0, MEAN: 2.5, FIRST: 1.0}[aggregation]  # 4 replicas adding 1, 2, 3, 4
        for k, result in enumerate(history, start=1):
            assert isinstance(result, PerReplica)
            assert [float(x) for x in strategy.experimental_local_results(result)] == [k * delta] * 4
        v.assign(np.float32(100))
        assert [float(x) for x in strategy.experimental_local_results(history[0])] == [delta] * 4


def test_sum_of_the_same_object_on_every_replica_raises(strategy):
    v = mirrored(strategy, 10.0, SUM)
    step = np.float32(1)  # one object, seen by all four replicas: it would be counted four times
    with pytest.raises(ValueError, match="counted 4 times"):
        strategy.run(lambda: v.assign_add(step))
    assert copies(v) == [10.0] * 4


def test_sum_of_zero_on_every_replica_is_allowed(strategy):
    v = mirrored(strategy, 10.0, SUM)
    strategy.run(lambda: v.assign(0.0))  # reduce_to passes a Python 0 through, as in TensorFlow
    assert copies(v) == [0.0] * 4


def test_same_object_sum_on_one_replica_is_applied_as_is():
    one = distrib.MirroredStrategy(["CPU:0"])
    with one.scope():
        v = distrib.Variable(np.float32(10), aggregation=SUM)
    one.run(lambda: v.assign_add(np.float32(2)))
    assert copies(v) == [12.0]


@pytest.mark.parametrize("aggregation", [MEAN, FIRST], ids=lambda a: a.name)
def test_same_object_with_mean_or_only_first_replica_is_applied_once(strategy, aggregation):
    v = mirrored(strategy, 10.0, aggregation)
    step = np.float32(1)
    strategy.run(lambda: v.assign_add(step))
    assert copies(v) == [11.0] * 4


def test_only_first_replica_ignores_the_other_replicas_values(strategy):
    v = mirrored(strategy, [0.0, 0.0], FIRST)
    strategy.run(lambda: v.assign(np.array([replica_id(), -replica_id()], np.float32) + 5))
    assert copies(v) == [[5.0, 5.0]] * 4


def test_none_aggregation_lets_copies_diverge_and_cross_replica_reads_see_replica_0(strategy):
    v = mirrored(strategy, 0.0, NONE)
    set_copies(strategy, v, [1.0, 2.0, 3.0, 4.0])
    assert replica_reads(strategy, v) == [1.0, 2.0, 3.0, 4.0]
    assert float(v.read_value()) == 1.0
    assert float(v.numpy()) == 1.0


def test_cross_replica_assign_of_a_per_replica_value_raises(strategy):
    v = mirrored(strategy, 10.0, SUM)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group))
    with strategy.scope(), pytest.raises(ValueError, match="PerReplica"):
        v.assign(values)
    assert copies(v) == [10.0] * 4


@pytest.mark.parametrize("method, expected", [("assign", [1.0, 2.0, 3.0, 4.0]),
                                              ("assign_add", [11.0, 12.0, 13.0, 14.0]),
                                              ("assign_sub", [9.0, 8.0, 7.0, 6.0])])
def test_cross_replica_write_of_a_mirrored_value_uses_each_component(strategy, method, expected):
    v = mirrored(strategy, 10.0, MEAN)
    getattr(v, method)(Mirrored([np.float32(i + 1) for i in range(4)]))
    assert copies(v) == expected


def test_cross_replica_assign_from_another_variable_reads_its_value(strategy):
    source = mirrored(strategy, [1.0, 2.0])
    v = mirrored(strategy, [0.0, 0.0], SUM)
    v.assign(source)
    assert copies(v) == [[1.0, 2.0]] * 4


def integer_mean_variable(strategy):
    """An int32 MirroredVariable with aggregation MEAN, built directly (creating one through scope() raises)."""
    components = [distrib.Variable(np.int32(10), name=f"count/replica_{i}", device=d) for i, d in enumerate(DEVICES)]
    return MirroredVariable(strategy, components, MEAN, "count", trainable=False)


def test_non_float_mean_with_per_replica_values_raises(strategy):
    v = integer_mean_variable(strategy)
    with pytest.raises(ValueError, match="non-float"):
        strategy.run(lambda: v.assign_add(np.int32(replica_id())))
    assert copies(v) == [10] * 4


def test_non_float_mean_with_the_same_object_everywhere_is_applied_as_is(strategy):
    v = integer_mean_variable(strategy)
    step = np.int32(3)
    strategy.run(lambda: v.assign_add(step))
    assert copies(v) == [13] * 4


# -- SyncOnReadVariable ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("method, expected", [("assign", [1.0, 2.0, 3.0, 4.0]),
                                              ("assign_add", [11.0, 12.0, 13.0, 14.0]),
                                              ("assign_sub", [9.0, 8.0, 7.0, 6.0])])
@pytest.mark.parametrize("aggregation", ALL_AGGREGATIONS, ids=lambda a: a.name)
def test_sync_on_read_write_in_replica_context_changes_only_the_local_copy(strategy, aggregation, method,
                                                                            expected):
    v = sync_on_read(strategy, 10.0, aggregation)
    strategy.run(lambda: getattr(v, method)(np.float32(replica_id() + 1)))
    assert copies(v) == expected


@pytest.mark.parametrize("aggregation", ALL_AGGREGATIONS, ids=lambda a: a.name)
def test_sync_on_read_cross_replica_assign_of_a_per_replica_gives_each_copy_its_value(strategy, aggregation):
    # before, with SUM: "Expected an array of numbers. Received: PerReplica that NumPy holds as dtype=object."
    v = sync_on_read(strategy, 0.0, aggregation)
    v.assign(strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group)))
    assert copies(v) == [0.0, 1.0, 2.0, 3.0]
    if aggregation is SUM:
        assert float(v.read_value()) == 6.0


@pytest.mark.parametrize("aggregation, expected", [(SUM, [1.5] * 4), (MEAN, [6.0] * 4), (FIRST, [6.0] * 4),
                                                   (NONE, [6.0] * 4)], ids=["SUM", "MEAN", "FIRST", "NONE"])
def test_sync_on_read_cross_replica_assign(strategy, aggregation, expected):
    v = sync_on_read(strategy, 0.0, aggregation)
    v.assign(np.float32(6))  # SUM stores 6 / 4 per copy so that the sum reads back as 6
    assert copies(v) == expected
    if aggregation is not NONE:
        assert float(v.read_value()) == 6.0


@pytest.mark.parametrize("target, expected", [(SUM, [2.5] * 4), (MEAN, [10.0] * 4), (FIRST, [10.0] * 4)],
                         ids=["SUM", "MEAN", "FIRST"])
def test_sync_on_read_cross_replica_assign_from_a_sync_on_read_variable_takes_its_aggregate(strategy, target,
                                                                                           expected):
    # before, MEAN and FIRST targets took the source's copies one for one (1, 2, 3, 4): they read 2.5 and 1.0
    # where TensorFlow's read 10, the source's value
    source = sync_on_read(strategy, 0.0, SUM)
    strategy.run(lambda: source.assign(np.float32(distrib.get_replica_context().replica_id_in_sync_group + 1)))
    v = sync_on_read(strategy, 0.0, target)
    v.assign(source)
    assert copies(v) == expected and float(v.read_value()) == 10.0


def test_sync_on_read_cross_replica_assign_of_an_integer_sum_truncates(two_replicas):
    v = sync_on_read(two_replicas, 0, SUM, np.int32)
    v.assign(7)  # 7 / 2 = 3.5 -> 3 on each copy
    assert copies(v) == [3, 3]
    assert v.read_value().tolist() == 6 and v.read_value().dtype == np.int32
    v.assign(-7)  # truncation is toward zero
    assert copies(v) == [-3, -3]


@pytest.mark.parametrize("method", ["assign_add", "assign_sub"])
def test_sync_on_read_cross_replica_add_or_sub_with_sum_raises(strategy, method):
    v = sync_on_read(strategy, 1.0, SUM)
    with pytest.raises(ValueError, match=f"does not support {method}"):
        getattr(v, method)(np.float32(1))
    assert copies(v) == [1.0] * 4


@pytest.mark.parametrize("method, expected", [("assign_add", [3.0, 4.0, 5.0, 6.0]),
                                              ("assign_sub", [-1.0, 0.0, 1.0, 2.0])])
@pytest.mark.parametrize("aggregation", [MEAN, FIRST, NONE], ids=lambda a: a.name)
def test_sync_on_read_cross_replica_add_or_sub_changes_every_copy(strategy, aggregation, method, expected):
    v = sync_on_read(strategy, 0.0, aggregation)
    set_copies(strategy, v, [1.0, 2.0, 3.0, 4.0])
    getattr(v, method)(np.float32(2))
    assert copies(v) == expected


@pytest.mark.parametrize("aggregation, expected", [(SUM, 10.0), (MEAN, 2.5), (FIRST, 1.0)],
                         ids=["SUM", "MEAN", "FIRST"])
def test_sync_on_read_cross_replica_read_aggregates(strategy, aggregation, expected):
    v = sync_on_read(strategy, 0.0, aggregation)
    set_copies(strategy, v, [1.0, 2.0, 3.0, 4.0])
    for read in (v.read_value(), v.value(), v.numpy(), np.asarray(v)):
        assert float(read) == expected
        assert read.dtype == np.float32
    assert copies(v) == [1.0, 2.0, 3.0, 4.0]  # reading does not write


def test_sync_on_read_cross_replica_read_with_no_aggregation_raises(strategy):
    v = sync_on_read(strategy, 0.0, NONE)
    with pytest.raises(ValueError, match="aggregation NONE has no cross-replica value"):
        v.read_value()
    with pytest.raises(ValueError):
        v.numpy()


@pytest.mark.parametrize("aggregation", ALL_AGGREGATIONS, ids=lambda a: a.name)
def test_sync_on_read_replica_reads_are_local(strategy, aggregation):
    v = sync_on_read(strategy, 0.0, aggregation)
    set_copies(strategy, v, [1.0, 2.0, 3.0, 4.0])
    assert replica_reads(strategy, v) == [1.0, 2.0, 3.0, 4.0]


def test_sync_on_read_metric_pattern(strategy):
    """Each replica counts its own examples; the cross-replica read is the total."""
    with strategy.scope():
        seen = distrib.Variable(np.int64(0), synchronization="ON_READ", aggregation="SUM", trainable=False)
    for _ in range(3):
        strategy.run(lambda: seen.assign_add(np.int64(replica_id() + 1)))
    assert copies(seen) == [3, 6, 9, 12]
    assert int(seen.read_value()) == 30


# -- reads are copy-on-write safe --------------------------------------------------------------------------------


@pytest.mark.parametrize("method", WRITES)
def test_a_cross_replica_read_never_changes_after_later_writes(strategy, method):
    v = mirrored(strategy, [1.0, 2.0], MEAN)
    before = v.read_value()
    getattr(v, method)(np.array([5.0, 5.0], np.float32))
    strategy.run(lambda: getattr(v, method)(np.float32(replica_id())))
    assert before.tolist() == [1.0, 2.0]
    assert copies(v)[0] != [1.0, 2.0]


def test_values_returned_by_run_never_change_after_later_writes(strategy):
    v = mirrored(strategy, 1.0, SUM)
    reads = strategy.run(v.read_value)
    v.assign(np.float32(7))
    strategy.run(lambda: v.assign_add(np.float32(1)))
    assert [float(x) for x in strategy.experimental_local_results(reads)] == [1.0] * 4
    assert copies(v) == [11.0] * 4


def test_a_read_inside_a_replica_survives_that_replicas_own_writes(strategy):
    v = mirrored(strategy, 1.0, NONE)

    def step():
        before = v.read_value()
        v.assign_add(np.float32(10))
        return before, v.read_value()

    before, after = strategy.run(step)
    assert [float(x) for x in strategy.experimental_local_results(before)] == [1.0] * 4
    assert [float(x) for x in strategy.experimental_local_results(after)] == [11.0] * 4


def test_a_slice_of_a_read_is_protected_too(strategy):
    v = mirrored(strategy, [1.0, 2.0, 3.0])
    tail = v.read_value()[1:]  # the read itself is gone; its slice still points into the buffer
    v.assign(np.zeros(3, np.float32))
    assert tail.tolist() == [2.0, 3.0]


def test_sync_on_read_reads_never_change_after_later_writes(strategy):
    v = sync_on_read(strategy, 0.0, SUM)
    set_copies(strategy, v, [1.0, 2.0, 3.0, 4.0])
    total = v.read_value()
    local = strategy.run(v.read_value)
    strategy.run(lambda: v.assign_add(np.float32(100)))
    assert float(total) == 10.0
    assert [float(x) for x in strategy.experimental_local_results(local)] == [1.0, 2.0, 3.0, 4.0]


def read_only_reads(strategy):
    plain = distrib.Variable(np.zeros(2, np.float32))
    m = mirrored(strategy, [0.0, 0.0], SUM)
    s = sync_on_read(strategy, [0.0, 0.0], SUM)
    first = sync_on_read(strategy, [0.0, 0.0], FIRST)
    return {
        "plain": plain.read_value(),
        "mirrored cross-replica": m.read_value(),
        "mirrored in a replica": strategy.experimental_local_results(strategy.run(m.read_value))[2],
        "sync-on-read SUM cross-replica": s.read_value(),
        "sync-on-read ONLY_FIRST_REPLICA cross-replica": first.read_value(),
        "sync-on-read in a replica": strategy.experimental_local_results(strategy.run(s.read_value))[1],
        "component": m.values[3].read_value(),
    }


@pytest.mark.parametrize("kind", ["plain", "mirrored cross-replica", "mirrored in a replica",
                                  "sync-on-read SUM cross-replica", "sync-on-read ONLY_FIRST_REPLICA cross-replica",
                                  "sync-on-read in a replica", "component"])
def test_reads_are_read_only(strategy, kind):
    read = read_only_reads(strategy)[kind]
    with pytest.raises(ValueError, match="read-only"):
        read[0] = 1.0
    with pytest.raises(ValueError, match="read-only"):
        read += 1


def test_writes_are_in_place_when_no_read_is_alive():
    v = distrib.Variable(np.zeros(4, np.float32))
    start = address(v.read_value())  # this read dies at once
    v.assign_add(np.ones(4, np.float32))
    v.assign(np.full(4, 3.0, np.float32))
    v.assign_sub(np.ones(4, np.float32))
    after = v.read_value()
    assert address(after) == start
    assert after.tolist() == [2.0] * 4


def test_a_live_read_moves_the_next_write_to_a_fresh_buffer():
    v = distrib.Variable(np.zeros(4, np.float32))
    held = v.read_value()
    v.assign_add(np.ones(4, np.float32))
    moved = address(v.read_value())
    assert moved != address(held)
    assert held.tolist() == [0.0] * 4
    del held  # no read alive any more: the next write stays in the new buffer
    v.assign_add(np.ones(4, np.float32))
    assert address(v.read_value()) == moved


def test_distributed_writes_are_in_place_per_component(strategy):
    v = mirrored(strategy, np.zeros(4), SUM)
    start = [address(c.read_value()) for c in v.values]
    v.assign_add(np.ones(4, np.float32))
    strategy.run(lambda: v.assign_add(np.ones(4, np.float32) * replica_id()))
    assert [address(c.read_value()) for c in v.values] == start
    held = v.values[1].read_value()  # only replica 1's copy has a live read
    v.assign(np.zeros(4, np.float32))
    now = [address(c.read_value()) for c in v.values]
    assert now[0] == start[0] and now[2:] == start[2:] and now[1] != start[1]
    assert held.tolist() == [7.0] * 4


# -- extended.update -----------------------------------------------------------------------------------------


def test_update_runs_fn_once_per_component_on_its_device(strategy):
    v = mirrored(strategy, 1.0)
    calls = []

    def fn(component):
        calls.append((component.name, component.device, distrib.get_strategy() is strategy,
                      distrib.in_cross_replica_context()))
        return component.assign_add(np.float32(1))

    strategy.extended.update(v, fn)  # outside any scope: update enters the strategy's scope for fn
    assert calls == [(f"Variable/replica_{i}", d, True, True) for i, d in enumerate(DEVICES)]
    assert copies(v) == [2.0] * 4


def test_update_unwraps_mirrored_per_replica_and_plain_arguments_per_component(strategy):
    v = mirrored(strategy, 0.0)
    mirrored_arg = Mirrored([np.float32(10 * (i + 1)) for i in range(4)])
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(100 * (ctx.replica_id_in_sync_group + 1)))
    plain = np.float32(1000)
    seen = []

    def fn(component, a, b, c, *, d):
        seen.append((float(a), float(b), float(c), float(d)))
        return component.assign(a + b + c + d)

    strategy.extended.update(v, fn, args=(mirrored_arg, per_replica, plain), kwargs={"d": per_replica})
    assert seen == [(10 * k, 100 * k, 1000.0, 100 * k) for k in (1.0, 2.0, 3.0, 4.0)]
    assert copies(v) == [1210.0, 1420.0, 1630.0, 1840.0]


def test_update_passes_other_distributed_variables_whole_and_they_read_their_ith_component(strategy):
    v = mirrored(strategy, 1.0)
    scale = sync_on_read(strategy, 0.0, SUM)
    set_copies(strategy, scale, [1.0, 2.0, 3.0, 4.0])

    def fn(component, other):
        assert other is scale  # not unwrapped: reading it inside fn gives this component's copy
        return component.assign(component.read_value() * other.read_value())

    strategy.extended.update(v, fn, args=(scale,))
    assert copies(v) == [1.0, 2.0, 3.0, 4.0]


def test_update_with_group_returns_the_variable_when_fn_returns_its_components(strategy):
    v = mirrored(strategy, 1.0)
    assert strategy.extended.update(v, lambda c: c.assign_add(np.float32(1))) is v
    assert strategy.extended.update(v, lambda c: c.assign_add(np.float32(1)), group=True) is v


def test_update_with_group_returns_a_mirrored_of_array_results(strategy):
    v = mirrored(strategy, 2.0)
    out = strategy.extended.update(v, lambda c: c.read_value() * 3, group=True)
    assert type(out) is Mirrored
    assert [float(x) for x in out.values] == [6.0] * 4


def test_update_without_group_returns_per_replica_results(strategy):
    v = mirrored(strategy, 0.0)
    out = strategy.extended.update(v, lambda c: np.float32(v.values.index(c)), group=False)
    assert type(out) is PerReplica
    assert [float(x) for x in out.values] == [0.0, 1.0, 2.0, 3.0]
    results = strategy.extended.update(v, lambda c: c.assign_add(np.float32(1)), group=False)
    assert strategy.experimental_local_results(results) == v.values


def test_update_from_replica_context_goes_through_merge_call(strategy):
    v = mirrored(strategy, 0.0)
    calls = []

    def fn(component, x):
        calls.append((component.name, float(x), threading.current_thread() is threading.main_thread(),
                      distrib.in_cross_replica_context()))
        return component.assign_add(x)

    out = strategy.run(lambda: strategy.extended.update(v, fn, args=(np.float32(replica_id() + 1),)))
    assert out is v
    # four calls in all (not four per replica), on the calling thread, cross-replica; x regrouped per component
    assert calls == [(f"Variable/replica_{i}", i + 1.0, True, True) for i in range(4)]
    assert copies(v) == [1.0, 2.0, 3.0, 4.0]


def test_update_from_replica_context_gives_each_replica_its_result(strategy):
    v = mirrored(strategy, 5.0)
    out = strategy.run(lambda: strategy.extended.update(v, lambda c: c.read_value() + 1))
    assert [float(x) for x in strategy.experimental_local_results(out)] == [6.0] * 4


def test_update_of_a_plain_variable_runs_fn_once(strategy):
    v = distrib.Variable(np.float32(1))
    assert strategy.extended.update(v, lambda c, x: c.assign_add(x), args=(np.float32(2),)) is v
    assert float(v.numpy()) == 3.0


def test_update_needs_a_callable_fn(strategy):
    with pytest.raises(TypeError, match="callable"):
        strategy.extended.update(mirrored(strategy), "assign_add")


def test_update_needs_a_variable(strategy):
    with pytest.raises(TypeError, match="needs a variable"):
        strategy.extended.update(np.zeros(2, np.float32), lambda c: c)


def test_update_rejects_a_variable_of_another_strategy(strategy, two_replicas):
    other = mirrored(two_replicas, 1.0)
    with pytest.raises(ValueError, match="another strategy"):
        strategy.extended.update(other, lambda c: c.assign_add(np.float32(1)))
    assert copies(other) == [1.0, 1.0]


# -- colocate_vars_with ---------------------------------------------------------------------------------------


def test_variables_created_under_colocate_vars_with_share_its_devices(strategy):
    with strategy.scope():
        anchor = distrib.Variable(np.zeros(3, np.float32), name="anchor")
        with strategy.extended.colocate_vars_with(anchor):
            slot = distrib.Variable(np.float32(0), name="slot")
            metric = distrib.Variable(np.float32(0), synchronization=ON_READ, aggregation=SUM)
        after = distrib.Variable(np.float32(0))
    assert slot.devices == metric.devices == anchor.devices
    assert [c.device for c in slot.values] == [c.device for c in anchor.values]
    assert type(metric) is SyncOnReadVariable
    assert after.devices == DEVICES
    strategy.extended.update(anchor, lambda a, s: a.assign_add(s.read_value() + 1), args=(slot,))
    assert copies(anchor) == [[1.0, 1.0, 1.0]] * 4


def test_colocate_vars_with_outside_the_scope_raises_runtime_error(strategy):
    v = mirrored(strategy)
    with pytest.raises(RuntimeError, match="inside the strategy's scope"):
        with strategy.extended.colocate_vars_with(v):
            pass


@pytest.mark.parametrize("target", ["array", "plain variable", "other strategy's variable"])
def test_colocate_vars_with_needs_a_variable_of_this_strategy(strategy, two_replicas, target):
    value = {"array": lambda: np.zeros(2),
             "plain variable": lambda: distrib.Variable(np.zeros(2)),
             "other strategy's variable": lambda: mirrored(two_replicas)}[target]()
    with strategy.scope(), pytest.raises(ValueError, match="created in this strategy's scope"):
        with strategy.extended.colocate_vars_with(value):
            pass


# -- regroup: variables and their components -------------------------------------------------------------------


def test_run_returning_the_variable_returns_it_itself(strategy):
    v = mirrored(strategy)
    assert strategy.run(lambda: v) is v
    assert strategy.run(lambda: {"v": v, "r": replica_id()})["v"] is v


def test_run_returning_each_replicas_component_returns_the_container(strategy):
    v = sync_on_read(strategy)
    assert strategy.run(lambda: v.values[replica_id()]) is v


def test_a_variable_passed_to_run_reaches_every_replica_whole(strategy):
    v = mirrored(strategy)
    out = strategy.run(lambda x: x is v, args=(v,))
    assert out is True


def test_experimental_local_results_of_a_variable_are_its_components(strategy):
    v = mirrored(strategy, [1.0, 2.0])
    local = strategy.experimental_local_results(v)
    assert local == v.values
    assert [c.name for c in local] == [f"Variable/replica_{i}" for i in range(4)]
    assert all(isinstance(c, Variable) and c.numpy().tolist() == [1.0, 2.0] for c in local)


# -- reductions of variables -----------------------------------------------------------------------------------


def test_strategy_reduce_of_a_sync_on_read_variable(strategy):
    v = sync_on_read(strategy, [0.0, 0.0])
    strategy.run(lambda: v.assign(np.array([1.0, 10.0], np.float32) * (replica_id() + 1)))
    assert strategy.reduce("SUM", v, axis=None).tolist() == [10.0, 100.0]
    assert strategy.reduce("MEAN", v, axis=None).tolist() == [2.5, 25.0]
    assert float(strategy.reduce("SUM", v, axis=0)) == 110.0  # each copy summed along axis 0, then across
    assert float(strategy.reduce("MEAN", v, axis=0)) == 13.75  # 110 / 8 elements


def test_reduce_to_of_a_sync_on_read_variable(strategy):
    v = sync_on_read(strategy)
    set_copies(strategy, v, [1.0, 2.0, 3.0, 4.0])
    onto_itself = strategy.extended.reduce_to("SUM", v, destinations=v)
    assert type(onto_itself) is Mirrored
    assert [float(x) for x in onto_itself.values] == [10.0] * 4
    onto_one_device = strategy.extended.reduce_to("MEAN", v, destinations="CPU:1")
    assert [float(x) for x in onto_one_device.values] == [2.5]


def test_reduce_of_a_mirrored_variable_with_mean_is_its_value(strategy):
    v = mirrored(strategy, [1.0, 2.0], SUM)
    assert strategy.extended.reduce_to("MEAN", v, destinations=v) is v  # already mirrored: returned as is
    assert strategy.reduce("MEAN", v, axis=None).tolist() == [1.0, 2.0]
    assert float(strategy.reduce("MEAN", v, axis=0)) == 1.5


def test_reduce_of_a_mirrored_variable_with_sum_raises(strategy):
    v = mirrored(strategy, [1.0, 2.0], SUM)
    with pytest.raises(ValueError, match="already reduced"):
        strategy.extended.reduce_to("SUM", v, destinations=v)
    with pytest.raises(ValueError, match="already reduced"):
        strategy.reduce("SUM", v, axis=None)


def test_merge_fn_reduces_per_replica_updates_onto_a_variable_then_updates_it(strategy):
    """The pattern an optimizer follows: merge_call, reduce_to onto the variable, extended.update."""
    v = mirrored(strategy, [1.0, 1.0])

    def apply(strategy_, grad):
        reduced = strategy_.extended.reduce_to("SUM", grad, destinations=v)
        return strategy_.extended.update(v, lambda c, g: c.assign_sub(0.5 * g), args=(reduced,))

    def step():
        grad = np.full(2, replica_id() + 1, np.float32)
        return distrib.get_replica_context().merge_call(apply, args=(grad,))

    assert strategy.run(step) is v
    assert copies(v) == [[-4.0, -4.0]] * 4


def test_sync_on_read_variables_are_not_trainable_by_default_but_may_be(strategy):
    with strategy.scope():
        metric = distrib.Variable(np.float32(0), synchronization="ON_READ", aggregation="SUM")
        assert metric.trainable is False
        assert distrib.Variable(np.float32(0)).trainable is True
        trainable = distrib.Variable(np.float32(0), trainable=True, synchronization="ON_READ", aggregation="SUM")
    assert isinstance(trainable, distrib.SyncOnReadVariable) and trainable.trainable is True


def test_aggregation_none_means_none(strategy):
    with strategy.scope():
        v = distrib.Variable(np.float32(0), aggregation=None)
    assert v.aggregation is distrib.VariableAggregation.NONE
    assert distrib.Variable(np.float32(0), aggregation=None).aggregation is distrib.VariableAggregation.NONE


# -- sparse writes: scatter_* (TensorFlow's tf.Variable.scatter_*, values.py's MirroredVariable/SyncOnRead rules) --

SCATTERS = ["scatter_add", "scatter_sub", "scatter_mul", "scatter_div", "scatter_min", "scatter_max", "scatter_update"]
ROW_SCATTERS = ["scatter_min", "scatter_max", "scatter_update"]  # refused for MirroredVariable with SUM or MEAN


def scatter_reference(method, array, indices, values):
    """NumPy's answer: tf.compat.v1.scatter_* accumulate repeated rows; for update, the last one wins."""
    out = np.array(array, copy=True)
    if method == "scatter_update":
        out[indices] = values
    else:
        ufunc = {"scatter_add": np.add, "scatter_sub": np.subtract, "scatter_mul": np.multiply,
                 "scatter_div": np.divide, "scatter_min": np.minimum, "scatter_max": np.maximum}[method]
        ufunc.at(out, indices, values)
    return out


@pytest.mark.parametrize("method", SCATTERS)
def test_scatter_on_a_plain_variable_matches_numpy_with_repeated_rows(method):
    initial = np.arange(1.0, 11.0, dtype=np.float32).reshape(5, 2)
    indices = np.array([3, 0, 3, 4])
    values = np.array([[2, 3], [4, 5], [6, 7], [8, 9]], np.float32)
    v = Variable(initial)
    assert getattr(v, method)(distrib.IndexedSlices(values, indices)) is v
    np.testing.assert_allclose(v.numpy(), scatter_reference(method, initial, indices, values))


def test_scatter_takes_indices_of_any_rank_and_integer_values_into_floats():
    v = Variable(np.zeros((4, 3), np.float64))
    v.scatter_add(distrib.IndexedSlices(np.ones((2, 2, 3), np.int64), np.array([[0, 1], [1, 3]])))
    assert v.numpy()[:, 0].tolist() == [1.0, 2.0, 0.0, 1.0]
    v.scatter_update(distrib.IndexedSlices(np.full(3, 7.0), np.int32(2)))  # a scalar index: one row
    assert v.numpy()[2].tolist() == [7.0, 7.0, 7.0]


def test_scatter_div_of_integers_truncates_toward_zero_as_tensorflow():
    v = Variable(np.array([7, -7, 9, 100], np.int32))
    v.scatter_div(distrib.IndexedSlices(np.array([2, 2, -2, 3, 3]), np.array([0, 1, 2, 3, 3])))
    assert v.numpy().tolist() == [3, -3, -4, 11]  # 100 / 3 / 3: 33 then 11
    with pytest.raises(ValueError, match="divide integers by zero"):
        v.scatter_div(distrib.IndexedSlices(np.array([0]), np.array([1])))
    assert v.numpy().tolist() == [3, -3, -4, 11]


@pytest.mark.parametrize("indices, error, match", [
    (np.array([-1]), IndexError, r"indices in \[0, 3\).*Received: index -1"),  # TensorFlow refuses negatives too
    (np.array([3]), IndexError, r"indices in \[0, 3\).*Received: index 3"),
    (np.array([1.0]), TypeError, "integer indices.*float64"),
])
def test_scatter_refuses_bad_indices_and_changes_nothing(indices, error, match):
    v = Variable(np.zeros(3, np.float32), name="w")
    with pytest.raises(error, match=match) as info:
        v.scatter_update(distrib.IndexedSlices(np.ones(1, np.float32), indices))
    assert "'w'" in str(info.value)
    assert v.numpy().tolist() == [0.0, 0.0, 0.0]


def test_scatter_refuses_bad_values_and_arguments():
    v = Variable(np.zeros((3, 2), np.int8), name="w")
    with pytest.raises(ValueError, match=r"shape .*\(2, 2\).*Received: shape \(2,\)"):
        v.scatter_add(distrib.IndexedSlices(np.ones(2, np.int8), np.array([0, 1])))
    with pytest.raises(TypeError, match="cannot write dtype float64 into variable 'w' of dtype int8"):
        v.scatter_add(distrib.IndexedSlices(np.ones((1, 2)), np.array([0])))
    with pytest.raises(TypeError, match="outside int8's range"):
        v.scatter_update(distrib.IndexedSlices(np.full((1, 2), 300), np.array([0])))
    with pytest.raises(TypeError, match="needs an IndexedSlices.*Received: ndarray"):
        v.scatter_add(np.ones((3, 2), np.int8))
    with pytest.raises(ValueError, match="rank 1 or more"):
        Variable(np.float32(1)).scatter_add(distrib.IndexedSlices(np.ones(1), np.array([0])))
    with pytest.raises(TypeError, match="real numbers"):
        Variable(np.zeros(2, bool)).scatter_add(distrib.IndexedSlices(np.ones(1, bool), np.array([0])))
    assert v.numpy().tolist() == [[0, 0]] * 3


def test_integer_values_that_fit_are_written_into_narrower_integers():
    v = Variable(np.zeros(3, np.int8))
    v.scatter_add(distrib.IndexedSlices(np.array([100, 27], np.int64), np.array([1, 1])))
    assert v.numpy().tolist() == [0, 127, 0]


@pytest.mark.parametrize("method", SCATTERS)
def test_a_value_read_before_a_scatter_never_changes(method):
    v = Variable(np.ones((3, 2), np.float32))
    before = v.read_value()
    getattr(v, method)(distrib.IndexedSlices(np.full((1, 2), 4.0, np.float32), np.array([1])))
    assert before.tolist() == [[1.0, 1.0]] * 3
    assert v.numpy()[1].tolist() != [1.0, 1.0] or method == "scatter_min"


def test_scatter_without_live_reads_writes_in_place():
    v = Variable(np.ones(4, np.float32))
    start = address(v.read_value())  # this read dies at once
    v.scatter_add(distrib.IndexedSlices(np.ones(1, np.float32), np.array([2])))
    v.scatter_update(distrib.IndexedSlices(np.zeros(1, np.float32), np.array([0])))
    after = v.read_value()
    assert address(after) == start
    assert after.tolist() == [0.0, 1.0, 2.0, 1.0]


def mirrored_rows(strategy, aggregation=NONE, dtype=np.float32):
    with strategy.scope():
        return distrib.Variable(np.ones((4, 2), dtype), aggregation=aggregation)


def first_column(variable) -> list:
    return [component.numpy()[:, 0].tolist() for component in variable.values]


@pytest.mark.parametrize("aggregation", ALL_AGGREGATIONS)
@pytest.mark.parametrize("method", SCATTERS)
def test_mirrored_scatter_in_cross_replica_context_updates_every_copy(strategy, aggregation, method):
    v = mirrored_rows(strategy, aggregation)
    delta = distrib.IndexedSlices(np.full((3, 2), 3.0, np.float32), np.array([0, 2, 2]))
    if method in ROW_SCATTERS and aggregation in (SUM, MEAN):
        with pytest.raises(NotImplementedError, match=f"{method}.*NONE or ONLY_FIRST_REPLICA.*{aggregation.name}"):
            getattr(v, method)(delta)
        return
    assert getattr(v, method)(delta) is v
    expected = scatter_reference(method, np.ones((4, 2), np.float32), delta.indices, delta.values)[:, 0].tolist()
    assert first_column(v) == [expected] * 4


def replica_rows(method, replica):
    """Replica r's IndexedSlices: value r + 2 at rows r % 2 and 3."""
    return distrib.IndexedSlices(np.full((2, 2), replica + 2.0, np.float32), np.array([replica % 2, 3]))


# Each replica r writes r + 2 at rows r % 2 and 3 of a variable of ones: SUM and MEAN combine the replicas' rows
# as TensorFlow reduces IndexedSlices (concatenated; MEAN divides the values by 4), ONLY_FIRST_REPLICA applies
# replica 0's (2 at rows 0 and 3) to every copy.
@pytest.mark.parametrize("aggregation, method, expected", [
    (SUM, "scatter_add", [1 + 2 + 4, 1 + 3 + 5, 1, 1 + 14]),
    (SUM, "scatter_sub", [1 - 6, 1 - 8, 1, 1 - 14]),
    (SUM, "scatter_mul", [8, 15, 1, 120]),
    (SUM, "scatter_div", [1 / 8, 1 / 15, 1, 1 / 120]),
    (MEAN, "scatter_add", [2.5, 3, 1, 4.5]),
    (MEAN, "scatter_sub", [-0.5, -1, 1, -2.5]),
    (MEAN, "scatter_mul", [0.5, 0.75 * 1.25, 1, 0.5 * 0.75 * 1.25 * 1.0 * 1.0]),
    (MEAN, "scatter_div", [2, 1 / (0.75 * 1.25), 1, 1 / (0.5 * 0.75 * 1.25)]),
] + [(FIRST, method, scatter_reference(method, np.ones(4), np.array([0, 3]), np.array([2.0, 2.0])).tolist())
     for method in SCATTERS])
def test_mirrored_scatter_in_replica_context_combines_the_replicas_rows(strategy, aggregation, method, expected):
    v = mirrored_rows(strategy, aggregation)
    assert strategy.run(lambda: getattr(v, method)(replica_rows(method, replica_id()))) is v
    for copy in first_column(v):
        np.testing.assert_allclose(copy, expected, rtol=1e-6)


@pytest.mark.parametrize("method", SCATTERS)
def test_mirrored_scatter_with_none_in_replica_context_changes_only_the_local_copy(strategy, method):
    v = mirrored_rows(strategy, NONE)
    strategy.run(lambda: getattr(v, method)(replica_rows(method, replica_id())))
    for replica, copy in enumerate(first_column(v)):
        reference = scatter_reference(method, np.ones(4), np.array([replica % 2, 3]), np.full(2, replica + 2.0))
        np.testing.assert_allclose(copy, reference, rtol=1e-6)


@pytest.mark.parametrize("aggregation", [SUM, MEAN])
@pytest.mark.parametrize("method", ROW_SCATTERS)
def test_mirrored_row_scatters_with_sum_or_mean_raise_in_replica_context(strategy, aggregation, method):
    v = mirrored_rows(strategy, aggregation)
    with pytest.raises(NotImplementedError, match=f"{method}.*NONE or ONLY_FIRST_REPLICA"):
        strategy.run(lambda: getattr(v, method)(replica_rows(method, replica_id())))
    assert first_column(v) == [[1.0] * 4] * 4


def test_mirrored_scatter_add_of_integers_with_sum(strategy):
    v = mirrored_rows(strategy, SUM, np.int32)
    strategy.run(lambda: v.scatter_add(distrib.IndexedSlices(np.array([[replica_id()] * 2]), np.array([1]))))
    assert first_column(v) == [[1, 7, 1, 1]] * 4


@pytest.mark.parametrize("method", ["scatter_add", "scatter_mul"])
def test_the_same_indexed_slices_on_every_replica_cannot_be_summed(strategy, method):
    v = mirrored_rows(strategy, SUM)
    delta = distrib.IndexedSlices(np.full((1, 2), 2.0, np.float32), np.array([0]))
    with pytest.raises(ValueError, match="same object on every replica"):
        strategy.run(lambda: getattr(v, method)(delta))
    assert first_column(v) == [[1.0] * 4] * 4


@pytest.mark.parametrize("method", ["scatter_add", "scatter_mul"])
def test_the_same_indexed_slices_on_every_replica_with_mean_is_applied_once(strategy, method):
    v = mirrored_rows(strategy, MEAN)
    delta = distrib.IndexedSlices(np.full((1, 2), 2.0, np.float32), np.array([0]))
    strategy.run(lambda: getattr(v, method)(delta))
    assert first_column(v) == [[3.0 if method == "scatter_add" else 2.0, 1.0, 1.0, 1.0]] * 4


def test_a_bad_index_in_one_replica_raises_before_any_copy_changes(strategy):
    v = mirrored_rows(strategy, SUM)
    with pytest.raises(IndexError, match="Received: index 9"):
        strategy.run(lambda: v.scatter_add(distrib.IndexedSlices(np.ones((1, 2), np.float32),
                                                                 np.array([9 if replica_id() == 2 else 0]))))
    assert first_column(v) == [[1.0] * 4] * 4


def test_cross_replica_scatter_of_per_replica_rows_raises(strategy):
    v = mirrored_rows(strategy, SUM)
    delta = strategy.run(lambda: distrib.IndexedSlices(np.ones((1, 2), np.float32), np.array([replica_id()])))
    with pytest.raises(ValueError, match="one IndexedSlices in a cross-replica context.*PerReplica"):
        v.scatter_add(delta)


def test_mirrored_scatter_keeps_earlier_reads(strategy):
    v = mirrored_rows(strategy, FIRST)
    before = v.read_value()
    v.scatter_update(distrib.IndexedSlices(np.zeros((1, 2), np.float32), np.array([0])))
    assert before.tolist() == [[1.0, 1.0]] * 4
    assert first_column(v) == [[0.0, 1.0, 1.0, 1.0]] * 4


@pytest.mark.parametrize("method", SCATTERS)
def test_sync_on_read_scatter_raises_not_implemented(strategy, method):
    v = sync_on_read(strategy, value=np.zeros(3), aggregation=SUM)
    delta = distrib.IndexedSlices(np.ones(1, np.float32), np.array([0]))
    with pytest.raises(NotImplementedError, match=f"{method} is not supported for a SyncOnReadVariable"):
        getattr(v, method)(delta)
    with pytest.raises(NotImplementedError, match="SyncOnReadVariable"):
        strategy.run(lambda: getattr(v, method)(delta))


def test_a_write_with_read_value_false_returns_none_in_every_context_as_tensorflow_eager():
    # TensorFlow's eager writes return None with read_value=False; distrib returned the variable (or the value)
    plain = distrib.Variable(np.float32(1.0))
    assert plain.assign(2.0, read_value=False) is None and plain.assign_add(1.0, read_value=False) is None
    assert plain.assign_sub(1.0, read_value=False) is None and float(plain.numpy()) == 2.0
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        mirrored = distrib.Variable(np.float32(0.0), aggregation="MEAN")
        local_only = distrib.Variable(np.float32(0.0))  # aggregation NONE: a replica writes its own copy
        on_read = distrib.Variable(np.float32(0.0), synchronization="ON_READ", aggregation="SUM")
    assert mirrored.assign(1.0, read_value=False) is None  # cross-replica

    def step():
        return (mirrored.assign_add(1.0, read_value=False), local_only.assign_add(1.0, read_value=False),
                on_read.assign_add(1.0, read_value=False))

    assert strategy.run(step) == (None, None, None)
    assert float(mirrored.numpy()) == 2.0 and float(on_read.numpy()) == 2.0
    assert [float(v) for v in strategy.experimental_local_results(local_only)] == [1.0, 1.0]
    assert mirrored.assign(5.0) is mirrored  # read_value=True keeps what it returned


@pytest.mark.parametrize("aggregation, written", [
    ("SUM", [("assign", 4.0, 4.0)]),
    ("MEAN", [("assign", 4.0, 4.0), ("assign_add", 1.0, 5.0), ("assign_sub", 1.0, 4.0)]),
    ("ONLY_FIRST_REPLICA", [("assign", 4.0, 4.0), ("assign_add", 1.0, 5.0), ("assign_sub", 1.0, 4.0)]),
])
def test_a_cross_replica_write_of_a_sync_on_read_variable_returns_what_it_now_reads_as(aggregation, written):
    # TensorFlow 2.21 returns the variable's aggregated read (a tensor) here; distrib returned the variable
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        v = distrib.Variable(np.float32(1.0), synchronization="ON_READ", aggregation=aggregation)
    results = [getattr(v, method)(value) for method, value, _ in written]
    assert all(isinstance(result, np.ndarray) for result in results), results
    assert [float(result) for result in results] == [expected for _, _, expected in written]  # later writes left
    # each earlier result as it was


def test_a_write_with_read_value_false_and_a_restore_never_read_a_sync_on_read_variable(tmp_path, monkeypatch):
    # across processes a SyncOnRead read is a collective: a restore, or a write that returns nothing, needs none
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        v = distrib.Variable(np.float32(3.0), synchronization="ON_READ", aggregation="MEAN")
    checkpoint = distrib.Checkpoint(v=v)
    checkpoint.save(tmp_path / "ckpt")

    def no_read(self):
        raise AssertionError("read")

    monkeypatch.setattr(distrib.distributed_variables.SyncOnReadVariable, "read_value", no_read)
    assert v.assign(1.0, read_value=False) is None
    checkpoint.restore(tmp_path / "ckpt")
    monkeypatch.undo()
    assert float(v.numpy()) == 3.0
