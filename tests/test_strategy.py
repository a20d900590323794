"""Strategy on four emulated CPU replicas: run, reduce, gather, local results, values from a function, the default."""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import numpy as np
import pytest

import distrib
from distrib import CommunicationOptions, PerReplica, ReduceOp
from distrib.values import flatten
from support import local, per_replica, replica_id

pytestmark = pytest.mark.timeout(30)


# -- run --------------------------------------------------------------------------------------------------------


def test_run_accepts_args_as_a_list_and_kwargs(strategy):
    value = per_replica(strategy, lambda r: np.float32(r))
    out = strategy.run(lambda x, scale=1: x * scale, args=[value], kwargs={"scale": np.float32(10)})
    assert [float(x) for x in local(strategy, out)] == [0.0, 10.0, 20.0, 30.0]


def test_run_accepts_run_options(strategy):
    out = strategy.run(replica_id, options=distrib.RunOptions())
    assert local(strategy, out) == (0, 1, 2, 3)


def test_replicas_run_concurrently(strategy):
    barrier = threading.Barrier(4, timeout=10)
    out = strategy.run(lambda: barrier.wait() is not None)  # returns only when all four wait at once
    assert out is True


def test_each_replica_runs_on_its_own_named_thread(strategy):
    out = strategy.run(lambda: threading.current_thread().name)
    assert local(strategy, out) == ("distrib-replica-0", "distrib-replica-1", "distrib-replica-2",
                                    "distrib-replica-3")


def test_replica_threads_are_reused_across_runs():
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    before = set(threading.enumerate())
    idents = [local(strategy, strategy.run(threading.get_ident)) for _ in range(5)]
    assert len(set(idents)) == 1
    assert threading.get_ident() not in idents[0]
    started = {t for t in set(threading.enumerate()) - before if t.name.startswith("distrib-replica-")}
    assert {t.ident for t in started} == set(idents[0])


THREAD_LIMIT = """
import resource, threading, time
import distrib

def vm_size() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))

distrib.MirroredStrategy(["CPU:0", "CPU:1"]).run(lambda: 1)  # the reaper and BLAS's threads exist before the limit
resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (1 << 30), resource.RLIM_INFINITY))
threading.stack_size(256 << 20)  # room for about 4 threads' stacks under the limit
try:
    distrib.MirroredStrategy([f"CPU:{i}" for i in range(16)]).run(lambda: 1)
except RuntimeError as exc:
    print(exc)
threading.stack_size(0)
strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
print(strategy.run(lambda: "ran"))
for _ in range(100):  # the retired threads end once they wake: within moments
    replicas = sorted(t.name for t in threading.enumerate() if t.name.startswith("distrib-replica"))
    if len(replicas) == 2:
        break
    time.sleep(0.1)
print(replicas)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the address space from /proc")
def test_replica_threads_the_os_cannot_start_are_one_clear_error_and_leave_none_behind():
    # the threads started before the OS refused one stayed, waiting for a run, and the error was Python's bare
    # "can't start new thread"
    done = subprocess.run([sys.executable, "-c", THREAD_LIMIT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    refusal, ran, names = done.stdout.splitlines()
    assert re.fullmatch(r"Only \d+ of the 16 replica threads could start \(can't start new thread\): this process "
                        r"reached its limit of threads, or of memory for their stacks\. Run fewer replicas, or raise "
                        r"the limit \(ulimit -u, /proc/sys/kernel/threads-max\)\.", refusal), refusal
    assert ran == "ran"
    assert names == "['distrib-replica-0', 'distrib-replica-1']"


# -- reduce ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op, axis, expected", [
    ("SUM", None, [[60, 64, 68], [72, 76, 80]]),
    ("MEAN", None, [[15, 16, 17], [18, 19, 20]]),
    ("SUM", 0, [132, 140, 148]),
    ("MEAN", 0, [16.5, 17.5, 18.5]),
    ("SUM", 1, [192, 228]),
    ("MEAN", 1, [16, 19]),
    ("SUM", -1, [192, 228]),
    ("MEAN", -2, [16.5, 17.5, 18.5]),
    ("SUM", (0, 1), 420),
    ("MEAN", (0, 1), 17.5),
    ("MEAN", (-1, 0), 17.5),
    ("SUM", [1], [192, 228]),
])
def test_reduce_along_an_axis_reduces_within_and_across_replicas(strategy, blocks, op, axis, expected):
    result = strategy.reduce(op, blocks, axis=axis)
    assert isinstance(result, np.ndarray) and result.dtype == np.float32
    np.testing.assert_allclose(result, expected)


def test_reduce_accepts_the_enum_and_any_case(strategy, blocks):
    np.testing.assert_array_equal(strategy.reduce(ReduceOp.MEAN, blocks, axis=0),
                                  strategy.reduce("mean", blocks, axis=0))


def test_reduce_mean_divides_by_the_global_count_of_a_partial_batch(strategy):
    # a last batch of 6 rows split 3/2/1/0: replica r holds 3 - r rows of the value 3 - r; replica 3 has none
    rows = per_replica(strategy, lambda r: np.full((3 - r, 2), 3 - r, np.float32))
    np.testing.assert_allclose(strategy.reduce("MEAN", rows, axis=0), [(9 + 4 + 1) / 6] * 2)
    np.testing.assert_allclose(strategy.reduce("SUM", rows, axis=0), [14, 14])
    np.testing.assert_allclose(strategy.reduce("MEAN", rows, axis=(0, 1)), 14 / 6)


def test_reduce_mean_of_integers_along_an_axis_is_a_float(strategy):
    ints = per_replica(strategy, lambda r: np.array([r, r + 1], np.int32))
    result = strategy.reduce("MEAN", ints, axis=0)
    assert result.dtype.kind == "f"
    assert float(result) == 2.0
    assert strategy.reduce("SUM", ints, axis=0).dtype == np.int32


@pytest.mark.parametrize("dtype, mean_dtype", [("int8", "float32"), ("uint8", "float32"), ("int16", "float32"),
                                               ("uint16", "float32"), ("int32", "float64"), ("uint64", "float64")])
@pytest.mark.parametrize("ops", [None, distrib.HierarchicalCopyAllReduce(), distrib.ReductionToOneDevice()],
                         ids=["default", "hierarchical", "one-device"])
def test_the_mean_of_integers_has_tensorflows_dtype(dtype, mean_dtype, ops):
    # before: float64 for every integer; TensorFlow's true division gives float32 for 8- and 16-bit integers
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"], cross_device_ops=ops)
    ints = per_replica(strategy, lambda r: np.array([r, 2 * r], dtype))
    means = [strategy.reduce("MEAN", ints, axis=None), strategy.reduce("MEAN", ints, axis=0),
             local(strategy, strategy.extended.reduce_to("MEAN", ints, destinations="CPU:0"))[0],
             local(strategy, strategy.run(lambda x: distrib.get_replica_context().all_reduce("MEAN", x),
                                          args=(ints,)))[3]]
    assert [m.dtype.name for m in means] == [mean_dtype] * 4
    assert [np.asarray(m).tolist() for m in means] == [[1.5, 3.0], 2.25, [1.5, 3.0], [1.5, 3.0]]


def test_the_mean_of_one_replicas_integers_is_itself():
    # before: float64 from Strategy.reduce on one device, where reduce_to and TensorFlow keep the integers
    one = distrib.MirroredStrategy(["CPU:0"])
    ints = one.experimental_distribute_values_from_function(lambda ctx: np.array([1, 2, 3], np.int32))
    assert one.reduce("MEAN", ints, axis=None).dtype == np.int32
    assert one.extended.reduce_to("MEAN", ints, destinations="CPU:0").values[0].dtype == np.int32


@pytest.mark.parametrize("value", [None, {"loss": None, "count": 1.0}], ids=["None", "None leaf"])
def test_reduce_sum_of_none_is_refused_and_mean_passes_it_on_as_in_tensorflow(strategy, value):
    with pytest.raises(ValueError, match=r"Strategy.reduce cannot sum None \(did the replica function return "):
        strategy.reduce("SUM", value, axis=None)
    assert strategy.reduce("MEAN", None, axis=None) is None
    assert strategy.reduce("MEAN", {"loss": None}, axis=None) == {"loss": None}


def test_reduce_of_a_nested_structure_reduces_each_leaf(strategy):
    value = {"a": per_replica(strategy, lambda r: np.float32(r)),
             "b": [per_replica(strategy, lambda r: np.full(2, r, np.int64))]}
    out = strategy.reduce("SUM", value, axis=None)
    assert float(out["a"]) == 6.0
    np.testing.assert_array_equal(out["b"][0], [6, 6])


def order_sensitive(r, shape, dtype):
    """Replica r's values whose sum depends on the order of the additions."""
    rng = np.random.default_rng(r)
    return (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4, shape)).astype(dtype)


def mixed_leaves(r):
    """Replica r's leaves of a nested batch: float32, float16 and int32, partial batches (3 - r rows)."""
    return {"loss": order_sensitive(r, (3 - r, 5), np.float32), "half": order_sensitive(r + 9, (3 - r, 2), np.float16),
            "ids": np.arange(3 - r, dtype=np.int32) + r, "rows": [order_sensitive(r + 4, (3 - r,), np.float32)]}


def same_shaped_leaves(r):
    """Replica r's leaves of one shape on every replica, 0-d ones too."""
    return {"loss": order_sensitive(r, (3, 5), np.float32), "half": order_sensitive(r + 9, (3, 2), np.float16),
            "ids": np.arange(3, dtype=np.int32) * r, "scalar": np.float64(r) / 3, "count": np.int32(r)}


def in_device_order(parts):
    total = parts[0] + parts[1]
    for part in parts[2:]:
        total = total + part
    return total


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("axis", [None, 0])
def test_reduce_of_a_nested_structure_is_each_leafs_reduction_bit_for_bit(strategy, op, axis):
    value = per_replica(strategy, same_shaped_leaves if axis is None else mixed_leaves)
    nested = strategy.reduce(op, value, axis=axis)
    for leaf, got in zip(flatten(value)[0], flatten(nested)[0]):
        alone = strategy.reduce(op, leaf, axis=axis)
        parts = [np.asarray(p) for p in local(strategy, leaf)]
        if axis is not None:
            parts = [np.sum(p, axis=axis, dtype=p.dtype) for p in parts]
        want = in_device_order(parts)
        if op == "MEAN":
            count = 4 if axis is None else sum(np.shape(p)[axis] for p in local(strategy, leaf))
            want = want / count if want.dtype.kind == "i" else np.true_divide(want, want.dtype.type(count))
        np.testing.assert_array_equal(got, want, strict=True)
        np.testing.assert_array_equal(alone, want, strict=True)


@pytest.mark.parametrize("axis", [None, 0])
def test_reduce_of_a_nested_structure_sums_each_dtype_once(counting, axis):
    strategy, backend = counting
    value = per_replica(strategy, lambda r: [np.full((2, 3), r, dtype) for dtype in ("float32", "float16", "int32")
                                             for _ in range(10)])
    strategy.reduce("MEAN", value, axis=axis)
    counts = ["int64"] if axis is not None else []  # MEAN along an axis: the element counts travel as a value
    assert sorted(backend.counted("add_n")) == sorted(["float32", "float16", "int32"] + counts)


def test_reduce_of_a_nested_structure_names_the_value_that_cannot_be_summed(strategy):
    value = {"a": per_replica(strategy, np.float32), "b": per_replica(strategy, lambda r: np.array([r > 1]))}
    with pytest.raises(TypeError, match=r"^Reductions need numeric values\. Received: dtype bool at value 1\."):
        strategy.reduce("SUM", value, axis=None)
    ragged = {"a": per_replica(strategy, lambda r: np.ones((2, r + 1), np.float32))}
    with pytest.raises(ValueError, match=r"^reduce_to needs the same shape and dtype on every replica\. "
                                         r"Received: replica 1, value 0, float32\[2\] vs float32\[1\]\."):
        strategy.reduce("SUM", ragged, axis=0)


def test_reduce_of_a_plain_value(strategy):
    assert float(strategy.reduce("MEAN", np.float32(3), axis=None)) == 3.0
    # with an axis, each replica reduces its own copy first, as in TensorFlow: 4 replicas x 3 ones
    assert float(strategy.reduce("SUM", np.ones(3, np.float32), axis=0)) == 12.0
    assert float(strategy.reduce("MEAN", np.ones(3, np.float32), axis=0)) == 1.0
    with pytest.raises(ValueError, match="A non-distributed value cannot be reduced with SUM on 4 replicas"):
        strategy.reduce("SUM", np.float32(3), axis=None)


@pytest.mark.parametrize("axis", [2, -3, (0, 2)])
def test_reduce_rejects_axes_out_of_range(strategy, blocks, axis):
    with pytest.raises(ValueError, match="is out of range for a value of rank 2"):
        strategy.reduce("SUM", blocks, axis=axis)


def test_reduce_rejects_an_axis_named_twice(strategy, blocks):
    with pytest.raises(ValueError, match=r"axis names an axis more than once. Received: \(0, -2\) for a value of "
                                         r"rank 2"):
        strategy.reduce("SUM", blocks, axis=(0, -2))


@pytest.mark.parametrize("axis", [None, (0,), "0"])
def test_gathers_take_one_int_axis(strategy, blocks, axis):
    # before: all_gather(axis=None) failed inside the batching with "'<=' not supported", and Strategy.gather's
    # message listed None among what it takes
    with pytest.raises(TypeError, match=r"Strategy.gather concatenates along one axis: axis must be an int. "):
        strategy.gather(blocks, axis=axis)
    with pytest.raises(TypeError, match=r"all_gather concatenates along one axis: axis must be an int. "):
        strategy.run(lambda: distrib.get_replica_context().all_gather(np.ones(2, np.float32), axis=axis))
    with pytest.raises(TypeError, match=r"all_gather concatenates along one axis: axis must be an int. "):
        strategy.run(lambda: distrib.get_replica_context().all_gather({"a": np.ones(2)}, axis=axis))


def test_dates_are_refused_as_values_that_cannot_be_summed(strategy):
    dates = np.array(["2020-01-01"], "datetime64[D]")
    with pytest.raises(TypeError, match=r"Reductions need numeric values. Received: dtype datetime64\[D\]"):
        strategy.reduce("SUM", strategy.experimental_distribute_values_from_function(lambda ctx: dates), axis=None)
    with pytest.raises(TypeError, match=r"all_reduce needs numeric values. Received: dtype datetime64\[D\]"):
        strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", dates))


@pytest.mark.parametrize("axis", [None, 0])
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_booleans_are_refused_with_or_without_an_axis(strategy, op, axis):
    # before, with an axis: SUM counted the Trues (int64) and MEAN gave their share; TensorFlow refuses both
    flags = strategy.experimental_distribute_values_from_function(lambda ctx: np.array([True, False]))
    with pytest.raises(TypeError, match=r"^Reductions need numeric values\. Received: dtype bool at value 0\.$"):
        strategy.reduce(op, flags, axis=axis)


@pytest.mark.parametrize("axis", [1.0, True, "0"])
def test_reduce_rejects_axes_that_are_not_ints(strategy, blocks, axis):
    with pytest.raises(TypeError, match="axis must be an int, a tuple of ints or None"):
        strategy.reduce("SUM", blocks, axis=axis)


# -- gather -------------------------------------------------------------------------------------------------------


def test_gather_concatenates_along_any_axis(strategy, blocks):
    assert strategy.gather(blocks, axis=0).shape == (8, 3)
    along_last = strategy.gather(blocks, axis=-1)
    assert isinstance(along_last, np.ndarray) and along_last.shape == (2, 12)
    np.testing.assert_array_equal(along_last[0], [0, 1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32])


def test_gather_accepts_sizes_that_differ_along_the_axis_even_empty(strategy):
    value = per_replica(strategy, lambda r: np.full((2, r), r, np.int32))  # replica 0 contributes nothing
    np.testing.assert_array_equal(strategy.gather(value, axis=1), [[1, 2, 2, 3, 3, 3]] * 2)


def test_gather_of_a_nested_structure_gathers_each_leaf(strategy):
    value = {"ids": per_replica(strategy, lambda r: np.array([r])), "plain": np.zeros((1, 2))}
    out = strategy.gather(value, axis=0)
    np.testing.assert_array_equal(out["ids"], [0, 1, 2, 3])
    assert out["plain"].shape == (1, 2)  # a plain value is one component


def test_gather_rejects_shapes_that_differ_off_the_axis(strategy):
    value = per_replica(strategy, lambda r: np.zeros((2, r + 1)))
    with pytest.raises(ValueError, match=r"^Strategy.gather needs shapes that differ only along axis 0\. "
                                         r"Received: replica 1"):
        strategy.gather(value, axis=0)


def test_gather_rejects_scalars(strategy):
    with pytest.raises(ValueError, match="Strategy.gather needs values of rank >= 1"):
        strategy.gather(per_replica(strategy, np.float32), axis=0)


# -- local results and values from a function ---------------------------------------------------------------------


def test_local_results_of_a_list_gives_one_list_per_replica(strategy):
    ids = per_replica(strategy, lambda r: r)
    assert local(strategy, [ids, "shared"]) == ([0, "shared"], [1, "shared"], [2, "shared"], [3, "shared"])


def test_local_results_need_distributed_values_of_one_length(strategy):
    with pytest.raises(ValueError, match="experimental_local_results needs distributed values of one length"):
        local(strategy, [PerReplica([1, 2]), PerReplica([1, 2, 3])])


def test_values_from_function_always_wrap(strategy):
    shared = np.zeros(3)
    value = strategy.experimental_distribute_values_from_function(lambda ctx: shared)
    assert isinstance(value, PerReplica)
    assert all(component is shared for component in value.values)


def test_values_from_function_distributes_nested_values(strategy):
    value = per_replica(strategy, lambda r: {"x": np.float32(r), "tag": f"replica-{r}"})
    assert isinstance(value["x"], PerReplica)
    assert value["tag"].values == ("replica-0", "replica-1", "replica-2", "replica-3")


def test_values_from_function_sees_each_replica_once_in_order(strategy):
    seen = []
    strategy.experimental_distribute_values_from_function(seen.append)
    assert [(c.replica_id_in_sync_group, c.num_replicas_in_sync) for c in seen] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert repr(seen[1]) == "ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=4)"


def test_values_from_function_needs_a_callable(strategy):
    with pytest.raises(TypeError, match="value_fn must be callable"):
        strategy.experimental_distribute_values_from_function([1, 2, 3, 4])


# -- the default strategy ---------------------------------------------------------------------------------------------


def test_the_default_strategy_runs_fn_on_the_calling_thread():
    default = distrib.get_strategy()
    assert default.run(lambda x: (x + 1, threading.get_ident()), args=(1,)) == (2, threading.get_ident())
    assert default.num_replicas_in_sync == 1
    assert default.extended.worker_devices == ("CPU:0",)


def test_the_default_strategy_reduces_and_gathers_one_replica():
    default = distrib.get_strategy()
    result = default.reduce("SUM", np.float32(3), axis=None)
    assert isinstance(result, np.ndarray) and float(result) == 3.0
    np.testing.assert_array_equal(default.reduce("MEAN", np.arange(4.0), axis=0), 1.5)
    np.testing.assert_array_equal(default.gather(np.ones(2), axis=0), [1.0, 1.0])
    assert default.experimental_local_results("x") == ("x",)
    # TensorFlow's default strategy returns value_fn(ValueContext()) as it is (before, a PerReplica of one)
    made = default.experimental_distribute_values_from_function(
        lambda ctx: (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))
    assert made == (0, 1)
    assert default.run(lambda x: x * 2, args=(default.experimental_distribute_values_from_function(lambda ctx: 3),)) \
        == 6


def test_the_default_strategy_ignores_input_options_as_tensorflow_does():
    default = distrib.get_strategy()
    per_replica = distrib.InputOptions(experimental_replication_mode=distrib.InputReplicationMode.PER_REPLICA)
    batches = [np.arange(4), np.arange(4, 8)]
    steps = list(default.experimental_distribute_dataset(batches, per_replica))  # before: NotImplementedError
    assert [step.tolist() for step in steps] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [step.tolist() for step in default.distribute_datasets_from_function(lambda ctx: batches, per_replica)] \
        == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_the_default_replica_context_collectives_return_the_value():
    ctx = distrib.get_replica_context()
    assert float(ctx.all_reduce("MEAN", np.float32(3))) == 3.0
    np.testing.assert_array_equal(ctx.all_gather(np.ones(2), axis=0), [1.0, 1.0])
    assert ctx.devices == ("CPU:0",)


# -- printing -------------------------------------------------------------------------------------------------------


def test_public_objects_print_themselves(strategy):
    assert repr(strategy) == "<MirroredStrategy devices=('CPU:0', 'CPU:1', 'CPU:2', 'CPU:3')>"
    assert repr(strategy.extended) == "<MirroredExtended devices=('CPU:0', 'CPU:1', 'CPU:2', 'CPU:3')>"
    assert repr(distrib.get_strategy()) == "<DefaultStrategy>"
    out = strategy.run(lambda: repr(distrib.get_replica_context()))
    assert local(strategy, out)[2] == "<ReplicaContext replica_id_in_sync_group=2 num_replicas_in_sync=4>"
    assert repr(distrib.NcclAllReduce(num_packs=2)) == "NcclAllReduce(num_packs=2)"
    assert repr(distrib.HierarchicalCopyAllReduce()) == "HierarchicalCopyAllReduce(num_packs=1)"
    assert repr(distrib.ReductionToOneDevice()) == "ReductionToOneDevice(reduce_to_device=None)"
    assert repr(distrib.ValueContext(1, 4)) == "ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=4)"
    assert repr(CommunicationOptions(bytes_per_pack=64)).startswith("CommunicationOptions(bytes_per_pack=64, ")


def test_local_results_of_a_structure_without_distributed_leaves_is_one_copy_per_replica(strategy):
    out = strategy.run(lambda: {"loss": 1, "names": ["a", "b"]})
    assert strategy.experimental_local_results(out) == ({"loss": 1, "names": ["a", "b"]},) * 4
    assert strategy.experimental_local_results(7) == (7,)


def test_the_same_scope_object_may_be_entered_again(strategy):
    scope = strategy.scope()
    with scope:
        with scope:
            assert distrib.get_strategy() is strategy
        assert distrib.get_strategy() is strategy
    assert not distrib.has_strategy()
    with scope:
        assert distrib.get_strategy() is strategy


def test_local_results_of_none_is_one_none_as_of_any_plain_value():
    # (None, None) on 2 replicas, where TensorFlow gives (None,) as it gives (3,) for 3
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    assert strategy.experimental_local_results(None) == (None,)
    assert strategy.experimental_local_results(3) == (3,)
