"""ReduceOp parsing, CommunicationOptions validation and TensorFlow's merge rule, and InputOptions validation."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np
import pytest

import distrib
from distrib import CommunicationImplementation, CommunicationOptions, InputOptions, InputReplicationMode, ReduceOp

# -- ReduceOp -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, op", [("SUM", ReduceOp.SUM), ("sum", ReduceOp.SUM), ("Sum", ReduceOp.SUM),
                                      ("MEAN", ReduceOp.MEAN), ("mean", ReduceOp.MEAN), ("mEaN", ReduceOp.MEAN)])
def test_reduce_op_accepts_its_name_in_any_case(name, op):
    assert ReduceOp.from_value(name) is op


def test_reduce_op_passes_through_unchanged():
    assert ReduceOp.from_value(ReduceOp.SUM) is ReduceOp.SUM
    assert ReduceOp.from_value(ReduceOp.MEAN) is ReduceOp.MEAN


def test_reduce_op_accepts_an_enum_member_named_sum_or_mean():
    class VariableAggregation(enum.Enum):  # stands for TensorFlow's VariableAggregation / ReduceOp
        SUM = 1
        MEAN = 2

    assert ReduceOp.from_value(VariableAggregation.SUM) is ReduceOp.SUM
    assert ReduceOp.from_value(VariableAggregation.MEAN) is ReduceOp.MEAN


@pytest.mark.parametrize("op", ["MAX", "prod", "min", "", "sum ", "ONLY_FIRST_REPLICA"])
def test_reduce_op_rejects_other_names(op):
    with pytest.raises(ValueError, match="Only SUM and MEAN are supported reduce ops"):
        ReduceOp.from_value(op)


@pytest.mark.parametrize("op", [None, 0, 1.5, ["SUM"]])
def test_reduce_op_rejects_other_kinds_of_value(op):
    with pytest.raises(ValueError, match="Only SUM and MEAN are supported reduce ops"):
        ReduceOp.from_value(op)


# -- CommunicationImplementation ------------------------------------------------------------------------------


@pytest.mark.parametrize("value, implementation", [
    ("auto", CommunicationImplementation.AUTO),
    ("Ring", CommunicationImplementation.RING),
    ("NCCL", CommunicationImplementation.NCCL),
    (CommunicationImplementation.NCCL, CommunicationImplementation.NCCL),
])
def test_communication_implementation_from_name_or_member(value, implementation):
    assert CommunicationImplementation.from_value(value) is implementation


@pytest.mark.parametrize("value", ["MPI", "", None, 1])
def test_communication_implementation_rejects_unknown_values(value):
    with pytest.raises(ValueError, match="implementation must be one of AUTO, RING, NCCL"):
        CommunicationImplementation.from_value(value)


# -- CommunicationOptions: validation -------------------------------------------------------------------------


def test_communication_options_defaults():
    options = CommunicationOptions()
    assert options.bytes_per_pack == 0
    assert options.timeout_seconds is None
    assert options.implementation is CommunicationImplementation.AUTO
    assert options.timeout is None


def test_communication_options_normalises_its_fields():
    options = CommunicationOptions(bytes_per_pack=np.int64(1 << 20), timeout_seconds=2.5, implementation="nccl")
    assert options.bytes_per_pack == 1 << 20 and type(options.bytes_per_pack) is int
    assert options.timeout_seconds == 2.5
    assert options.implementation is CommunicationImplementation.NCCL


@pytest.mark.parametrize("bytes_per_pack", [-1, -(1 << 20)])
def test_negative_bytes_per_pack_is_a_value_error(bytes_per_pack):
    with pytest.raises(ValueError, match="bytes_per_pack must be non-negative"):
        CommunicationOptions(bytes_per_pack=bytes_per_pack)


@pytest.mark.parametrize("bytes_per_pack", [1.5, "32", None, True])
def test_bytes_per_pack_must_be_an_int(bytes_per_pack):
    with pytest.raises(TypeError, match="bytes_per_pack must be an int"):
        CommunicationOptions(bytes_per_pack=bytes_per_pack)


def test_negative_timeout_is_a_value_error():
    with pytest.raises(ValueError, match="timeout_seconds must be non-negative"):
        CommunicationOptions(timeout_seconds=-1)


@pytest.mark.parametrize("timeout_seconds", ["5", True, [5]])
def test_timeout_must_be_a_number_or_none(timeout_seconds):
    with pytest.raises(TypeError, match="timeout_seconds must be a number or None"):
        CommunicationOptions(timeout_seconds=timeout_seconds)


@pytest.mark.parametrize("timeout_seconds, timeout", [(None, None), (0, None), (0.0, None), (5, 5), (0.25, 0.25)])
def test_a_zero_timeout_means_none(timeout_seconds, timeout):
    assert CommunicationOptions(timeout_seconds=timeout_seconds).timeout == timeout


def test_unknown_implementation_is_a_value_error():
    with pytest.raises(ValueError, match="implementation must be one of AUTO, RING, NCCL"):
        CommunicationOptions(implementation="gloo")


def test_communication_options_are_frozen_and_hashable():
    options = CommunicationOptions(bytes_per_pack=64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.bytes_per_pack = 128
    assert options == CommunicationOptions(bytes_per_pack=64)
    assert len({options, CommunicationOptions(bytes_per_pack=64)}) == 1


# -- CommunicationOptions: TensorFlow's merge rule -------------------------------------------------------------

NCCL, RING, AUTO = CommunicationImplementation.NCCL, CommunicationImplementation.RING, CommunicationImplementation.AUTO
BASE = CommunicationOptions(bytes_per_pack=1024, timeout_seconds=60, implementation="NCCL")


@pytest.mark.parametrize("override, expected", [
    (None, (1024, 60, NCCL)),
    (CommunicationOptions(), (1024, 60, NCCL)),
    (CommunicationOptions(bytes_per_pack=64), (64, 60, NCCL)),
    (CommunicationOptions(timeout_seconds=5), (1024, 5, NCCL)),
    (CommunicationOptions(timeout_seconds=0), (1024, 0, NCCL)),
    (CommunicationOptions(implementation="RING"), (1024, 60, RING)),
    (CommunicationOptions(bytes_per_pack=1, timeout_seconds=2, implementation="ring"), (1, 2, RING)),
], ids=["none", "defaults", "bytes", "timeout", "zero-timeout", "implementation", "all"])
def test_merge_overrides_only_the_fields_set_away_from_their_default(override, expected):
    merged = BASE.merge(override)
    assert (merged.bytes_per_pack, merged.timeout_seconds, merged.implementation) == expected


def test_merge_onto_defaults_takes_every_set_field():
    call = CommunicationOptions(bytes_per_pack=32, timeout_seconds=1.5)
    assert CommunicationOptions().merge(call) == call


def test_merge_returns_new_options_and_leaves_both_inputs_alone():
    call = CommunicationOptions(timeout_seconds=5)
    merged = BASE.merge(call)
    assert merged is not BASE
    assert BASE == CommunicationOptions(bytes_per_pack=1024, timeout_seconds=60, implementation="NCCL")
    assert call == CommunicationOptions(timeout_seconds=5)


def test_merge_needs_communication_options():
    with pytest.raises(TypeError, match="options must be a CommunicationOptions"):
        BASE.merge({"timeout_seconds": 5})


# -- RunOptions and InputOptions ------------------------------------------------------------------------------


def test_run_options_defaults_match_tensorflow():
    options = distrib.RunOptions()
    assert options.experimental_enable_dynamic_batch_size is True
    assert options.experimental_bucketizing_dynamic_shape is False
    assert options.experimental_xla_options is None


def test_input_options_defaults_match_tensorflow():
    options = InputOptions()
    assert options.experimental_fetch_to_device is True
    assert options.experimental_replication_mode is InputReplicationMode.PER_WORKER
    assert options.experimental_place_dataset_on_device is False
    assert options.experimental_per_replica_buffer_size == 1


def test_input_options_accept_per_replica_mode_and_placing_the_dataset_on_device():
    options = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA,
                           experimental_place_dataset_on_device=True, experimental_fetch_to_device=False,
                           experimental_per_replica_buffer_size=4)
    assert options.experimental_place_dataset_on_device
    assert options.experimental_per_replica_buffer_size == 4


def test_replication_mode_must_be_an_input_replication_mode():
    with pytest.raises(TypeError, match="experimental_replication_mode must be an InputReplicationMode"):
        InputOptions(experimental_replication_mode="PER_REPLICA")


@pytest.mark.parametrize("size", [-1, True, 1.5, "2"])
def test_per_replica_buffer_size_must_be_a_non_negative_int(size):
    with pytest.raises(ValueError, match=r"experimental_per_replica_buffer_size must be an int >= 0 \(0: no "):
        InputOptions(experimental_per_replica_buffer_size=size)


def test_fetch_to_device_none_means_true_as_in_tensorflow():
    assert InputOptions(experimental_fetch_to_device=None).experimental_fetch_to_device is True
    assert InputOptions(None).experimental_fetch_to_device is True


def test_placing_the_dataset_on_device_is_checked_by_datasets_from_function_only_as_in_tensorflow():
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    batches = [np.arange(4.0), np.arange(4.0, 8.0)]
    on_device = InputOptions(experimental_place_dataset_on_device=True)  # constructed, as TensorFlow's
    per_replica = InputOptions(experimental_place_dataset_on_device=True,
                               experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    with pytest.raises(ValueError, match="experimental_place_dataset_on_device=True requires "
                                         "experimental_replication_mode=InputReplicationMode.PER_REPLICA"):
        strategy.distribute_datasets_from_function(lambda ctx: batches[:1], on_device)
    with pytest.raises(ValueError, match="experimental_place_dataset_on_device=True requires "
                                         "experimental_fetch_to_device=False"):
        strategy.distribute_datasets_from_function(lambda ctx: batches[:1], per_replica)
    placed = InputOptions(experimental_place_dataset_on_device=True, experimental_fetch_to_device=False,
                          experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    assert len(list(strategy.distribute_datasets_from_function(lambda ctx: batches[:1], placed))) == 1
    steps = list(strategy.experimental_distribute_dataset(batches, on_device))  # ignored there
    np.testing.assert_array_equal(strategy.experimental_local_results(steps[1])[1], [6.0, 7.0])


def test_one_enum_coercer_takes_members_and_names_in_any_case_and_states_the_rule():
    from distrib.options import coerce_enum

    assert coerce_enum(CommunicationImplementation, "Ring", "implementation") is CommunicationImplementation.RING
    assert coerce_enum(distrib.VariableAggregation, "only_first_replica", "aggregation") is \
        distrib.VariableAggregation.ONLY_FIRST_REPLICA
    with pytest.raises(ValueError, match=r"^aggregation must be one of NONE, SUM, MEAN, ONLY_FIRST_REPLICA\. "
                                         r"Received: 'max'\.$"):
        coerce_enum(distrib.VariableAggregation, "max", "aggregation")
    with pytest.raises(ValueError, match=r"^implementation must be one of AUTO, RING, NCCL\. Received: 3 of type int"):
        coerce_enum(CommunicationImplementation, 3, "implementation")
