"""ClusterCoordinator on a local Ray cluster: asynchronous workers, results, errors, and real process deaths."""

from __future__ import annotations

import collections
import gc
import os
import signal
import threading
import time

import numpy as np
import pytest

import distrib
from distrib.cluster_resolver import RayClusterResolver
from distrib.coordinator import ClusterCoordinator
from distrib.errors import OutOfRangeError, ParameterServerError, WorkerError
from distrib.parameter_server import dispatch
from distrib.experimental.partitioners import FixedShardsPartitioner

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def strategy(ray_cluster):
    """2 workers, 2 parameter servers, variables split in 2."""
    strategy = distrib.ParameterServerStrategy(RayClusterResolver(num_workers=2, num_ps=2),
                                               variable_partitioner=FixedShardsPartitioner(2))
    yield strategy
    strategy._cluster.shutdown()


@pytest.fixture(scope="module")
def coordinator(strategy):
    return ClusterCoordinator(strategy)


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    """Polls `condition` (a closure or the test waits for another worker); fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what}")
        time.sleep(0.01)


def test_schedule_returns_remote_values_and_join_waits_for_all(strategy, coordinator):
    with strategy.scope():
        total = distrib.Variable(np.float64(0), name="total")

    def add(k):
        total.assign_add(k)
        return k * k

    results = [coordinator.schedule(add, args=(k,)) for k in range(20)]
    coordinator.join()
    assert coordinator.done()
    assert float(total.numpy()) == sum(range(20))
    assert coordinator.fetch(results) == [k * k for k in range(20)]
    assert results[3].get() == 9 and repr(results[3]) == "<RemoteValue closure=3 done>"


def test_a_worker_takes_the_next_closure_without_waiting_for_the_others(strategy, coordinator):
    with strategy.scope():
        quick_done = distrib.Variable(np.int64(0), name="quick_done")

    def slow():  # holds its worker until five closures scheduled after it have finished on the other
        wait_until(lambda: int(quick_done.read_value()) == 5, "the quick closures")
        return "slow"

    def quick():
        quick_done.assign_add(1)
        return os.getpid()

    slow_result = coordinator.schedule(slow)
    quick_results = [coordinator.schedule(quick) for _ in range(5)]
    coordinator.join()
    assert slow_result.fetch() == "slow" and len({r.fetch() for r in quick_results}) == 1


def test_an_error_surfaces_at_join_as_its_own_type_while_the_others_finish(strategy, coordinator):
    with strategy.scope():
        finished = distrib.Variable(np.int64(0), name="finished")

    def step(k):
        if k == 3:
            raise KeyError(f"no feature {k}")
        finished.assign_add(1)

    results = [coordinator.schedule(step, args=(k,)) for k in range(8)]
    with pytest.raises(KeyError, match="no feature 3"):
        coordinator.join()
    assert int(finished.numpy()) == 7
    with pytest.raises(KeyError, match="no feature 3"):
        results[3].fetch()
    coordinator.join()  # the error was raised once; the coordinator goes on
    assert coordinator.schedule(lambda: "after").fetch() == "after"


class ProgramError(Exception):
    """An error class of the program itself: it travels to the workers by value, as one defined in `__main__`."""


def test_an_error_class_of_the_program_comes_back_as_itself(coordinator):
    # before: a class that plain pickle could not find by name on the worker came back as a RuntimeError
    def step():
        raise ProgramError("the program's own")

    result = coordinator.schedule(step)
    with pytest.raises(ProgramError, match="the program's own"):
        coordinator.join()
    with pytest.raises(ProgramError):
        result.fetch()


def test_per_worker_datasets_give_each_worker_its_own_iterator(coordinator):
    dataset = coordinator.create_per_worker_dataset(lambda: [(os.getpid(), i) for i in range(100)])
    iterator = iter(dataset)
    results = [coordinator.schedule(lambda it: next(it), args=(iterator,)) for _ in range(12)]
    coordinator.join()
    by_worker: dict[int, list[int]] = {}
    for pid, i in coordinator.fetch(results):
        by_worker.setdefault(pid, []).append(i)
    assert all(sorted(items) == list(range(len(items))) for items in by_worker.values())  # each from its own start


def test_an_exhausted_iterator_raises_out_of_range_not_stop_iteration(coordinator):
    # before: a bare StopIteration came back, which ends a map() over fetch silently
    iterator = iter(coordinator.create_per_worker_dataset(lambda: range(5)))  # 5 elements on each of 2 workers

    def take(it):
        return next(it)

    results = [coordinator.schedule(take, args=(iterator,)) for _ in range(12)]
    with pytest.raises(OutOfRangeError, match="^Scheduled function 'take' ran out of input"):
        coordinator.join()
    with pytest.raises(OutOfRangeError):
        list(map(lambda r: r.fetch(), results))
    # closures go to whichever worker is free: one that runs out first refuses the rest, so how many succeed varies;
    # none reads an element twice, and every failure is the end of input
    values = [r.fetch() for r in results if r._error is None]
    assert collections.Counter(values) <= collections.Counter(list(range(5)) * 2) and len(values) >= 5, values
    assert all(isinstance(r._error, OutOfRangeError) for r in results if r._error is not None)


def test_remote_values_in_arguments_become_their_results(coordinator):
    # before: a RemoteValue could not be pickled, and the closure failed with Ray's serialization dump
    ready = coordinator.schedule(lambda: 41)
    ready.fetch()
    slow = coordinator.schedule(lambda: (time.sleep(0.2), {"x": 1})[1])
    failed = coordinator.schedule(lambda: 1 / 0)
    results = [coordinator.schedule(lambda a, b=None: (a, b), args=(ready,), kwargs={"b": [slow]}),
               coordinator.schedule(lambda a: a, args=(failed,))]
    with pytest.raises(ZeroDivisionError):
        coordinator.join()
    assert results[0].fetch() == (41, [{"x": 1}])
    with pytest.raises(ZeroDivisionError):  # an input's error is the closure's own
        results[1].fetch()


outside = distrib.Variable(np.zeros(2), name="outside")  # created outside any strategy's scope


def test_what_cannot_travel_to_a_worker_is_named_at_schedule(coordinator):
    # before: schedule accepted them, and join raised Ray's 40-line serialization dump naming run_in_scope
    def step():
        outside.assign_add(np.ones(2))

    with pytest.raises(TypeError, match=r"^Scheduled function 'step' uses a variable created outside the strategy's "
                                        r"scope.*create it under strategy.scope\(\). Received: <Variable 'outside'.* "
                                        r"as 'outside' \(used by step\).$"):
        coordinator.schedule(step)
    with pytest.raises(TypeError, match=r"^Scheduled function 'hold' cannot be sent to a worker: args\[1\] cannot be "
                                        r"pickled. Received: lock \(cannot pickle '_thread.lock' object\).$"):
        def hold(*_):
            pass
        coordinator.schedule(hold, args=(1, threading.Lock()))
    coordinator.join()  # nothing was queued


class CodedError(Exception):
    """An error whose __init__ takes more than its message: pickle's default rebuild, CodedError(message), fails."""

    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def test_errors_that_pickle_cannot_rebuild_and_interrupts_come_back_as_themselves(coordinator):
    # before: a RuntimeError("CodedError: bad") and Ray's TaskCancelledError
    def coded():
        raise CodedError("bad", 2)

    def interrupted():
        raise KeyboardInterrupt("stop")

    coded_result, interrupted_result = coordinator.schedule(coded), coordinator.schedule(interrupted)
    with pytest.raises(CodedError, match="^bad$") as raised:
        coded_result.fetch()
    assert raised.value.code == 2 and raised.value.args == ("bad",)
    with pytest.raises(KeyboardInterrupt, match="^stop$"):
        interrupted_result.fetch()
    with pytest.raises((CodedError, KeyboardInterrupt)):
        coordinator.join()


def test_training_with_an_optimizer_in_scheduled_steps(strategy, coordinator):
    with strategy.scope():
        w = distrib.Variable(np.zeros(4, np.float32), name="w")
        optimizer = distrib.optimizers.Adam(learning_rate=0.1)
        optimizer.build([w])
    target = np.arange(4, dtype=np.float32)

    def step():
        def replica_fn():
            grad = 2 * (np.asarray(w.read_value()) - target)  # d/dw of |w - target|^2
            optimizer.apply_gradients([(grad, w)])
        strategy.run(replica_fn)

    for _ in range(150):
        coordinator.schedule(step)
    coordinator.join()
    assert int(optimizer.iterations.numpy()) == 150
    np.testing.assert_allclose(w.numpy(), target, atol=0.15)



def test_a_closure_runs_in_its_strategys_cross_replica_context(strategy, coordinator):
    """As TensorFlow traces a scheduled function under the strategy's scope: an optimizer applied outside
    `strategy.run` updates the servers' variables, and the closure sees the strategy, cross-replica."""
    with strategy.scope():
        w = distrib.Variable(np.zeros(3, np.float32), name="w")
        optimizer = distrib.optimizers.SGD(learning_rate=0.5)
        optimizer.build([w])

    def step():
        optimizer.apply_gradients([(np.ones(3, np.float32), w)])
        return (distrib.get_strategy() is strategy, distrib.get_replica_context() is None,
                distrib.in_cross_replica_context())

    results = [coordinator.schedule(step) for _ in range(4)]
    coordinator.join()
    assert [r.fetch() for r in results] == [(True, True, True)] * 4
    np.testing.assert_array_equal(w.numpy(), np.full(3, -2.0, np.float32))
    with pytest.raises(ValueError, match="A parameter server's variable is updated under its "
                                         "ParameterServerStrategy. Received: ShardedVariable 'w'"):
        optimizer.apply_gradients([(np.ones(3, np.float32), w)])  # on the coordinator, outside the scope

def test_a_killed_worker_loses_no_closure_and_applies_none_twice(strategy, coordinator):
    n = 8
    with strategy.scope():
        applied = distrib.Variable(np.zeros(n, np.int64), name="applied")  # sharded: rows on both servers
        pids = distrib.Variable(np.zeros(n, np.int64), name="pids")
        gate = distrib.Variable(np.int64(0), name="gate")

    def step(k):
        applied.scatter_add([k], [1])                 # the write that must happen exactly once
        pids.scatter_update([k], [os.getpid()])
        wait_until(lambda: int(gate.read_value()) == 1, "the gate")
        return k, os.getpid()

    results = [coordinator.schedule(step, args=(k,)) for k in range(n)]
    wait_until(lambda: pids.numpy()[:2].all(), "the first two closures to start")
    victim = int(pids.numpy()[0])
    os.kill(victim, signal.SIGKILL)                   # closure 0's worker dies mid-closure, after its writes
    gate.assign(1)
    coordinator.join()
    finished = [r.fetch() for r in results]
    assert [k for k, _ in finished] == list(range(n))  # no closure lost
    assert finished[0][1] != victim                    # closure 0 ran again, in another process ...
    assert applied.numpy().tolist() == [1] * n         # ... and its write was applied once
    assert int(pids.numpy()[0]) == victim              # the first run's writes stand; the re-run's were dropped
    assert coordinator.schedule(os.getpid).fetch() > 0  # the worker was replaced: closures still run


def test_a_closure_whose_worker_dies_every_time_fails_with_a_typed_error(coordinator, monkeypatch):
    monkeypatch.setattr(dispatch, "MAX_ATTEMPTS", 2)

    def crash():
        os.kill(os.getpid(), signal.SIGKILL)  # as a segfault or the OOM killer would

    result = coordinator.schedule(crash)
    with pytest.raises(WorkerError, match="^A scheduled closure's worker died each of the 2 times it ran it.*"
                                          r"Received: closure \d+, 'crash'"):  # before: functools.partial(...)
        coordinator.join()
    with pytest.raises(WorkerError):
        result.fetch()
    assert coordinator.schedule(lambda: 7).fetch() == 7


def test_one_coordinator_per_strategy(strategy, coordinator):
    assert ClusterCoordinator(strategy) is coordinator
    with pytest.raises(TypeError, match="^ClusterCoordinator needs a distrib.ParameterServerStrategy"):
        ClusterCoordinator(distrib.get_strategy())


def test_a_dead_parameter_server_raises_a_typed_error_and_training_resumes_from_a_checkpoint(ray_cluster, tmp_path):
    strategy = distrib.ParameterServerStrategy(RayClusterResolver(num_workers=1, num_ps=2))
    coordinator = ClusterCoordinator(strategy)
    with strategy.scope():
        a = distrib.Variable(np.ones(3, np.float32), name="a")
        b = distrib.Variable(np.ones(3, np.float32), name="b")
    path = distrib.Checkpoint(a=a, b=b).save(tmp_path / "ps.ckpt")
    a.assign(np.full(3, 5, np.float32))
    server = strategy._cluster.servers[int(a.device[-1])]
    os.kill(ray_cluster.get(server.pid.remote()), signal.SIGKILL)
    coordinator.schedule(lambda: a.assign_add(np.ones(3, np.float32)))
    with pytest.raises(ParameterServerError, match=r"^Parameter server \d \(/job:ps/task:\d\) died"):
        coordinator.join()
    with pytest.raises(ParameterServerError):
        a.numpy()
    strategy._cluster.shutdown()

    resumed = distrib.ParameterServerStrategy(RayClusterResolver(num_workers=1, num_ps=2))
    with resumed.scope():
        a = distrib.Variable(np.zeros(3, np.float32), name="a")
        b = distrib.Variable(np.zeros(3, np.float32), name="b")
    distrib.Checkpoint(a=a, b=b).restore(path)
    assert a.numpy().tolist() == [1, 1, 1] and b.numpy().tolist() == [1, 1, 1]
    resumed._cluster.shutdown()


def test_a_dropped_strategy_ends_its_threads_and_actors(ray_cluster):
    strategy = distrib.ParameterServerStrategy(RayClusterResolver(num_workers=1, num_ps=1))
    with strategy.scope():
        v = distrib.Variable(np.zeros(1), name="v")
    before = set(threading.enumerate())
    coordinator = ClusterCoordinator(strategy)
    worker_pid = coordinator.schedule(os.getpid).fetch()
    threads = {t for t in set(threading.enumerate()) - before if t.name.startswith("distrib-ps-worker")}
    del strategy, coordinator, v
    gc.collect()

    def gone(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_until(lambda: gone(worker_pid) and not any(t.is_alive() for t in threads), "the worker to end")
    assert threads
