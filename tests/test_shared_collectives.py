"""The CPU emulator's collectives shared by the merge thread and the replica threads waiting at the rendezvous."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import distrib
from distrib.backends.parallel import MIN_SHARE_BYTES, run_shares, shares, usable_cores
from distrib.replica_team import ReplicaTeam

LARGE = 3 * MIN_SHARE_BYTES // 4 + 7  # float32 elements: enough for three shares, and an odd length
needs_two_cores = pytest.mark.skipif(usable_cores() < 2, reason="one usable core: the work is never split")


@pytest.fixture(scope="module")
def strategy():
    return distrib.MirroredStrategy([f"CPU:{i}" for i in range(4)])


def replica_values(strategy, dtype=np.float32, size=LARGE):
    """Each replica's own random array, with values whose sum depends on the order of the additions."""
    def make(ctx):
        rng = np.random.default_rng(ctx.replica_id_in_sync_group)
        return (rng.standard_normal(size) * 10.0 ** rng.integers(-3, 4, size)).astype(dtype)
    return strategy.experimental_distribute_values_from_function(make)


def in_device_order(arrays):
    total = arrays[0] + arrays[1]
    for array in arrays[2:]:
        total = total + array
    return total


@pytest.mark.parametrize("length,itemsize,parts", [(LARGE, 4, 2), (LARGE, 4, 16), (10**6, 8, 3), (100, 4, 4), (0, 4, 2)])
def test_shares_cover_every_element_once_in_aligned_ranges(length, itemsize, parts):
    ranges = shares(length, itemsize, parts)
    assert [lo for lo, _ in ranges[1:]] == [hi for _, hi in ranges[:-1]]
    assert (ranges[0][0], ranges[-1][1]) == (0, length) if length else ranges == []
    assert len(ranges) <= max(1, min(parts, length * itemsize // MIN_SHARE_BYTES))
    assert all(lo * itemsize % 64 == 0 for lo, _ in ranges)


@needs_two_cores
def test_a_merge_shares_its_work_with_the_waiting_replica_threads(strategy):
    ran_on = set()
    lock = threading.Lock()

    def body(lo, hi):
        with lock:
            ran_on.add(threading.current_thread().name)

    def step():
        distrib.get_replica_context().merge_call(lambda s: run_shares(LARGE, 4, body))

    strategy.run(step)
    assert threading.current_thread().name in ran_on
    assert any(name.startswith("distrib-replica-") for name in ran_on)
    assert len(ran_on) == min(usable_cores(), 5, 3)


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_a_shared_all_reduce_is_bit_for_bit_the_in_order_sum(strategy, op, dtype):
    values = replica_values(strategy, dtype)
    result = strategy.run(lambda x: distrib.get_replica_context().all_reduce(op, x), args=(values,))
    expected = in_device_order(strategy.experimental_local_results(values))
    if op == "MEAN":
        expected = expected / 4 if np.dtype(dtype).kind == "i" else np.true_divide(expected, np.dtype(dtype).type(4))
    for array in strategy.experimental_local_results(result):
        assert array.dtype == expected.dtype
        np.testing.assert_array_equal(array, expected, strict=True)


def test_shared_results_are_read_only(strategy):
    result = strategy.run(lambda x: distrib.get_replica_context().all_reduce("SUM", x),
                          args=(replica_values(strategy),))
    first = strategy.experimental_local_results(result)[0]
    with pytest.raises(ValueError, match="assignment destination is read-only"):
        first[0] = 1


def test_a_shared_all_gather_concatenates_in_replica_order(strategy):
    values = replica_values(strategy)
    result = strategy.run(lambda x: distrib.get_replica_context().all_gather(x, axis=0), args=(values,))
    expected = np.concatenate(strategy.experimental_local_results(values))
    for array in strategy.experimental_local_results(result):
        np.testing.assert_array_equal(array, expected, strict=True)


def test_a_reduce_to_inside_a_merge_call_is_the_in_order_sum(strategy):
    values = replica_values(strategy)

    def step(x):
        return distrib.get_replica_context().merge_call(
            lambda s, v: s.extended.reduce_to("SUM", v, v), args=(x,))

    result = strategy.run(step, args=(values,))
    expected = in_device_order(strategy.experimental_local_results(values))
    for array in strategy.experimental_local_results(result):
        np.testing.assert_array_equal(array, expected, strict=True)


@needs_two_cores
def test_an_error_in_a_replica_threads_share_reaches_the_caller_and_the_strategy_stays_usable(strategy):
    def body(lo, hi):
        if threading.current_thread().name.startswith("distrib-replica-"):
            raise FloatingPointError(f"share [{lo}, {hi}) failed")

    def step():
        distrib.get_replica_context().merge_call(lambda s: run_shares(LARGE, 4, body))

    with pytest.raises(FloatingPointError, match=r"^share \["):
        strategy.run(step)
    result = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(1)))
    assert [float(x) for x in strategy.experimental_local_results(result)] == [4.0] * 4


def test_a_team_runs_at_most_one_task_per_thread():
    with pytest.raises(ValueError, match="^A team of 1 threads runs at most 1 tasks"):
        ReplicaTeam([]).run([lambda: None, lambda: None])


def test_a_run_inside_a_merge_fn_shares_its_collectives_with_its_own_threads(strategy):
    values = replica_values(strategy)

    def inner(x):
        return distrib.get_replica_context().all_reduce("SUM", x)

    def step():
        return distrib.get_replica_context().merge_call(lambda s: s.run(inner, args=(values,)))

    result = strategy.run(step)
    expected = in_device_order(strategy.experimental_local_results(values))
    for array in strategy.experimental_local_results(result):
        np.testing.assert_array_equal(array, expected, strict=True)


def test_a_shared_batched_all_reduce_packs_and_sums_bit_for_bit(strategy):
    def make(ctx):
        rng = np.random.default_rng(ctx.replica_id_in_sync_group)
        return [(rng.standard_normal(size) * 10.0 ** rng.integers(-3, 4, size)).astype(np.float32)
                for size in (LARGE // 3, 17, LARGE // 2)]

    values = strategy.experimental_distribute_values_from_function(make)
    result = strategy.run(lambda xs: distrib.get_replica_context().all_reduce("SUM", xs), args=(values,))
    columns = list(zip(*strategy.experimental_local_results(values)))
    for arrays in strategy.experimental_local_results(result):
        for array, column in zip(arrays, columns):
            np.testing.assert_array_equal(array, in_device_order(column), strict=True)


@needs_two_cores
def test_a_reduction_outside_a_run_shares_its_sums_with_the_idle_replica_threads(strategy):
    strategy.run(lambda: None)  # the replica threads exist and wait for the next run
    ran_on = set()
    lock = threading.Lock()

    def body(lo, hi):
        with lock:
            ran_on.add(threading.current_thread().name)

    strategy.extended._on_idle_threads(run_shares, LARGE, 4, body)
    assert threading.current_thread().name in ran_on
    assert any(name.startswith("distrib-replica-") for name in ran_on)


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_reductions_outside_a_run_are_bit_for_bit_the_in_order_sum(strategy, op):
    values = replica_values(strategy, np.float64)
    expected = in_device_order(strategy.experimental_local_results(values))
    if op == "MEAN":
        expected = np.true_divide(expected, np.float64(4))
    np.testing.assert_array_equal(strategy.reduce(op, values, axis=None), expected, strict=True)
    for array in strategy.extended.reduce_to(op, values, values).values:
        np.testing.assert_array_equal(array, expected, strict=True)
    result = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(1)))
    assert [float(x) for x in strategy.experimental_local_results(result)] == [4.0] * 4  # the threads came back
