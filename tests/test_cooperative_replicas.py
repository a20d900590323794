"""replica_execution="cooperative": every replica a greenlet on the calling thread, switched at its collectives."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import distrib
from distrib.errors import ContextError, DeadlineExceededError, MergeCallMismatchError
from support import DEVICES, local, replica_id, run_joined_by_replica

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def strategy():
    return distrib.MirroredStrategy(DEVICES, replica_execution="cooperative")


def test_every_replica_runs_on_the_calling_thread(strategy):
    out = strategy.run(lambda: (threading.get_ident(), replica_id()))
    assert local(strategy, out) == tuple((threading.get_ident(), r) for r in range(4))


def test_replicas_run_in_turn_up_to_each_collective(strategy):
    order = []

    def step():
        ctx = distrib.get_replica_context()
        order.append(("before", ctx.replica_id_in_sync_group))
        total = ctx.all_reduce("SUM", np.float32(ctx.replica_id_in_sync_group + 1))
        order.append(("after", ctx.replica_id_in_sync_group))
        return total

    out = strategy.run(step)
    assert [float(x) for x in local(strategy, out)] == [10.0] * 4
    assert order == [("before", r) for r in range(4)] + [("after", r) for r in range(4)]


def test_merge_fn_runs_once_cross_replica_with_every_replicas_argument(strategy):
    calls = []

    def merge_fn(s, value):
        calls.append((distrib.in_cross_replica_context(), s is strategy))
        return s.reduce("SUM", value, axis=None)

    out = strategy.run(lambda: distrib.get_replica_context().merge_call(merge_fn, args=(np.float32(replica_id()),)))
    assert calls == [(True, True)]
    assert float(out) == 6.0  # one result for every replica


def test_a_large_all_reduce_matches_the_threads(strategy):
    threaded = distrib.MirroredStrategy(DEVICES)
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal(300_000).astype(np.float32) for _ in DEVICES]
    results = []
    for s in (strategy, threaded):
        value = s.experimental_distribute_values_from_function(lambda ctx: parts[ctx.replica_id_in_sync_group])
        out = s.run(lambda x: distrib.get_replica_context().all_reduce("MEAN", x), args=(value,))
        results.append(local(s, out))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)  # the same summation order, bit for bit
        assert not a.flags.writeable


def test_a_replica_that_skips_a_collective_fails_at_once(strategy):
    def step():
        if replica_id() != 2:
            distrib.get_replica_context().all_reduce("SUM", np.float32(1))

    start = time.monotonic()
    with pytest.raises(MergeCallMismatchError, match="Replicas made different numbers of merge_call calls.*"
                                                     "replica 2: 0,"):
        strategy.run(step)
    assert time.monotonic() - start < 5  # no waiting for the collective timeout


def test_an_error_names_its_replica_and_unwinds_the_others(strategy):
    unwound, started = [], []

    def step():
        r = replica_id()
        started.append(r)
        try:
            distrib.get_replica_context().all_reduce("SUM", np.float32(1))
            if r == 1:
                raise ValueError("replica one fails")
            distrib.get_replica_context().all_reduce("SUM", np.float32(1))
        finally:
            unwound.append(r)

    with pytest.raises(ValueError, match=r"replica one fails \(raised in replica 1 of 4\)"):
        strategy.run(step)
    assert started == [0, 1, 2, 3]
    assert sorted(unwound) == [0, 1, 2, 3]  # replicas 0, 2 and 3 waited at the second collective: unwound
    out = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(replica_id() + 1)))
    assert [float(x) for x in local(strategy, out)] == [10.0] * 4


def test_a_greenlet_exit_raised_by_a_replica_reaches_the_caller_as_any_error(strategy):
    import greenlet

    def step():
        if replica_id() == 1:
            raise greenlet.GreenletExit("replica one ends")  # what code written for gevent raises to stop
        return distrib.get_replica_context().all_reduce("SUM", np.float32(1))

    with pytest.raises(greenlet.GreenletExit, match=r"replica one ends \(raised in replica 1 of 4\)"):
        strategy.run(step)
    assert local(strategy, strategy.run(replica_id)) == (0, 1, 2, 3)


def test_an_error_in_the_merge_reaches_the_caller(strategy):
    def merge_fn(s):
        raise KeyError("merge fails")

    with pytest.raises(KeyError, match="merge fails"):
        strategy.run(lambda: distrib.get_replica_context().merge_call(merge_fn))
    assert local(strategy, strategy.run(replica_id)) == (0, 1, 2, 3)


def test_shared_python_state_needs_no_lock(strategy):
    log = []

    def step():
        for i in range(1000):  # a read-modify-write that threads could interleave
            log.append(len(log))
        return len(log)

    out = strategy.run(step)
    assert local(strategy, out) == (1000, 2000, 3000, 4000)
    assert log == list(range(4000))


def test_a_run_from_a_merge_fn_runs_and_one_from_a_replica_is_refused(strategy):
    def merge_fn(s):
        return s.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(1)))

    out = strategy.run(lambda: distrib.get_replica_context().merge_call(merge_fn))
    assert [float(x) for x in local(strategy, out)] == [4.0] * 4
    with pytest.raises(ContextError, match="Strategy.run cannot be called inside a replica function"):
        strategy.run(lambda: strategy.run(replica_id))


def test_a_run_from_a_thread_that_a_replica_joins_is_refused_naming_the_replica(strategy):
    errors = run_joined_by_replica(strategy, joining_replica=1)
    assert len(errors) == 1
    assert f"'{threading.current_thread().name} (replica 1)' waits in Thread.join for 'helper'" in str(errors[0])


def test_a_run_with_a_deadline_takes_the_threads(strategy):
    def step():
        if replica_id() == 3:
            time.sleep(0.5)
        return distrib.get_replica_context().all_reduce("SUM", np.float32(1))

    with pytest.raises(DeadlineExceededError, match="Strategy.run did not finish within"):
        strategy.run(step, options=distrib.RunOptions(timeout_seconds=0.1))
    threads = local(strategy, strategy.run(threading.get_ident, options=distrib.RunOptions(timeout_seconds=10)))
    assert threading.get_ident() not in threads


def test_variables_and_an_optimizer_train_as_with_threads():
    weights = []
    for execution in ("threads", "cooperative"):
        s = distrib.MirroredStrategy(DEVICES, replica_execution=execution)
        with s.scope():
            w = distrib.Variable(np.ones(3, np.float32))
            optimizer = distrib.optimizers.SGD(0.1)

        def step():
            grad = np.full(3, replica_id() + 1, np.float32)
            grads = distrib.get_replica_context().all_reduce("MEAN", grad)
            optimizer.apply_gradients([(grads, w)])

        for _ in range(3):
            s.run(step)
        weights.append(np.asarray(w.read_value()))
    np.testing.assert_array_equal(*weights)


def test_the_environment_chooses_and_gpus_keep_their_threads(monkeypatch):
    monkeypatch.setenv("DISTRIB_REPLICA_EXECUTION", "cooperative")
    s = distrib.MirroredStrategy(DEVICES[:2])
    assert local(s, s.run(threading.get_ident)) == (threading.get_ident(),) * 2
    monkeypatch.setenv("DISTRIB_REPLICA_EXECUTION", " Cooperative")  # any case and spacing, as DISTRIB_BACKEND
    s = distrib.MirroredStrategy(DEVICES[:2])
    assert local(s, s.run(threading.get_ident)) == (threading.get_ident(),) * 2
    monkeypatch.setenv("DISTRIB_REPLICA_EXECUTION", "fibers")
    with pytest.raises(ValueError, match="DISTRIB_REPLICA_EXECUTION must be 'threads' or 'cooperative'. "
                                         "Received: 'fibers'"):
        distrib.MirroredStrategy(DEVICES[:2])
    with pytest.raises(ValueError, match="replica_execution must be 'threads' or 'cooperative'. Received: 'fast'"):
        distrib.MirroredStrategy(DEVICES[:2], replica_execution="fast")


def test_cooperative_needs_the_cpu_emulator_or_replicas_sharing_one_gpu():
    from distrib.replica_greenlets import runs_cooperatively

    with pytest.raises(ValueError, match=r"needs the CPU emulator or replicas that share one GPU: replicas on "
                                         r"distinct GPUs run on threads.*Received: devices \['GPU:0', 'GPU:1'\]"):
        runs_cooperatively("cuda", ["GPU:0", "GPU:1"], "cooperative")
    assert runs_cooperatively("cuda", ["GPU:0"] * 4, "cooperative") is True  # one stream: they can take turns
    assert runs_cooperatively("cuda", ["GPU:0"] * 4, None) is False  # $DISTRIB_REPLICA_EXECUTION: GPUs keep threads
    assert runs_cooperatively("mpi", ["CPU:0"], "cooperative") is True


def test_the_timeline_puts_each_replica_on_its_own_track(strategy, tmp_path):
    import json

    strategy.start_timeline(str(tmp_path / "trace.json"))
    try:
        strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(1)))
    finally:
        path = strategy.stop_timeline()
    trace = json.loads(open(path).read())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    runs = sorted(names[e["tid"]] for e in trace["traceEvents"] if e.get("ph") == "X" and e["cat"] == "run")
    assert runs == ["MainThread", "replica 0", "replica 1", "replica 2", "replica 3"]


def test_nothing_of_a_run_outlives_it_without_a_garbage_collection():
    import gc
    import weakref

    class Payload:
        pass

    kept = []

    def step():
        payload = Payload()
        kept.append(weakref.ref(payload))
        distrib.get_replica_context().all_reduce("SUM", np.float32(1))
        if replica_id() == 2:
            raise KeyError("fails")

    gc.collect()
    gc.disable()
    try:
        strategy = distrib.MirroredStrategy(DEVICES, replica_execution="cooperative")
        for _ in range(3):
            with pytest.raises(KeyError):
                strategy.run(step)
        dropped = weakref.ref(strategy)
        del strategy
        assert [ref() for ref in kept] == [None] * 12  # the failed runs' locals, on every replica
        assert dropped() is None  # the greenlets kept no run, and so no strategy
    finally:
        gc.enable()


def test_the_replicas_of_a_thread_end_with_it(strategy):
    import gc
    import weakref

    import greenlet

    replicas = []

    def step():
        replicas.append(weakref.ref(greenlet.getcurrent()))
        return distrib.get_replica_context().all_reduce("SUM", np.float32(1))

    for _ in range(3):  # a thread that runs the strategy and ends, as a request handler does
        worker = threading.Thread(target=strategy.run, args=(step,))
        worker.start()
        worker.join()
    gc.collect()
    assert len(replicas) == 12 and [ref() for ref in replicas] == [None] * 12
