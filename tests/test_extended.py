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
    with pytest.raises(ValueError, match="A non-distributed value cannot be reduced with SUM on 4 replicas"):
        strategy.extended.reduce_to("SUM", np.float32(1), destinations=np.zeros(3))
