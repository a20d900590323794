"""Failures are typed, name the replica and the structure path, never hang, and leave the strategy usable."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

import distrib
from distrib import CommunicationOptions
from distrib.errors import (CollectiveMismatchError, ContextError, DeadlineExceededError, DistribError,
                            MergeCallMismatchError)

pytestmark = pytest.mark.timeout(30)

DEVICES = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
SLEEP = 1.5  # how long a "missing" replica stays away from a collective; timeouts in these tests are 0.3 s


class StepFailed(Exception):
    """A user's exception, raised inside a replica function."""


@pytest.fixture
def strategy():
    return distrib.MirroredStrategy(DEVICES)


def replica_id():
    return distrib.get_replica_context().replica_id_in_sync_group


def replica_threads():
    """Every live thread that runs a replica, of any strategy."""
    return {t for t in threading.enumerate() if t.name.startswith("distrib-replica-") and t.is_alive()}


def run_threads(strategy):
    """The threads `strategy` runs its replicas on (its first run starts them)."""
    return set(strategy.experimental_local_results(strategy.run(threading.current_thread)))


def wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def assert_usable(strategy):
    """A run after the failure gives the right answer on every replica."""
    out = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(replica_id() + 1)))
    assert [float(x) for x in strategy.experimental_local_results(out)] == [10.0] * len(DEVICES)


# -- an exception in a replica ------------------------------------------------------------------------------------


def test_an_exception_in_a_replica_reaches_run_as_itself_naming_the_replica(strategy):
    raised = []

    def step():
        if replica_id() == 2:
            raised.append(StepFailed("loss is NaN"))
            raise raised[0]
        return distrib.get_replica_context().all_reduce("SUM", np.float32(1))

    with pytest.raises(StepFailed, match=r"^loss is NaN \(raised in replica 2 of 4\)$") as excinfo:
        strategy.run(step)
    assert excinfo.value is raised[0]
    assert type(excinfo.value) is StepFailed
    assert "step" in [entry.name for entry in excinfo.traceback]  # the replica's frame is kept


def test_an_exception_with_its_own_str_names_the_replica_in_a_note(strategy):
    def step():
        if replica_id() == 1:
            raise KeyError("learning_rate")

    with pytest.raises(KeyError) as excinfo:
        strategy.run(step)
    assert excinfo.value.args == ("learning_rate",)
    if sys.version_info >= (3, 11):
        assert "raised in replica 1 of 4" in "".join(excinfo.value.__notes__)


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("devices, execution", [(DEVICES, "threads"), (DEVICES, "cooperative"), (DEVICES[:1], None)],
                         ids=["threads", "cooperative", "one replica"])
def test_a_keyboard_interrupt_or_exit_raised_in_a_replica_is_named_whichever_way_replicas_run(devices, execution,
                                                                                              error):
    strategy = distrib.MirroredStrategy(devices, replica_execution=execution)
    last = len(devices) - 1

    def step():
        if replica_id() == last:
            raise error("stop here")
        return distrib.get_replica_context().all_reduce("SUM", np.float32(1))

    with pytest.raises(error, match=rf"^stop here \(raised in replica {last} of {len(devices)}\)$") as excinfo:
        strategy.run(step)
    assert excinfo.value.replica_id == last

    def merge_fn(_):
        raise error("stop the merge")

    with pytest.raises(error, match=r"^stop the merge$") as excinfo:  # raised cross-replica: no replica to name
        strategy.run(lambda: distrib.get_replica_context().merge_call(merge_fn))
    assert not hasattr(excinfo.value, "replica_id")
    assert strategy.run(lambda: 5) == 5


def test_replicas_waiting_at_a_collective_are_unwound_and_their_threads_reused(strategy):
    before = replica_threads()
    threads = run_threads(strategy)
    assert threads == replica_threads() - before
    after_collective = []

    def step():
        if replica_id() == 2:
            raise StepFailed("boom")
        distrib.get_replica_context().all_reduce("SUM", np.float32(1))
        after_collective.append(replica_id())

    with pytest.raises(StepFailed, match="replica 2"):
        strategy.run(step)
    assert after_collective == []
    assert replica_threads() - before == threads  # none left behind, none replaced
    assert run_threads(strategy) == threads
    assert_usable(strategy)


def test_run_returns_only_once_every_other_replica_has_stopped(strategy):
    finished = []

    def step():
        if replica_id() == 0:
            raise StepFailed("early failure")
        time.sleep(0.2)  # still computing when replica 0 fails
        finished.append(replica_id())

    with pytest.raises(StepFailed, match="replica 0"):
        strategy.run(step)
    assert sorted(finished) == [1, 2, 3]
    assert_usable(strategy)


def test_an_exception_in_merge_fn_reaches_run_as_itself(strategy):
    error = StepFailed("merge failed")

    def merge_fn(merge_strategy):
        raise error

    with pytest.raises(StepFailed) as excinfo:
        strategy.run(lambda: distrib.get_replica_context().merge_call(merge_fn))
    assert excinfo.value is error
    assert_usable(strategy)


def test_the_strategy_survives_many_failed_runs(strategy):
    before = replica_threads()
    threads = run_threads(strategy)

    def step():
        if replica_id() == 3:
            raise StepFailed("again")
        return distrib.get_replica_context().all_reduce("SUM", np.float32(1))

    for _ in range(10):
        with pytest.raises(StepFailed):
            strategy.run(step)
    assert replica_threads() - before == threads
    assert_usable(strategy)


# -- replicas passing different values to one collective ---------------------------------------------------------


def all_reduce_where_replica(bad_replica, bad_value, good_value, op="SUM"):
    def step():
        value = bad_value() if replica_id() == bad_replica else good_value()
        return distrib.get_replica_context().all_reduce(op, value)

    return step


def all_gather_where_replica(bad_replica, bad_value, good_value, axis=0):
    def step():
        value = bad_value() if replica_id() == bad_replica else good_value()
        return distrib.get_replica_context().all_gather(value, axis=axis)

    return step


f32 = np.float32


@pytest.mark.parametrize("step, message", [
    (all_reduce_where_replica(2, lambda: {"a": f32(1), "b": []}, lambda: {"a": f32(1), "b": [f32(2)]}),
     r"^all_reduce needs the same structure on every replica\. Received: replica 2, path \['b'\]\[0\]"),
    (all_reduce_where_replica(3, lambda: {"a": f32(1), "b": (f32(2),)}, lambda: {"a": f32(1), "b": [f32(2)]}),
     r"^all_reduce needs the same structure on every replica\. Received: replica 3, path \['b'\] is a tuple"),
    (all_reduce_where_replica(1, lambda: {"b": [np.zeros(4, f32)]}, lambda: {"b": [np.zeros(3, f32)]}),
     r"^all_reduce needs the same shape on every replica\. Received: replica 1, path \['b'\]\[0\], "
     r"shape \(4,\) vs \(3,\)"),
    (all_reduce_where_replica(3, lambda: [np.zeros(3)], lambda: [np.zeros(3, f32)]),
     r"^all_reduce needs the same dtype on every replica\. Received: replica 3, path \[0\], "
     r"dtype float64 vs float32"),
    (all_gather_where_replica(2, lambda: {"x": np.zeros((1, 2))}, lambda: {"x": np.zeros((1, 2)), "y": np.ones(1)}),
     r"^all_gather needs the same structure on every replica\. Received: replica 2, path \['y'\]"),
    (all_gather_where_replica(1, lambda: {"x": np.zeros((1, 3))}, lambda: {"x": np.zeros((1, 2))}),
     r"^all_gather needs shapes that differ only along axis 0\. Received: replica 1, path \['x'\]"),
    (all_gather_where_replica(2, lambda: [np.zeros(2, np.int32)], lambda: [np.zeros(2, np.int64)]),
     r"^all_gather needs the same dtype on every replica\. Received: replica 2, path \[0\]"),
], ids=["reduce-missing-leaf", "reduce-list-vs-tuple", "reduce-shape", "reduce-dtype", "gather-extra-key",
        "gather-shape", "gather-dtype"])
def test_collectives_reject_mismatched_values_naming_replica_and_path(strategy, step, message):
    with pytest.raises(CollectiveMismatchError, match=message) as excinfo:
        strategy.run(step)
    assert isinstance(excinfo.value, ValueError)
    assert_usable(strategy)


def test_all_gather_needs_values_of_rank_one_or_more(strategy):
    with pytest.raises(ValueError, match=r"all_gather needs values of rank >= 1 .* at path \['loss'\]"):
        strategy.run(lambda: distrib.get_replica_context().all_gather({"loss": np.float32(1)}, axis=0))


# -- different numbers of merge_call calls ------------------------------------------------------------------------


def test_an_extra_merge_call_on_one_replica_is_an_error_not_a_hang(strategy):
    def step():
        ctx = distrib.get_replica_context()
        for _ in range(2 if replica_id() == 1 else 1):
            ctx.merge_call(lambda s: None)

    with pytest.raises(MergeCallMismatchError, match=r"^Replicas made different numbers of merge_call calls") as e:
        strategy.run(step)
    assert isinstance(e.value, RuntimeError)
    assert "replica 0: 1, replica 1: 2+, replica 2: 1, replica 3: 1" in str(e.value)
    assert_usable(strategy)


def test_a_collective_under_a_replica_dependent_if_is_an_error_not_a_hang(strategy):
    def step():
        if replica_id() != 3:
            distrib.get_replica_context().all_reduce("SUM", np.float32(1))

    with pytest.raises(RuntimeError, match=r"^Replicas made different numbers of merge_call calls.*replica 3: 0"):
        strategy.run(step)
    assert_usable(strategy)


def test_replicas_reaching_different_collectives_is_an_error(strategy):
    def step():
        ctx = distrib.get_replica_context()
        if replica_id() == 3:
            return ctx.all_gather(np.zeros(1), axis=0)
        return ctx.all_reduce("SUM", np.zeros(1))

    with pytest.raises(MergeCallMismatchError, match=r"^Replicas reached different collectives.*replica 3: all_gather"):
        strategy.run(step)
    assert_usable(strategy)


# -- a replica that never joins a collective ------------------------------------------------------------------------


def sleepy_step(missing, collective="all_reduce", options=None):
    """Replicas in `missing` sleep SLEEP seconds before the collective; the others wait for them there."""

    def step():
        ctx = distrib.get_replica_context()
        if replica_id() in missing:
            time.sleep(SLEEP)
        if collective == "all_reduce":
            return ctx.all_reduce("SUM", np.float32(1), options=options)
        if collective == "all_gather":
            return ctx.all_gather(np.ones(1, np.float32), axis=0, options=options)
        return ctx.merge_call(lambda s: None)

    return step


def test_a_strategy_timeout_names_the_missing_replicas_and_recovers():
    before = replica_threads()
    strategy = distrib.MirroredStrategy(DEVICES, communication_options=CommunicationOptions(timeout_seconds=0.3))
    with pytest.raises(DeadlineExceededError, match=r"^all_reduce timed out after 0\.3 s waiting for replicas "
                                                    r"\[1, 3\] \(replicas \[0, 2\] arrived\)") as excinfo:
        strategy.run(sleepy_step({1, 3}))
    assert excinfo.value.missing_replicas == (1, 3)
    assert excinfo.value.operation == "all_reduce"
    assert isinstance(excinfo.value, TimeoutError) and isinstance(excinfo.value, DistribError)
    assert_usable(strategy)  # while replicas 1 and 3 of the failed run still sleep
    threads = run_threads(strategy)
    assert len(threads) == len(DEVICES)
    assert wait_until(lambda: replica_threads() - before == threads), "a replica thread of the failed run lingers"
    assert_usable(strategy)


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather"])
def test_a_per_call_timeout_names_the_missing_replica(strategy, collective):
    options = CommunicationOptions(timeout_seconds=0.3)
    with pytest.raises(DeadlineExceededError, match=rf"^{collective} timed out after 0\.3 s waiting for replicas "
                                                    r"\[0\]") as excinfo:
        strategy.run(sleepy_step({0}, collective, options))
    assert excinfo.value.missing_replicas == (0,)
    assert_usable(strategy)


def test_merge_call_uses_the_strategy_timeout():
    strategy = distrib.MirroredStrategy(DEVICES, communication_options=CommunicationOptions(timeout_seconds=0.3))
    with pytest.raises(DeadlineExceededError, match=r"^merge_call timed out after 0\.3 s") as excinfo:
        strategy.run(sleepy_step({2}, "merge_call"))
    assert excinfo.value.missing_replicas == (2,)
    assert_usable(strategy)


def test_the_default_timeout_comes_from_the_environment_when_the_strategy_is_created(monkeypatch):
    before = replica_threads()
    monkeypatch.setenv("DISTRIB_COLLECTIVE_TIMEOUT", "0.3")
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    monkeypatch.setenv("DISTRIB_COLLECTIVE_TIMEOUT", "600")  # read once, at creation
    with pytest.raises(DeadlineExceededError, match=r"^all_reduce timed out after 0\.3 s waiting for replicas "
                                                    r"\[1\]") as excinfo:
        strategy.run(sleepy_step({1}))
    assert excinfo.value.missing_replicas == (1,)
    out = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(1)))
    assert [float(x) for x in strategy.experimental_local_results(out)] == [2.0, 2.0]
    threads = run_threads(strategy)
    assert wait_until(lambda: replica_threads() - before == threads), "a replica thread of the failed run lingers"


@pytest.mark.parametrize("raw, message", [("soon", "must be a number of seconds"), ("0", "must be positive"),
                                          ("-5", "must be positive")])
def test_a_bad_default_timeout_in_the_environment_is_a_value_error(monkeypatch, raw, message):
    monkeypatch.setenv("DISTRIB_COLLECTIVE_TIMEOUT", raw)
    with pytest.raises(ValueError, match=f"DISTRIB_COLLECTIVE_TIMEOUT {message}"):
        distrib.MirroredStrategy(["CPU:0", "CPU:1"])


# -- APIs called in the wrong context ------------------------------------------------------------------------------

CROSS_REPLICA_ONLY = {
    "reduce": lambda s, v: s.reduce("SUM", v, axis=None),
    "gather": lambda s, v: s.gather(v, axis=0),
    "reduce_to": lambda s, v: s.extended.reduce_to("SUM", v, destinations="CPU:0"),
    "batch_reduce_to": lambda s, v: s.extended.batch_reduce_to("SUM", [(v, "CPU:0")]),
    "broadcast_to": lambda s, v: s.extended.broadcast_to(v, destinations="CPU:0"),
    "values_from_function": lambda s, v: s.experimental_distribute_values_from_function(lambda ctx: v),
}


@pytest.mark.parametrize("api", CROSS_REPLICA_ONLY)
def test_cross_replica_apis_raise_in_a_replica_context(strategy, api):
    call = CROSS_REPLICA_ONLY[api]
    with pytest.raises(ContextError, match=r"cross-replica context.*\(raised in replica \d of 4\)") as excinfo:
        strategy.run(lambda: call(strategy, np.ones(1, np.float32)))
    assert isinstance(excinfo.value, RuntimeError)


def test_gather_in_a_replica_context_points_to_all_gather(strategy):
    with pytest.raises(RuntimeError, match=r"get_replica_context\(\)\.all_gather\(value, axis\)"):
        strategy.run(lambda: strategy.gather(np.ones(1), axis=0))


REPLICA_ONLY = {
    "all_reduce": lambda ctx: ctx.all_reduce("SUM", np.float32(1)),
    "all_gather": lambda ctx: ctx.all_gather(np.ones(1), axis=0),
    "merge_call": lambda ctx: ctx.merge_call(lambda s: None),
}


@pytest.fixture(scope="module")
def captured_contexts():
    strategy = distrib.MirroredStrategy(DEVICES)
    return strategy, strategy.experimental_local_results(strategy.run(distrib.get_replica_context))


@pytest.mark.parametrize("api", REPLICA_ONLY)
def test_replica_context_apis_raise_outside_their_replica_function(captured_contexts, api):
    strategy, contexts = captured_contexts
    call = REPLICA_ONLY[api]
    message = rf"^ReplicaContext\.{api} must be called inside the function passed to Strategy\.run"
    with pytest.raises(ContextError, match=message):
        call(contexts[0])  # after run returned
    with strategy.scope(), pytest.raises(RuntimeError, match=message):
        call(contexts[0])  # in the cross-replica context
    with pytest.raises(RuntimeError, match=message):
        strategy.run(lambda: call(contexts[(replica_id() + 1) % 4]))  # on another replica


def test_run_inside_a_replica_function_raises(strategy):
    with pytest.raises(ContextError, match="Strategy.run cannot be called inside a replica function"):
        strategy.run(lambda: strategy.run(lambda: None))


# -- wrong values and kinds ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["MAX", "prod"])
def test_unsupported_reduce_ops_are_value_errors(strategy, op):
    value = strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(1))
    match = f"Only SUM and MEAN are supported reduce ops. Received: '{op}'"
    with pytest.raises(ValueError, match=match):
        strategy.reduce(op, value, axis=None)
    with pytest.raises(ValueError, match=match):
        strategy.extended.reduce_to(op, value, destinations=value)
    with pytest.raises(ValueError, match=match):
        strategy.extended.batch_reduce_to(op, [(value, value)])
    with pytest.raises(ValueError, match=match + r".*\(raised in replica \d of 4\)"):
        strategy.run(lambda: distrib.get_replica_context().all_reduce(op, np.float32(1)))


def test_negative_bytes_per_pack_is_a_value_error():
    with pytest.raises(ValueError, match="bytes_per_pack must be non-negative. Received: -1"):
        CommunicationOptions(bytes_per_pack=-1)


@pytest.mark.parametrize("devices", [["TPU:0"], ["CPU:x"], ["CPU:0", "TPU:1"], ["XLA_GPU:0"], [""]])
def test_unknown_devices_are_value_errors(devices):
    with pytest.raises(ValueError, match="Unknown device"):
        distrib.MirroredStrategy(devices)


def test_gpu_devices_without_a_usable_gpu_are_value_errors():
    from distrib.backends import cuda_problem

    if cuda_problem() is None:
        pytest.skip("this machine can run GPU devices")
    with pytest.raises(ValueError, match=r"^Unknown devices \['GPU:0'\]: GPU devices need the CUDA backend"):
        distrib.MirroredStrategy(["GPU:0"])


@pytest.mark.parametrize("devices", [["CPU:0", "GPU:0"], ["/gpu:1", "/cpu:0"]])
def test_mixing_cpu_and_gpu_devices_is_a_value_error(devices):
    with pytest.raises(ValueError, match="A MirroredStrategy runs on one kind of device"):
        distrib.MirroredStrategy(devices)


@pytest.mark.parametrize("devices", [["CPU:0", "CPU:0"], ["cpu:1", "/device:CPU:1"], ["CPU:0", "CPU:1", "/cpu:0"]])
def test_duplicate_cpu_devices_are_value_errors(devices):
    with pytest.raises(ValueError, match="No duplicates allowed in `devices`"):
        distrib.MirroredStrategy(devices)


@pytest.mark.parametrize("devices, error, message", [
    ("CPU:0", TypeError, "devices must be a list of device names"),
    ([0, 1], TypeError, "A device must be a string"),
    ([], ValueError, "devices must name at least one device"),
])
def test_devices_must_be_a_non_empty_list_of_names(devices, error, message):
    with pytest.raises(error, match=message):
        distrib.MirroredStrategy(devices)


@pytest.mark.parametrize("fn", [None, 3, "step", [print]])
def test_run_needs_a_callable(strategy, fn):
    with pytest.raises(TypeError, match="run\\(\\) needs a callable fn"):
        strategy.run(fn)


@pytest.mark.parametrize("kwargs, message", [
    ({"args": 3}, "args must be a tuple or list"),
    ({"args": "ab"}, "args must be a tuple or list"),
    ({"kwargs": [("x", 1)]}, "kwargs must be a dict"),
    ({"options": {"experimental_enable_dynamic_batch_size": True}}, "options must be a distrib.RunOptions"),
])
def test_run_checks_its_other_arguments(strategy, kwargs, message):
    with pytest.raises(TypeError, match=message):
        strategy.run(lambda *a, **k: None, **kwargs)


@pytest.mark.parametrize("value, path", [(np.bool_(True), "<root>"), (True, "<root>"),
                                         ({"loss": 1.0, "flags": np.array([True, False])}, r"\['flags'\]")])
def test_all_reduce_of_bools_is_a_type_error(strategy, value, path):
    with pytest.raises(TypeError, match=rf"^all_reduce needs numeric values\. Received: dtype bool at path {path}"):
        strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", value))
    assert_usable(strategy)


def test_reducing_bools_cross_replica_is_a_type_error(strategy):
    flags = strategy.experimental_distribute_values_from_function(lambda ctx: np.array([True]))
    with pytest.raises(TypeError, match="Reductions need numeric values"):
        strategy.reduce("SUM", flags, axis=None)
