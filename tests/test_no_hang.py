"""No hang anywhere: forks, replicas stuck outside collectives, runs started from helper threads, NaN timeouts;
and nothing kept alive: failed runs, dropped and closed strategies."""

from __future__ import annotations

import concurrent.futures
import gc
import math
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest

import distrib
from distrib import CommunicationOptions, RunOptions
from distrib.errors import ContextError, DeadlineExceededError
from distrib.replica_threads import ReplicaThread

pytestmark = pytest.mark.timeout(60)

DEVICES = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]


class StepFailed(Exception):
    """A user's exception, raised inside a replica function."""


def replica_threads() -> set[threading.Thread]:
    """The live replica threads; compared as sets, so a thread of an earlier test ending late changes nothing."""
    return {t for t in threading.enumerate() if t.name.startswith("distrib-replica-") and t.is_alive()}


def wait_until(condition, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def sum_of_ones(strategy) -> list[float]:
    out = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(1)))
    return [float(x) for x in strategy.experimental_local_results(out)]


@pytest.fixture
def strategy():
    with distrib.MirroredStrategy(DEVICES) as strategy:
        yield strategy


# -- no hang ----------------------------------------------------------------------------------------------------

FORK_PROGRAM = """
import os, sys, time
import numpy as np
import distrib

def sum_of_ones(strategy, options=None):
    out = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(1), options))
    return [float(x) for x in strategy.experimental_local_results(out)]

strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
assert sum_of_ones(strategy) == [4.0] * 4  # the parent's threads are running
pid = os.fork()
if pid == 0:  # the child: its copy of the strategy has no threads until it makes new ones
    status = 3
    try:
        status = 0 if sum_of_ones(strategy, distrib.CommunicationOptions(timeout_seconds=5)) == [4.0] * 4 else 1
    finally:
        os._exit(status)
deadline = time.monotonic() + 30
while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
    time.sleep(0.01)
if done[0] == 0:
    os.kill(pid, 9)
    sys.exit("the forked child's run hung")
assert sum_of_ones(strategy) == [4.0] * 4  # the parent is unaffected
sys.exit(os.waitstatus_to_exitcode(done[1]))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_runs_the_strategy_on_threads_of_its_own():
    # a fresh interpreter forks, not this one, whose other libraries' threads may not survive a fork
    finished = subprocess.run([sys.executable, "-c", FORK_PROGRAM], capture_output=True, text=True, timeout=60)
    assert finished.returncode == 0, finished.stderr


def test_a_run_timeout_names_the_stuck_replica_and_shows_where_it_is(strategy):
    gate = threading.Event()

    def step():
        if distrib.get_replica_context().replica_id_in_sync_group == 2:
            gate.wait()  # stuck outside any collective
        return 1

    with pytest.raises(DeadlineExceededError, match=r"Strategy.run did not finish within RunOptions") as excinfo:
        strategy.run(step, options=RunOptions(timeout_seconds=0.3))
    gate.set()
    assert excinfo.value.missing_replicas == (2,)
    assert "Replica 2 is at:" in str(excinfo.value) and "test_no_hang.py\", line" in str(excinfo.value)
    assert sum_of_ones(strategy) == [4.0] * 4


def test_a_collective_timeout_shows_where_the_missing_replica_is(strategy):
    gate = threading.Event()

    def step():
        ctx = distrib.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            gate.wait()
        return ctx.all_reduce("SUM", np.float32(1), CommunicationOptions(timeout_seconds=0.3))

    with pytest.raises(DeadlineExceededError, match="all_reduce timed out after 0.3 s") as excinfo:
        strategy.run(step)
    gate.set()
    assert excinfo.value.missing_replicas == (1,)
    assert "Replica 1 is at:" in str(excinfo.value) and "test_no_hang.py\", line" in str(excinfo.value)


def run_in_helper(strategy, errors):
    """What a replica function's helper thread does: run the strategy, keeping the error it raises."""
    try:
        strategy.run(lambda: None)  # the default 600 s wait: only a prompt refusal ends this within the test
    except ContextError as exc:
        errors.append(exc)


def test_run_from_a_helper_thread_that_the_replica_joins_is_refused_at_once(strategy):
    errors = []

    def step():
        if distrib.get_replica_context().replica_id_in_sync_group == 0:
            helper = threading.Thread(target=run_in_helper, args=(strategy, errors), name="helper")
            helper.start()
            helper.join()
        return 1

    strategy.run(step)
    assert len(errors) == 1 and str(errors[0]).startswith("Strategy.run cannot start on this thread: the "
                                                          "strategy's run in progress waits for it")
    assert "'distrib-replica-0' waits in Thread.join for 'helper'" in str(errors[0])
    assert sum_of_ones(strategy) == [4.0] * 4


def test_run_from_a_helper_thread_that_a_merge_fn_joins_is_refused_at_once(strategy):
    errors = []

    def merge_fn(_):
        helper = threading.Thread(target=run_in_helper, args=(strategy, errors), name="helper")
        helper.start()
        helper.join()

    strategy.run(lambda: distrib.get_replica_context().merge_call(merge_fn))
    assert len(errors) == 1 and "waits in Thread.join for 'helper'" in str(errors[0])
    assert sum_of_ones(strategy) == [4.0] * 4


def test_run_from_a_thread_pool_whose_result_the_replica_waits_for_is_refused_at_once(strategy):
    errors = []

    def step():
        if distrib.get_replica_context().replica_id_in_sync_group == 1:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pool.submit(run_in_helper, strategy, errors).result()
        return 1

    strategy.run(step)
    assert len(errors) == 1 and "'distrib-replica-1' waits in Future.result for" in str(errors[0])
    assert sum_of_ones(strategy) == [4.0] * 4


def test_a_helper_joined_with_a_timeout_runs_once_the_run_in_progress_ends(strategy):
    results, helpers = [], []

    def in_helper():
        results.append(sum_of_ones(strategy))

    def step():
        if distrib.get_replica_context().replica_id_in_sync_group == 0:
            helpers.append(threading.Thread(target=in_helper))
            helpers[0].start()
            helpers[0].join(timeout=0.2)  # gives up waiting: the helper's run waits its turn instead
        return 1

    strategy.run(step)
    helpers[0].join()
    assert results == [[4.0] * 4]


def test_runs_from_two_user_threads_take_turns(strategy):
    gate, results = threading.Event(), []

    def slow_step():
        if distrib.get_replica_context().replica_id_in_sync_group == 0:
            waiter = threading.Thread(target=gate.wait)  # a replica joining a thread unrelated to the other run
            waiter.start()
            waiter.join()
        return distrib.get_replica_context().all_reduce("SUM", np.float32(1))

    first = threading.Thread(target=lambda: results.append(strategy.experimental_local_results(
        strategy.run(slow_step))))
    second = threading.Thread(target=lambda: results.append(sum_of_ones(strategy)))
    first.start()
    assert wait_until(lambda: strategy.extended._running_thread == first.ident)
    second.start()
    time.sleep(0.2)  # the second run is waiting for the first one now
    gate.set()
    first.join(), second.join()
    assert [[float(x) for x in out] for out in results] == [[4.0] * 4] * 2


def test_a_wait_that_cannot_be_seen_ends_in_a_deadline_naming_the_run_in_progress(strategy):
    errors, started = [], threading.Event()

    def nested():
        started.set()
        try:
            strategy.run(lambda: None, options=RunOptions(timeout_seconds=0.3))
        except DeadlineExceededError as exc:
            errors.append(exc)

    def step():
        if distrib.get_replica_context().replica_id_in_sync_group == 0:
            threading.Thread(target=nested).start()
            started.wait()
            while not errors:  # a wait on user state, which no stack shows
                time.sleep(0.01)
        return 1

    strategy.run(step)
    assert str(errors[0]).startswith("Strategy.run waited 0.3 s for this strategy's run in progress")
    assert sum_of_ones(strategy) == [4.0] * 4


@pytest.mark.parametrize("make", [lambda t: CommunicationOptions(timeout_seconds=t),
                                  lambda t: RunOptions(timeout_seconds=t)])
def test_a_nan_timeout_is_a_value_error(make):
    with pytest.raises(ValueError, match="(RunOptions.)?timeout_seconds must be"):
        make(math.nan)


def test_a_nan_timeout_in_the_environment_is_a_value_error(monkeypatch):
    monkeypatch.setenv("DISTRIB_COLLECTIVE_TIMEOUT", "nan")
    with pytest.raises(ValueError, match="DISTRIB_COLLECTIVE_TIMEOUT must be positive"):
        distrib.MirroredStrategy(DEVICES)


def test_an_infinite_timeout_waits_forever_and_healthy_collectives_pass(monkeypatch):
    monkeypatch.setenv("DISTRIB_COLLECTIVE_TIMEOUT", "inf")
    with distrib.MirroredStrategy(DEVICES) as strategy:
        assert sum_of_ones(strategy) == [4.0] * 4
        out = strategy.run(lambda: 1, options=RunOptions(timeout_seconds=math.inf))
        assert out == 1


# -- nothing kept alive ---------------------------------------------------------------------------------------

class Payload:
    """Stands for a replica function's large locals (activations, batches)."""


def test_failed_runs_free_their_locals_without_a_garbage_collection(strategy):
    kept = []

    def step():
        payload = Payload()
        kept.append(weakref.ref(payload))
        raise StepFailed("boom")

    gc.collect()
    gc.disable()
    try:
        for _ in range(5):
            with pytest.raises(StepFailed):
                strategy.run(step)
        assert len(kept) >= 5 and [ref() for ref in kept] == [None] * len(kept)
    finally:
        gc.enable()


def test_a_dropped_strategy_ends_its_threads_without_a_garbage_collection():
    gc.collect()
    before = replica_threads()
    gc.disable()
    try:
        for _ in range(3):
            strategy = distrib.MirroredStrategy(DEVICES)
            assert sum_of_ones(strategy) == [4.0] * 4
            del strategy
        assert wait_until(lambda: replica_threads() <= before)
    finally:
        gc.enable()


def test_a_closed_strategy_ends_its_threads_and_refuses_to_run():
    before = replica_threads()
    with distrib.MirroredStrategy(DEVICES) as strategy:
        assert sum_of_ones(strategy) == [4.0] * 4
        assert len(replica_threads() - before) == 4
    assert wait_until(lambda: replica_threads() <= before)
    assert repr(strategy) == "<MirroredStrategy devices=('CPU:0', 'CPU:1', 'CPU:2', 'CPU:3') closed>"
    with pytest.raises(ContextError, match=r"<MirroredStrategy .* closed> is closed: create a new strategy"):
        strategy.run(lambda: None)
    strategy.close()  # twice is fine


INSIDE_OWN_RUN = (r"^Strategy.close cannot be called inside the strategy's own run \(in a replica function or a "
                  r"merge_fn\), which holds the strategy until it returns")


@pytest.mark.timeout(10)  # before it was refused, this close waited for its own run for good
@pytest.mark.parametrize("devices, execution, options", [
    (DEVICES, "threads", None),
    (DEVICES, "cooperative", None),
    (DEVICES[:1], "threads", RunOptions(timeout_seconds=30)),  # one replica with a deadline: on a thread too
], ids=["threads", "cooperative", "one replica with a deadline"])
def test_close_inside_a_replica_function_is_a_context_error_naming_the_replica(devices, execution, options):
    with distrib.MirroredStrategy(devices, replica_execution=execution) as strategy:
        last = len(devices) - 1

        def step():
            if distrib.get_replica_context().replica_id_in_sync_group == last:
                strategy.close()
            return distrib.get_replica_context().all_reduce("SUM", np.float32(1))

        with pytest.raises(ContextError, match=INSIDE_OWN_RUN) as raised:
            strategy.run(step, options=options)
        assert f"Received: a call from replica {last}'s function, on thread " in str(raised.value)
        assert sum_of_ones(strategy) == [float(len(devices))] * len(devices)  # not closed, still usable


@pytest.mark.timeout(10)
@pytest.mark.parametrize("execution", ["threads", "cooperative"])
def test_close_in_a_merge_fn_or_in_a_nested_runs_replica_is_a_context_error(execution):
    with distrib.MirroredStrategy(DEVICES, replica_execution=execution) as strategy:
        with pytest.raises(ContextError, match=INSIDE_OWN_RUN) as raised:
            strategy.run(lambda: distrib.get_replica_context().merge_call(lambda s: s.close()))
        assert "Received: a call from a merge_fn, on thread 'MainThread'" in str(raised.value)

        def nested_run(s):  # a run from a merge_fn has replica threads of its own
            s.run(lambda: s.close())

        with pytest.raises(ContextError, match=INSIDE_OWN_RUN):
            strategy.run(lambda: distrib.get_replica_context().merge_call(nested_run))
        assert sum_of_ones(strategy) == [4.0] * 4


def test_close_from_a_helper_thread_that_the_replica_joins_is_refused_at_once(strategy):
    errors = []

    def close_in_helper():
        try:
            strategy.close()  # would wait for the run, which waits for this thread
        except ContextError as exc:
            errors.append(exc)

    def step():
        if distrib.get_replica_context().replica_id_in_sync_group == 0:
            helper = threading.Thread(target=close_in_helper, name="helper")
            helper.start()
            helper.join()

    strategy.run(step)
    assert len(errors) == 1 and str(errors[0]).startswith("Strategy.close cannot return on this thread: the "
                                                          "strategy's run in progress waits for it")
    assert sum_of_ones(strategy) == [4.0] * 4


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in this process, even where the tests run with it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def interrupt_the_first_retire(monkeypatch) -> list:
    """Ctrl-C arrives while the first replica thread is being retired; returns the threads retired, in order."""
    retired, retire = [], ReplicaThread.retire

    def retire_then_interrupt(worker):
        retire(worker)
        retired.append(worker)
        if len(retired) == 1:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(ReplicaThread, "retire", retire_then_interrupt)
    return retired


def test_ctrl_c_while_a_strategy_closes_still_ends_every_thread(monkeypatch, sigint_raises):
    before = replica_threads()
    strategy = distrib.MirroredStrategy(DEVICES)
    assert sum_of_ones(strategy) == [4.0] * 4
    retired = interrupt_the_first_retire(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        strategy.close()
    assert len(retired) == 4
    assert wait_until(lambda: replica_threads() <= before)


def test_ctrl_c_as_a_strategy_is_dropped_reaches_the_program_and_still_ends_every_thread(sigint_raises):
    before = replica_threads()
    strategy = distrib.MirroredStrategy(DEVICES)
    assert sum_of_ones(strategy) == [4.0] * 4

    def interrupt_at_the_next_call(frame, event, arg):
        sys.settrace(None)
        signal.raise_signal(signal.SIGINT)

    def after_the_drop():
        pass

    with pytest.raises(KeyboardInterrupt):
        sys.settrace(interrupt_at_the_next_call)  # lands in the drop's finalizer, if that runs any Python here
        del strategy
        after_the_drop()
    assert wait_until(lambda: replica_threads() <= before)
