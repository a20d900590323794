"""Which strategy is current, and whether code runs per replica or cross-replica, in scope(), run() and merges."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import distrib


@pytest.fixture(scope="module")
def strategy():
    return distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])


def where_am_i():
    """The context functions' answers, as a dict."""
    ctx = distrib.get_replica_context()
    return {"strategy": distrib.get_strategy(), "has_strategy": distrib.has_strategy(),
            "cross_replica": distrib.in_cross_replica_context(), "replica_context": ctx,
            "cross_replica_strategy": distrib.get_cross_replica_context()}


def test_outside_any_scope_the_default_strategy_runs_one_replica():
    here = where_am_i()
    assert repr(here["strategy"]) == "<DefaultStrategy>"
    assert here["has_strategy"] is False
    assert here["cross_replica"] is False
    assert here["cross_replica_strategy"] is None
    ctx = here["replica_context"]
    assert (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync) == (0, 1)
    assert ctx.strategy is here["strategy"]


def test_scope_makes_the_strategy_current_in_the_cross_replica_context(strategy):
    with strategy.scope() as entered:
        here = where_am_i()
    assert entered is strategy
    assert here["strategy"] is strategy
    assert here["has_strategy"] and here["cross_replica"]
    assert here["replica_context"] is None
    assert here["cross_replica_strategy"] is strategy


def test_run_gives_each_replica_its_own_replica_context(strategy):
    out = strategy.run(where_am_i)
    for replica_id, here in enumerate(strategy.experimental_local_results(out)):
        ctx = here["replica_context"]
        assert ctx.replica_id_in_sync_group == replica_id
        assert ctx.num_replicas_in_sync == 4
        assert ctx.devices == (f"CPU:{replica_id}",)
        assert ctx.strategy is strategy
        assert here["strategy"] is strategy and here["has_strategy"]
        assert here["cross_replica"] is False
        assert here["cross_replica_strategy"] is None


def test_merge_fn_runs_once_cross_replica_on_the_thread_that_called_run(strategy):
    seen = []

    def merge_fn(merge_strategy):
        seen.append((merge_strategy, threading.current_thread(), where_am_i()))

    strategy.run(lambda: distrib.get_replica_context().merge_call(merge_fn))
    ((merge_strategy, thread, here),) = seen
    assert merge_strategy is strategy
    assert thread is threading.current_thread()
    assert here["cross_replica"] and here["replica_context"] is None
    assert here["cross_replica_strategy"] is strategy and here["strategy"] is strategy


def test_the_calling_thread_returns_to_its_context_after_run(strategy):
    strategy.run(lambda: None)
    assert distrib.has_strategy() is False
    with strategy.scope():
        strategy.run(lambda: None)
        assert distrib.in_cross_replica_context() and distrib.get_strategy() is strategy


def test_replica_threads_start_each_run_in_a_fresh_context(strategy):
    strategy.run(lambda: None)
    with strategy.scope():
        strategy.run(lambda: None)
    out = strategy.run(lambda: distrib.get_replica_context().replica_id_in_sync_group)
    assert strategy.experimental_local_results(out) == (0, 1, 2, 3)


def test_scope_is_left_even_when_its_block_raises(strategy):
    with pytest.raises(KeyError):
        with strategy.scope():
            raise KeyError("inside scope")
    assert distrib.has_strategy() is False


def test_context_is_restored_after_a_failed_run(strategy):
    def step():
        raise ValueError("replica failure")

    with strategy.scope():
        with pytest.raises(ValueError):
            strategy.run(step)
        assert distrib.get_strategy() is strategy and distrib.in_cross_replica_context()
    assert distrib.has_strategy() is False


def test_the_same_strategy_can_be_entered_again():
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        with strategy.scope():
            assert distrib.get_strategy() is strategy
        assert distrib.get_strategy() is strategy


def test_another_strategy_cannot_be_entered_inside_a_scope(strategy):
    other = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        with pytest.raises(RuntimeError, match="Mixing different distrib strategies is not allowed"):
            with other.scope():
                pass
        assert distrib.get_strategy() is strategy


def test_another_strategys_cross_replica_api_cannot_be_used_inside_a_scope(strategy):
    other = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    value = other.experimental_distribute_values_from_function(lambda ctx: np.float32(1))
    with strategy.scope():
        with pytest.raises(RuntimeError, match="Mixing different distrib strategies is not allowed"):
            other.reduce("SUM", value, axis=None)


def test_contexts_are_per_thread(strategy):
    seen = {}
    with strategy.scope():
        thread = threading.Thread(target=lambda: seen.update(where_am_i()))
        thread.start()
        thread.join()
    assert repr(seen["strategy"]) == "<DefaultStrategy>"
    assert seen["replica_context"].num_replicas_in_sync == 1


def test_the_default_strategys_scope_changes_nothing():
    default = distrib.get_strategy()
    with default.scope() as entered:
        assert entered is default
        assert distrib.get_strategy() is default
        assert distrib.has_strategy() is False
        assert distrib.get_replica_context() is not None


def test_a_default_merge_call_runs_cross_replica_on_the_default_strategy():
    default = distrib.get_strategy()

    def merge_fn(merge_strategy, x):
        return merge_strategy is default, distrib.in_cross_replica_context(), distrib.get_replica_context(), x

    assert distrib.get_replica_context().merge_call(merge_fn, args=(5,)) == (True, True, None, 5)
    assert distrib.in_cross_replica_context() is False


def test_one_cross_replica_check_names_the_api_and_the_hint():
    from distrib.context import require_cross_replica
    from distrib.errors import ContextError

    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    require_cross_replica("my_api", strategy)  # outside any scope: fine
    with strategy.scope():
        require_cross_replica("my_api", strategy)

    def in_replica():
        with pytest.raises(ContextError, match=r"^my_api must be called in a cross-replica context .*; use x\.$"):
            require_cross_replica("my_api", strategy, hint="use x")

    strategy.run(in_replica)
    other = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    with other.scope(), pytest.raises(RuntimeError, match="^Mixing different distrib strategies is not allowed: my_api"):
        require_cross_replica("my_api", strategy)


def test_the_strategy_scope_entered_inside_its_own_replica_function_is_refused_as_tensorflow_refuses_it():
    # it was accepted silently and did nothing; TensorFlow raises RuntimeError (a cross-replica method)
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])

    def step():
        with strategy.scope():
            return 1

    with pytest.raises(distrib.errors.ContextError, match=r"^strategy.scope\(\) cannot be entered inside a replica function"):
        strategy.run(step)
    assert issubclass(distrib.errors.ContextError, RuntimeError)

    def merged():  # the cross-replica context of a merge_call may enter it
        def merge(s):
            with s.scope():
                return distrib.get_strategy() is s
        return distrib.get_replica_context().merge_call(merge)

    assert strategy.run(merged) is True
