"""StrategyExtended on four emulated CPU replicas: reduce_to, batch_reduce_to, broadcast_to, devices."""

from __future__ import annotations

import numpy as np
import pytest

import distrib
from distrib import CommunicationOptions, Mirrored, PerReplica
from support import local, per_replica

pytestmark = pytest.mark.timeout(30)


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


def batch_of_gradients(strategy, count=40):
    """`count` PerReplica values of mixed shapes and dtypes, as a model's gradients are."""
    kinds = [((3, 2), np.float32), ((5,), np.int64), ((), np.float64), ((2, 2), np.complex64), ((7,), np.float16)]
    return [per_replica(strategy, lambda r, k=k, shape=kinds[k % 5][0], dtype=kinds[k % 5][1]:
                        np.full(shape, k + r + 1, dtype)) for k in range(count)]


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_batch_reduce_to_of_a_steps_gradients_equals_reducing_each_alone(strategy, op):
    values = batch_of_gradients(strategy)
    variables = [strategy.extended._create_variable(np.zeros(v.values[0].shape, v.values[0].dtype)) for v in values]
    own = strategy.extended.worker_devices
    assert strategy.extended._placed_batch([(v, own) for v in values]) is not None  # checked in bulk, not one by one
    for destinations in (values, variables):  # onto the values themselves, or onto variables (as optimizers do)
        out = strategy.extended.batch_reduce_to(op, list(zip(values, destinations)))
        assert len(out) == len(values) and all(type(m) is Mirrored and len(m.values) == 4 for m in out)
        for k, (value, mirrored) in enumerate(zip(values, out)):
            alone = strategy.extended.reduce_to(op, value, destinations=value)
            for got, expected in zip(mirrored.values, alone.values):
                assert got.dtype == expected.dtype and got.shape == expected.shape, k
                np.testing.assert_array_equal(got, expected)


def test_a_batch_with_one_value_wrong_names_it(strategy):
    values = batch_of_gradients(strategy, 12)
    values[7] = PerReplica([np.ones(3, np.float32)] * 2 + [np.ones(4, np.float32)] * 2)  # replica 2 differs
    with pytest.raises(distrib.errors.CollectiveMismatchError, match="replica 2, value 7"):
        strategy.extended.batch_reduce_to("SUM", [(v, v) for v in values])
    values[7] = per_replica(strategy, lambda r: np.array([True, False]))
    with pytest.raises(TypeError, match="Reductions need numeric values. Received: dtype bool at value 7"):
        strategy.extended.batch_reduce_to("SUM", [(v, v) for v in values])
    values[7] = PerReplica([[float(r)] for r in range(4)])  # lists: placed on the way, as a value alone is
    out = strategy.extended.batch_reduce_to("SUM", [(v, v) for v in values])
    assert out[7].values[2].tolist() == [6.0]
    assert out[8].values[0].tolist() == [[42, 42], [42, 42]]  # complex64 9 + 10 + 11 + 12, beside it


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


def test_reduce_to_takes_an_array_as_destinations_its_device(strategy):
    values = strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(1))
    reduced = strategy.extended.reduce_to("SUM", values, destinations=np.zeros(3))
    assert [float(x) for x in local(strategy, reduced)] == [4.0]  # onto CPU:0, where a NumPy array lives
    # a NumPy scalar too (what a merge_call hands a lone replica's value as): before, a TypeError
    reduced = strategy.extended.reduce_to("SUM", values, destinations=np.float32(2))
    assert [float(x) for x in local(strategy, reduced)] == [4.0]
    with pytest.raises(ValueError, match="A non-distributed value cannot be reduced with SUM on 4 replicas"):
        strategy.extended.reduce_to("SUM", np.float32(1), destinations=np.zeros(3))


@pytest.mark.parametrize("devices, named", [
    (["CPU:0", "CPU:1"], "('CPU:0', 'CPU:1'), or 'host' for the host CPU."),  # CPU:0 named once
    (["CPU:1", "CPU:2"], "('CPU:1', 'CPU:2'), 'CPU:0' or 'host' for the host CPU."),
])
def test_an_unknown_destination_names_each_device_it_could_be_once(devices, named):
    strategy = distrib.MirroredStrategy(devices)
    value = per_replica(strategy, lambda i: np.float32(i))
    with pytest.raises(ValueError) as error:
        strategy.extended.reduce_to("SUM", value, "CPU:5")
    assert str(error.value) == f"Unknown destination 'CPU:5': expected one of the strategy's devices {named}"


def test_batch_reduce_to_names_a_distributed_value_given_instead_of_a_pair_in_one_line():
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    value = per_replica(strategy, lambda i: np.float32(i))
    with pytest.raises(TypeError) as error:
        strategy.extended.batch_reduce_to("SUM", [value])
    assert str(error.value) == "value_destination_pairs[0] must be a (value, destinations) pair. Received: a " \
                               "PerReplica."


# -- call_for_each_replica ---------------------------------------------------------------------------------------


def test_call_for_each_replica_runs_fn_as_run_does(strategy):
    # before: AttributeError, on every strategy's extended
    doubled = per_replica(strategy, lambda r: np.float32(r))
    out = strategy.extended.call_for_each_replica(lambda x, scale: x * scale, args=(doubled,),
                                                  kwargs={"scale": np.float32(2)})
    assert [float(x) for x in local(strategy, out)] == [0.0, 2.0, 4.0, 6.0]
    summed = strategy.extended.call_for_each_replica(
        lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(1)))
    assert [float(x) for x in local(strategy, summed)] == [4.0] * 4
    assert distrib.get_strategy().extended.call_for_each_replica(lambda x: x + 1, args=(1.0,)) == 2.0
