"""Variables behave as TensorFlow's where they silently did not: atomic writes from several replicas, list values
aggregated, truth/len/iteration of the value, shape and dtype refusals, the operators, trainable with ON_READ,
`.device` of a distributed variable, and MEAN refused on complex numbers.

Each test failed before its fix (the `before:` comments say how).
"""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

import distrib
from distrib import PerReplica, VariableAggregation, VariableSynchronization
from distrib.backends import get_backend

pytestmark = pytest.mark.timeout(60)

DEVICES = ("CPU:0", "CPU:1", "CPU:2")
ON_READ = VariableSynchronization.ON_READ


@pytest.fixture(scope="module")
def strategy():
    return distrib.MirroredStrategy(list(DEVICES))


def replica_id() -> int:
    return distrib.get_replica_context().replica_id_in_sync_group


def copies(variable) -> list:
    return [component.numpy().tolist() for component in variable.values]


# -- 1. writes are atomic per variable ----------------------------------------------------------------------------


@pytest.mark.parametrize("use_locking", [False, True])
def test_replicas_writing_one_plain_variable_lose_no_update(strategy, use_locking):
    # before: another replica's copy on write swapped in a new buffer while a write was in flight, and whole
    # updates were lost (3 replicas x 50 adds gave 81 to 124 instead of 150)
    for size in (1_000_000, 200_000):
        v = distrib.Variable(np.zeros(size, np.float32))
        ones = np.ones(size, np.float32)

        def step(var):
            for _ in range(50):
                var.assign_add(ones, use_locking=use_locking)

        strategy.run(step, args=(v,))
        assert v.numpy().min() == v.numpy().max() == 150.0


def test_concurrent_assign_sub_and_scatter_add_are_atomic_too(strategy):
    v = distrib.Variable(np.zeros((1000, 200), np.float32))
    ones = np.ones((1000, 200), np.float32)
    rows = distrib.IndexedSlices(np.ones((1000, 200), np.float32), np.arange(1000))

    def step(var):
        for _ in range(20):
            var.assign_sub(ones)
            var.scatter_add(rows)
            var.assign_add(ones)

    strategy.run(step, args=(v,))
    assert v.numpy().min() == v.numpy().max() == 60.0


class _HalfwayWrites:
    """NumPy, except that `add` writes the first half of `out`, lets a reader in (`halfway`), waits until it has
    read (`read`, at most 0.5 s: with the fix, the reader waits for the write instead), then writes the rest."""

    def __init__(self):
        self.halfway, self.read = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(np, name)

    def add(self, buffer, operand, out, casting):
        half = len(out) // 2
        np.add(buffer[:half], operand[:half], out=out[:half], casting=casting)
        self.halfway.set()
        self.read.wait(0.5)
        np.add(buffer[half:], operand[half:], out=out[half:], casting=casting)
        return out


class _Backend:
    def __init__(self, backend, xp):
        self._backend, self.xp = backend, xp

    def __getattr__(self, name):
        return getattr(self._backend, name)


def test_a_value_read_while_another_thread_writes_never_changes():
    # before: a read taken while a write was in progress in place went on changing under the reader (half the
    # elements 1 when read, all of them 1 later)
    xp = _HalfwayWrites()
    v = distrib.Variable(np.zeros(8, np.float32), backend=_Backend(get_backend("cpu"), xp))
    writer = threading.Thread(target=v.assign_add, args=(np.ones(8, np.float32),))
    writer.start()
    try:
        assert xp.halfway.wait(5)
        view = v.read_value()
        seen = view.copy()
        xp.read.set()
    finally:
        writer.join()
    assert seen.tolist() in ([0.0] * 8, [1.0] * 8)  # before the write or after it, never half of it
    assert view.tolist() == seen.tolist()
    assert v.numpy().tolist() == [1.0] * 8


# -- 2. a list or tuple written from a replica is aggregated ---------------------------------------------------


@pytest.mark.parametrize("aggregation, expected", [("MEAN", [2.0, 20.0]), ("SUM", [6.0, 60.0]),
                                                   ("ONLY_FIRST_REPLICA", [1.0, 10.0])])
def test_a_list_written_in_a_replica_context_is_aggregated_like_an_array(strategy, aggregation, expected):
    # before: each copy took its own replica's list (MEAN and ONLY_FIRST_REPLICA left the copies diverged; SUM
    # said the value was the same object on every replica)
    with strategy.scope():
        v = distrib.Variable(np.zeros(2, np.float32), aggregation=aggregation)
    strategy.run(lambda: v.assign_add([np.float32(replica_id() + 1), np.float32(10 * (replica_id() + 1))]))
    assert copies(v) == [expected] * 3
    with strategy.scope():
        w = distrib.Variable(np.zeros(2, np.float32), aggregation=aggregation)
    strategy.run(lambda: w.assign((np.float32(replica_id() + 1), np.float32(10 * (replica_id() + 1)))))
    assert copies(w) == [expected] * 3


def test_a_mirrored_variable_sum_aggregated_in_a_replica_context_is_refused_and_a_sync_on_read_one_is_not(strategy):
    # before: the mirrored value was counted once per replica, silently (TensorFlow: a bare AssertionError)
    with strategy.scope():
        total = distrib.Variable(np.array([1.0, 2.0], np.float32), name="total", aggregation="SUM")
        mean = distrib.Variable(np.array([1.0, 2.0], np.float32), aggregation="MEAN")
        delta = distrib.Variable(np.array([3.0, 4.0], np.float32), name="delta")
        counts = distrib.Variable(np.array([3.0, 4.0], np.float32), synchronization=ON_READ, aggregation="SUM")
    with pytest.raises(ValueError, match=r"^A MirroredVariable holds one value on every replica: SUM-aggregating it "
                                         r"into 'total' would count it 3 times\. Received: assign_add of 'delta'"):
        strategy.run(lambda: total.assign_add(delta))
    assert copies(total) == [[1.0, 2.0]] * 3
    strategy.run(lambda: mean.assign_add(delta))  # its mean is itself
    assert copies(mean) == [[4.0, 6.0]] * 3
    strategy.run(lambda: total.assign_add(counts))  # each replica's own copy: a per-replica value, summed
    assert copies(total) == [[10.0, 14.0]] * 3
    total.assign_add(delta)  # cross-replica: one value for every copy
    assert copies(total) == [[13.0, 18.0]] * 3


def test_a_list_that_is_the_same_on_every_replica_follows_the_rules_of_one_value(strategy):
    with strategy.scope():
        total = distrib.Variable(np.zeros(2, np.float32), aggregation="SUM")
        mean = distrib.Variable(np.zeros(2, np.float32), aggregation="MEAN")
    with pytest.raises(ValueError, match="same object on every replica cannot be SUM-aggregated"):
        strategy.run(lambda: total.assign_add([1.0, 2.0]))
    constant = np.float32(5)
    with pytest.raises(ValueError, match="same object on every replica cannot be SUM-aggregated"):
        strategy.run(lambda: total.assign_add([np.float32(replica_id()), constant]))
    strategy.run(lambda: mean.assign_add([1.0, 2.0]))
    assert copies(mean) == [[1.0, 2.0]] * 3
    assert copies(total) == [[0.0, 0.0]] * 3


def test_a_cross_replica_list_holding_per_replica_values_is_refused_by_a_mirrored_variable(strategy):
    with strategy.scope():
        v = distrib.Variable(np.zeros(2, np.float32), aggregation="MEAN")
        s = distrib.Variable(np.zeros(2, np.float32), synchronization=ON_READ, aggregation="SUM")
    per_replica = PerReplica([np.float32(i) for i in range(3)])
    # before: each copy took its replica's element, leaving the copies of a MirroredVariable diverged
    with pytest.raises(ValueError, match=r"can only be given one value.*a PerReplica inside a list"):
        v.assign([per_replica, np.float32(0)])
    assert copies(v) == [[0.0, 0.0]] * 3
    s.assign([per_replica, np.float32(7)])  # a SyncOnReadVariable: each copy its replica's, as a bare PerReplica
    assert copies(s) == [[0.0, 7.0], [1.0, 7.0], [2.0, 7.0]]


# -- 3. truth, length and iteration follow the value -------------------------------------------------------------


def test_truth_length_and_iteration_of_a_plain_variable_follow_its_value():
    zero = distrib.Variable(np.float32(0.0))
    assert bool(zero) is False and bool(distrib.Variable(np.float32(2.0))) is True  # before: always True
    with pytest.raises(ValueError, match="truth value of an array with more than one element"):
        bool(distrib.Variable(np.zeros(2, np.float32)))
    with pytest.raises(TypeError, match=r"len\(\) of a scalar variable"):
        len(zero)
    with pytest.raises(TypeError, match="iteration over a scalar variable"):
        list(zero)  # before: []
    rows = distrib.Variable(np.arange(6.0).reshape(3, 2))
    assert len(rows) == 3
    assert [row.tolist() for row in rows] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_truth_length_and_iteration_of_a_distributed_variable_follow_its_value(strategy):
    with strategy.scope():
        v = distrib.Variable(np.arange(5.0, dtype=np.float32))
        zero = distrib.Variable(np.float32(0.0))
        metric = distrib.Variable(np.float32(0.0), synchronization=ON_READ, aggregation="SUM")
    assert len(v) == 5  # before: 3, the replica count
    assert list(v) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert bool(zero) is False  # before: True (the replica count)
    with pytest.raises(TypeError, match=r"len\(\) of a scalar variable"):
        len(zero)
    strategy.run(lambda: metric.assign_add(np.float32(replica_id())))
    assert bool(metric) is True  # the aggregate, 0 + 1 + 2
    assert strategy.experimental_local_results(strategy.run(lambda: bool(metric))) == (False, True, True)
    assert len(v.values) == 3


def test_variables_stay_equal_only_to_themselves_and_hash_by_identity(strategy):
    with strategy.scope():
        a, b = distrib.Variable(np.ones(2, np.float32)), distrib.Variable(np.ones(2, np.float32))
    p, q = distrib.Variable(np.zeros(2)), distrib.Variable(np.zeros(2))
    assert a == a and a != b and p == p and p != q  # identity: optimizers key their slots by variable
    assert len({a: 1, b: 2, p: 3, q: 4}) == 4


# -- 4. a value of another shape is refused -----------------------------------------------------------------------


def test_only_first_replica_checks_the_shape_of_the_value_it_uses_alone(strategy):
    # before, a replica other than the first raised on a value of another shape that TensorFlow ignores
    with strategy.scope():
        first = distrib.Variable(np.zeros(2, np.float32), aggregation="ONLY_FIRST_REPLICA")
    strategy.run(lambda: first.assign(np.array([5.0, 6.0] if replica_id() == 0 else [1.0, 2.0, 3.0], np.float32)))
    assert copies(first) == [[5.0, 6.0]] * 3
    with pytest.raises(ValueError, match=r"assign needs a value of shape \(2,\).*raised in replica 0 of 3"):
        strategy.run(lambda: first.assign(np.ones(3 if replica_id() == 0 else 2, np.float32)))


def test_a_value_of_another_shape_is_refused_not_broadcast():
    kernel = distrib.Variable(np.zeros((3, 3), np.float32), name="kernel")
    # before: (3, 1) filled the rows, (3,) was tiled
    with pytest.raises(ValueError, match=r"assign_add needs a value of shape \(3, 3\).*'kernel'.*shape \(3, 1\)"):
        kernel.assign_add(np.ones((3, 1), np.float32))
    with pytest.raises(ValueError, match=r"assign needs a value of shape \(3, 3\).*'kernel'.*shape \(3,\)"):
        kernel.assign(np.array([1.0, 2.0, 3.0], np.float32))
    with pytest.raises(ValueError, match=r"assign_sub needs a value of shape \(3, 3\).*shape \(1, 3\)"):
        kernel.assign_sub(np.ones((1, 3), np.float32))
    assert kernel.numpy().tolist() == [[0.0] * 3] * 3
    bias = distrib.Variable(np.zeros(3, np.float32), name="bias")
    with pytest.raises(ValueError, match=r"needs a value of shape \(3,\).*'bias'.*shape \(1, 1, 1\)"):
        bias.assign_add(np.ones((1, 1, 1), np.float32))  # before: NumPy's own message
    with pytest.raises(ValueError, match=r"shape \(1,\)"):
        bias.assign(np.ones(1, np.float32))
    bias.assign_add(np.float32(2))  # a scalar fills every element
    kernel.assign(1.0)
    assert bias.numpy().tolist() == [2.0] * 3 and kernel.numpy().tolist() == [[1.0] * 3] * 3


def test_a_replica_writing_another_shape_into_a_mirrored_variable_is_refused(strategy):
    with strategy.scope():
        v = distrib.Variable(np.zeros((2, 2), np.float32), aggregation="MEAN", name="w")
    # before: each replica's (2, 1) was averaged, then broadcast into every row
    with pytest.raises(ValueError, match=r"needs a value of shape \(2, 2\).*'w'.*shape \(2, 1\)"):
        strategy.run(lambda: v.assign_add(np.ones((2, 1), np.float32)))
    with pytest.raises(ValueError, match=r"needs a value of shape \(2, 2\).*shape \(2,\)"):
        v.assign(np.ones(2, np.float32))
    assert copies(v) == [[[0.0, 0.0], [0.0, 0.0]]] * 3


# -- 5. a dtype that cannot hold the initial value is refused ----------------------------------------------------


@pytest.mark.parametrize("value, dtype, source", [
    (0.5, np.int32, "float64"),  # before: 0
    ([-1.0], np.uint8, "float64"),  # before: [255]
    (1 + 2j, np.float32, "complex128"),  # before: 1.0
    ([0.5], bool, "float64"),  # before: [True]
    ([1], bool, "int64"),
    (1 + 2j, ml_dtypes.bfloat16, "complex128"),
])
def test_variable_refuses_a_dtype_that_cannot_hold_its_value(value, dtype, source):
    name = np.dtype(dtype).name
    with pytest.raises(TypeError, match=rf"Variable\(dtype={name}\) cannot convert a value of dtype {source}"):
        distrib.Variable(value, dtype=dtype)


def test_a_dtype_that_can_hold_the_value_is_taken_in_scope_too(strategy):
    assert distrib.Variable([1, 2], dtype=np.uint8).numpy().tolist() == [1, 2]  # integers that fit
    assert distrib.Variable(3, dtype=np.float32).dtype == np.float32
    assert distrib.Variable(True, dtype=np.int32).numpy() == 1
    with pytest.raises(TypeError, match=r"cannot write integers outside uint8's range"):
        distrib.Variable([-1], dtype=np.uint8)
    with strategy.scope():
        with pytest.raises(TypeError, match=r"Variable\(dtype=int32\) cannot convert a value of dtype float64"):
            distrib.Variable(2.7, dtype=np.int32)  # before: 2
        assert distrib.Variable(2.0, dtype=np.float16).dtype == np.float16


def test_writes_convert_integers_of_either_sign_that_fit_and_no_complex_into_bfloat16():
    counts = distrib.Variable(np.zeros(2, np.uint8))
    counts.assign([1, 2])  # before: "cannot write dtype int64" for Python integers
    counts.assign_add(np.array([3, 4], np.int64))
    assert counts.numpy().tolist() == [4, 6] and counts.dtype == np.uint8
    with pytest.raises(TypeError, match=r"outside uint8's range"):
        counts.assign([-1, 0])
    half = distrib.Variable(np.zeros(2, ml_dtypes.bfloat16))
    with pytest.raises(TypeError, match=r"cannot write dtype complex64 into variable .* of dtype bfloat16"):
        half.assign(np.array([1 + 2j, 0], np.complex64))  # before: the imaginary part dropped


# -- 6. operators --------------------------------------------------------------------------------------------------


def test_comparison_power_floor_division_modulo_abs_and_conversions(strategy):
    with strategy.scope():
        m = distrib.Variable(np.array([1.0, 4.0], np.float32))
    p = distrib.Variable(np.float32(3.0))
    for v in (m, strategy.experimental_local_results(m)[1]):
        assert (v < 2).tolist() == [True, False] and (v <= 1).tolist() == [True, False]
        assert (v > 2).tolist() == [False, True] and (v >= 4).tolist() == [False, True]
        assert (v ** 2).tolist() == [1.0, 16.0] and (2 ** v).tolist() == [2.0, 16.0]
        assert (v // 3).tolist() == [0.0, 1.0] and (9 // v).tolist() == [9.0, 2.0]
        assert (v % 3).tolist() == [1.0, 1.0] and (9 % v).tolist() == [0.0, 1.0]
        assert abs(-v).tolist() == [1.0, 4.0]
    assert (float(p), int(p), complex(p)) == (3.0, 3, 3 + 0j)
    assert isinstance(float(p), float) and isinstance(int(p), int)
    assert strategy.experimental_local_results(strategy.run(lambda: float(m[1]) + int(m[0]))) == (5.0,) * 3


# -- 7. 8. 9. trainable with ON_READ, .device, MEAN of complex numbers -------------------------------------------


def test_a_plain_on_read_variable_is_not_trainable_by_default():
    assert distrib.Variable(1.0, synchronization=ON_READ).trainable is False  # before: True
    assert distrib.Variable(1.0, synchronization=ON_READ, trainable=True).trainable is True
    assert distrib.Variable(1.0).trainable is True


def test_a_distributed_variable_has_the_device_of_its_closest_copy(strategy):
    with strategy.scope():
        m = distrib.Variable(np.float32(1.0))
        s = distrib.Variable(np.float32(0.0), synchronization=ON_READ, aggregation="SUM")
    assert m.device == s.device == "CPU:0"  # before: AttributeError
    assert strategy.experimental_local_results(strategy.run(lambda: (m.device, s.device))) == tuple(
        (d, d) for d in DEVICES)
    updated = strategy.extended.update(m, lambda component: m.device, group=False)
    assert strategy.experimental_local_results(updated) == DEVICES


def test_mean_aggregation_refuses_complex_variables(strategy):
    with strategy.scope():
        # before: created, although TensorFlow's MEAN needs dtype.is_floating
        with pytest.raises(ValueError, match=r"aggregation MEAN needs a floating-point variable. Received: dtype "
                                             r"complex64"):
            distrib.Variable(np.complex64(1), aggregation="MEAN")
        with pytest.raises(ValueError, match=r"aggregation MEAN needs a floating-point variable"):
            distrib.Variable(np.complex128(1), synchronization=ON_READ, aggregation=VariableAggregation.MEAN)
        total = distrib.Variable(np.complex64(0), aggregation="SUM")
        distrib.Variable(np.float16(0), aggregation="MEAN")
    strategy.run(lambda: total.assign_add(np.complex64(1j * (replica_id() + 1))))
    assert copies(total) == [6j] * 3
