"""Replicas that disagree on a collective's arguments get a typed error naming the replica, never a silent choice."""

from __future__ import annotations

import numpy as np
import pytest

import distrib
from distrib import CommunicationOptions
from distrib.errors import CollectiveMismatchError

pytestmark = pytest.mark.timeout(30)

DEVICES = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]


@pytest.fixture(scope="module")
def strategy():
    with distrib.MirroredStrategy(DEVICES) as strategy:
        yield strategy


def replica_id():
    return distrib.get_replica_context().replica_id_in_sync_group


def assert_usable(strategy):
    out = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(1)))
    assert [float(x) for x in strategy.experimental_local_results(out)] == [4.0] * 4


def test_replicas_asking_for_different_reduce_ops_get_an_error(strategy):
    def step():
        return distrib.get_replica_context().all_reduce("MEAN" if replica_id() == 2 else "SUM", np.float32(1))

    with pytest.raises(CollectiveMismatchError,
                       match="all_reduce needs the same reduce_op on every replica. Received: replica 2, reduce_op "
                             "MEAN vs SUM"):
        strategy.run(step)
    assert_usable(strategy)


def test_replicas_gathering_along_different_axes_get_an_error(strategy):
    def step():
        return distrib.get_replica_context().all_gather(np.ones((2, 2), np.float32), axis=1 if replica_id() == 3 else 0)

    with pytest.raises(CollectiveMismatchError,
                       match="all_gather needs the same axis on every replica. Received: replica 3, axis 1 vs 0"):
        strategy.run(step)
    assert_usable(strategy)


def test_replicas_passing_different_options_get_an_error(strategy):
    def step():
        options = CommunicationOptions(bytes_per_pack=1024 if replica_id() == 1 else 0)
        return distrib.get_replica_context().all_reduce("SUM", np.float32(1), options)

    with pytest.raises(CollectiveMismatchError,
                       match="all_reduce needs the same options on every replica. Received: replica 1, options "
                             r"CommunicationOptions\(bytes_per_pack=1024"):
        strategy.run(step)


def test_one_replica_passing_none_is_a_structure_mismatch_naming_it(strategy):
    def step():
        value = None if replica_id() == 2 else np.float32(1)
        return distrib.get_replica_context().all_reduce("SUM", value)

    with pytest.raises(CollectiveMismatchError, match="all_reduce needs the same structure on every replica") as info:
        strategy.run(step)
    assert "replica 2" in str(info.value)
    assert_usable(strategy)


def test_every_replica_passing_nothing_gets_nothing_back(strategy):
    out = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", None))
    assert out is None
    out = strategy.run(lambda: distrib.get_replica_context().all_gather({}, axis=0))
    assert out == {}


def test_a_per_replica_value_of_the_wrong_length_is_a_value_error(strategy):
    three = distrib.PerReplica([np.float32(1)] * 3)
    with pytest.raises(ValueError, match=r"A PerReplica needs one component per replica \(4\). Received: 3 "
                                         r"components at path \[0\]"):
        strategy.run(lambda x: x, args=(three,))
    five = distrib.PerReplica([np.float32(1)] * 5)
    with pytest.raises(ValueError, match=r"A PerReplica needs one component per replica \(4\). Received: 5"):
        strategy.run(lambda x: x, args=(five,))


def test_a_list_of_per_replica_values_with_one_of_the_wrong_length_names_its_path(strategy):
    good = [distrib.PerReplica([np.float32(k)] * 4) for k in range(5)]
    for wrong in (3, 5):
        grads = good[:2] + [distrib.PerReplica([np.float32(1)] * wrong)] + good[2:]
        with pytest.raises(ValueError, match=rf"A PerReplica needs one component per replica \(4\). Received: "
                                             rf"{wrong} components at path \[0\]\[2\]"):
            strategy.run(lambda g: g, args=(grads,))
    three = good[:2] + [distrib.PerReplica([np.float32(1)] * 3)] + good[2:]
    with pytest.raises(ValueError, match=r"A PerReplica needs one component per replica \(4\). Received: 3 "
                                         r"components at path \[1\]\['w'\]\[2\]"):
        strategy.run(lambda lr, g: g, args=(0.1, {"w": three}))
    out = strategy.run(lambda g: [x * 2 for x in g], args=(good,))
    assert [strategy.experimental_local_results(x) for x in out] == [(2.0 * k,) * 4 for k in range(5)]


class StepFailed(Exception):
    """A user's exception."""


class Described(Exception):
    """A user's exception with a message of its own making."""

    def __str__(self):
        return "described"


@pytest.mark.parametrize("error", [StepFailed("boom"), Described()])
def test_an_exception_object_raised_again_names_the_replica_that_raised_it_last(strategy, error):
    def raise_on(replica):
        def step():
            if replica_id() == replica:
                raise error
        return step

    with pytest.raises(type(error)):
        strategy.run(raise_on(1))
    with pytest.raises(type(error)) as info:
        strategy.run(raise_on(3))
    assert info.value is error and info.value.replica_id == 3
    described = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert "replica 3 of 4" in described and "replica 1" not in described
