"""One local replica: `run` calls the function on the calling thread, with the same contexts, errors and limits."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import distrib
from distrib import CommunicationOptions, RunOptions
from distrib.errors import ContextError, DeadlineExceededError
from support import run_joined_by_replica

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def one():
    with distrib.MirroredStrategy(["CPU:0"]) as strategy:
        yield strategy


def replica_threads():
    return {t for t in threading.enumerate() if t.name.startswith("distrib-replica-")}


def test_the_function_runs_on_the_calling_thread_and_starts_no_thread(one):
    before = replica_threads()
    seen = one.run(lambda: (threading.get_ident(), distrib.get_replica_context().replica_id_in_sync_group,
                            distrib.in_cross_replica_context(), distrib.get_strategy() is one))
    assert seen == (threading.get_ident(), 0, False, True)
    assert not replica_threads() - before  # none started (an earlier test's retired threads may end meanwhile)
    assert distrib.get_strategy() is not one and distrib.get_replica_context().num_replicas_in_sync == 1


def test_all_reduce_and_merge_call_run_cross_replica_on_the_calling_thread(one):
    merges = []

    def merge_fn(strategy, value):
        merges.append((strategy, threading.get_ident(), distrib.in_cross_replica_context(), value))
        return value * 2

    def step(x):
        ctx = distrib.get_replica_context()
        total = ctx.all_reduce("SUM", x)
        doubled = ctx.merge_call(merge_fn, args=(np.float32(3),))
        return total, doubled, distrib.in_cross_replica_context()

    x = np.arange(4, dtype=np.float32)
    total, doubled, cross = one.run(step, args=(x,))
    np.testing.assert_array_equal(total, x)
    assert not total.flags.writeable  # a collective's result is read-only, as with several replicas
    assert doubled == 6 and cross is False
    assert merges == [(one, threading.get_ident(), True, 3)]


def test_a_replica_error_is_named_and_a_merge_error_is_not(one):
    def fails():
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match=r"^bad batch \(raised in replica 0 of 1\)$"):
        one.run(fails)

    def merge_fails(_):
        raise ValueError("bad merge")

    with pytest.raises(ValueError, match=r"^bad merge$"):
        one.run(lambda: distrib.get_replica_context().merge_call(merge_fails))
    nccl = CommunicationOptions(implementation="NCCL")  # the emulator refuses it as the collective runs
    for value in (np.ones(2, np.float32), [np.ones(2, np.float32)]):  # one value's shortcut, and the general route
        with pytest.raises(distrib.errors.BackendUnavailableError, match=r"on a machine with NVIDIA GPUs\)\.$"):
            one.run(lambda: distrib.get_replica_context().all_reduce("SUM", value, options=nccl))
    assert distrib.get_strategy() is not one  # the contexts were unwound
    assert one.run(lambda: 5) == 5  # and the strategy is usable


def test_a_run_deadline_still_stops_a_replica_that_does_not_return(one):
    gate = threading.Event()
    with pytest.raises(DeadlineExceededError, match="did not finish within RunOptions"):
        one.run(gate.wait, options=RunOptions(timeout_seconds=0.2))
    gate.set()
    assert one.run(lambda: 7) == 7


def test_a_nested_run_is_refused_in_the_replica_and_runs_from_a_merge_fn(one):
    with pytest.raises(ContextError, match="nested run"):
        one.run(lambda: one.run(lambda: 1))
    out = one.run(lambda: distrib.get_replica_context().merge_call(lambda s: s.run(lambda: 41) + 1))
    assert out == 42


def test_a_collective_from_a_thread_the_replica_started_is_refused(one):
    errors = []

    def step():
        ctx = distrib.get_replica_context()

        def helper():
            try:
                ctx.all_reduce("SUM", np.float32(1))
            except ContextError as exc:
                errors.append(exc)

        thread = threading.Thread(target=helper)
        thread.start()
        thread.join()

    one.run(step)
    assert len(errors) == 1 and "must be called inside the function passed to Strategy.run" in str(errors[0])


def test_run_from_a_helper_thread_that_the_replica_joins_is_refused_at_once(one):
    start = time.monotonic()
    errors = run_joined_by_replica(one)
    assert time.monotonic() - start < 5
    assert len(errors) == 1 and "waits in Thread.join for 'helper'" in str(errors[0])


def test_collective_options_apply(one):
    out = one.run(lambda: distrib.get_replica_context().all_reduce(
        "MEAN", np.float32(4), CommunicationOptions(timeout_seconds=1)))
    assert float(out) == 4.0
