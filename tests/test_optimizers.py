"""Optimizers: SGD and Adam math, MEAN across replicas, data-parallel training, slots, iterations and errors."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import distrib
from distrib import optimizers

pytestmark = pytest.mark.timeout(60)

FOUR = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
TOLERANCE = {np.float32: dict(rtol=1e-5, atol=1e-6), np.float64: dict(rtol=1e-10, atol=1e-12)}


@pytest.fixture(scope="module")
def strategies():
    """One and four emulated replicas, shared by the module's tests (their replica threads stay alive)."""
    return {1: distrib.MirroredStrategy(["CPU:0"]), 4: distrib.MirroredStrategy(FOUR)}


# -- the NumPy reference ---------------------------------------------------------------------------------


def reference_sgd(var, grads, learning_rate, momentum=0.0, nesterov=False):
    """Keras's SGD in float64, one step per gradient."""
    var, m = var.astype(np.float64), np.zeros(var.shape)
    for g in grads:
        if not momentum:
            var = var - learning_rate * g
            continue
        m = momentum * m - learning_rate * g
        var = var + (momentum * m - learning_rate * g if nesterov else m)
    return var


def reference_adam(var, grads, learning_rate, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """Keras's Adam in float64, one step per gradient."""
    var, m, v = var.astype(np.float64), np.zeros(var.shape), np.zeros(var.shape)
    for t, g in enumerate(grads, start=1):
        lr_t = learning_rate * np.sqrt(1 - beta_2 ** t) / (1 - beta_1 ** t)
        m = beta_1 * m + (1 - beta_1) * g
        v = beta_2 * v + (1 - beta_2) * g * g
        var = var - lr_t * m / (np.sqrt(v) + epsilon)
    return var


CONFIGS = {
    "sgd": (lambda: optimizers.SGD(learning_rate=0.1), lambda w, gs: reference_sgd(w, gs, 0.1)),
    "momentum": (lambda: optimizers.SGD(learning_rate=0.1, momentum=0.9),
                 lambda w, gs: reference_sgd(w, gs, 0.1, 0.9)),
    "nesterov": (lambda: optimizers.SGD(learning_rate=0.1, momentum=0.9, nesterov=True),
                 lambda w, gs: reference_sgd(w, gs, 0.1, 0.9, nesterov=True)),
    "adam": (lambda: optimizers.Adam(learning_rate=0.01), lambda w, gs: reference_adam(w, gs, 0.01)),
}


def make_variables(strategy, initial_values):
    with strategy.scope():
        return [distrib.Variable(value, name=f"w{k}") for k, value in enumerate(initial_values)]


def apply_in_replicas(strategy, opt, variables, per_replica_grads):
    """One step: replica r applies `per_replica_grads(r)`, a list with one gradient per variable."""

    def step():
        replica = distrib.get_replica_context().replica_id_in_sync_group
        opt.apply_gradients(zip(per_replica_grads(replica), variables))

    strategy.run(step)


def assert_every_copy(variable, expected, dtype):
    for component in variable.values:
        np.testing.assert_allclose(component.numpy(), expected, **TOLERANCE[dtype])


# -- the update math ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("replicas", [1, 4])
def test_update_matches_the_numpy_reference(strategies, config, dtype, replicas):
    strategy, (make_optimizer, reference) = strategies[replicas], CONFIGS[config]
    rng = np.random.default_rng(0)
    initial = [rng.standard_normal((3, 4)).astype(dtype), rng.standard_normal(5).astype(dtype)]
    steps = [[rng.standard_normal(w.shape).astype(dtype) for w in initial] for _ in range(5)]
    with strategy.scope():
        opt = make_optimizer()
    variables = make_variables(strategy, initial)
    for grads in steps:  # every replica passes its own copy of the same gradients
        apply_in_replicas(strategy, opt, variables, lambda r, grads=grads: [g.copy() for g in grads])
    for k, var in enumerate(variables):
        assert var.dtype == dtype
        assert_every_copy(var, reference(initial[k], [grads[k] for grads in steps]), dtype)
    assert int(opt.iterations.numpy()) == len(steps)


def test_sgd_without_momentum_has_no_slots(strategies):
    variables = make_variables(strategies[4], [np.ones(3, np.float32)])
    opt = optimizers.SGD(learning_rate=0.5)
    apply_in_replicas(strategies[4], opt, variables, lambda r: [np.ones(3, np.float32)])
    assert opt.get_slot_names() == []
    assert opt.variables() == [opt.iterations]
    np.testing.assert_array_equal(variables[0].numpy(), [0.5, 0.5, 0.5])


def test_learning_rate_can_change_between_steps(strategies):
    strategy = strategies[4]
    (w,) = make_variables(strategy, [np.zeros(2, np.float32)])
    opt = optimizers.SGD(learning_rate=1.0)
    apply_in_replicas(strategy, opt, [w], lambda r: [np.ones(2, np.float32)])
    opt.learning_rate = 0.25
    apply_in_replicas(strategy, opt, [w], lambda r: [np.ones(2, np.float32)])
    assert opt.learning_rate == 0.25
    assert_every_copy(w, [-1.25, -1.25], np.float32)


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_16_bit_float_variables_get_float32_slots(strategies, half):
    half = np.dtype(pytest.importorskip("ml_dtypes").bfloat16 if half == "bfloat16" else half)
    strategy = strategies[4]
    initial = np.linspace(-1, 1, 6).astype(half)
    (w,) = make_variables(strategy, [initial])
    opt = optimizers.Adam(learning_rate=0.01)
    grads = [np.full(6, 0.5 + k, half) for k in range(3)]
    for g in grads:
        apply_in_replicas(strategy, opt, [w], lambda r, g=g: [g.copy()])
    assert w.dtype == half
    assert opt.get_slot(w, "m").dtype == opt.get_slot(w, "v").dtype == np.float32
    expected = reference_adam(initial.astype(np.float32), [g.astype(np.float32) for g in grads], 0.01)
    for component in w.values:  # bfloat16 keeps 8 bits of mantissa: within 2**-7 of the float32 result
        np.testing.assert_allclose(component.numpy().astype(np.float32), expected, rtol=2**-7, atol=1e-3)


# -- MEAN across replicas -----------------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["momentum", "adam"])
def test_four_replicas_apply_the_mean_of_their_gradients(strategies, config):
    make_optimizer, _ = CONFIGS[config]
    rng = np.random.default_rng(1)
    initial = rng.standard_normal((4, 3)).astype(np.float32)
    steps = [rng.standard_normal((4, 4, 3)).astype(np.float32) for _ in range(4)]  # [replica] per step
    four, one = make_variables(strategies[4], [initial]), make_variables(strategies[1], [initial])
    opt_four, opt_one = make_optimizer(), make_optimizer()
    for grads in steps:
        apply_in_replicas(strategies[4], opt_four, four, lambda r, grads=grads: [grads[r]])
        apply_in_replicas(strategies[1], opt_one, one, lambda r, grads=grads: [grads.mean(axis=0)])
    assert_every_copy(four[0], one[0].numpy(), np.float32)


def test_cross_replica_apply_reduces_a_per_replica_gradient(strategies):
    strategy = strategies[4]
    (w,) = make_variables(strategy, [np.zeros(3, np.float32)])
    opt = optimizers.SGD(learning_rate=1.0)
    grad = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(3, ctx.replica_id_in_sync_group, np.float32))  # 0, 1, 2, 3: mean 1.5
    with strategy.scope():
        opt.apply_gradients([(grad, w)])
        opt.apply_gradients([(np.ones(3, np.float32), w)])  # one value: applied to every copy as it is
    assert_every_copy(w, [-2.5, -2.5, -2.5], np.float32)
    assert int(opt.iterations.numpy()) == 2


def test_without_a_strategy_gradients_apply_directly():
    w = distrib.Variable(np.ones(2, np.float64), name="w")
    opt = optimizers.SGD(learning_rate=0.1, momentum=0.5)
    for _ in range(3):
        opt.apply_gradients([(np.ones(2), w)])
    np.testing.assert_allclose(w.numpy(), reference_sgd(np.ones(2), [np.ones(2)] * 3, 0.1, 0.5))
    assert type(opt.iterations) is distrib.Variable and int(opt.iterations.numpy()) == 3
    assert type(opt.get_slot(w, "momentum")) is distrib.Variable


def test_one_merge_call_and_one_packed_reduction_per_step(strategies, monkeypatch):
    strategy = strategies[4]
    variables = make_variables(strategy, [np.zeros((2, 2), np.float32), np.zeros(3, np.float32),
                                          np.zeros(4, np.float64)])
    opt = optimizers.Adam()
    merge_calls, reductions, all_reduces = [], [], []
    merge_call = distrib.ReplicaContext.merge_call
    monkeypatch.setattr(distrib.ReplicaContext, "merge_call",
                        lambda self, *a, **kw: merge_calls.append(1) or merge_call(self, *a, **kw))
    batch_reduce_to = strategy.extended.batch_reduce_to
    monkeypatch.setattr(strategy.extended, "batch_reduce_to",
                        lambda op, pairs, *a: reductions.append((op, len(pairs))) or batch_reduce_to(op, pairs, *a))
    ops = strategy.extended._cross_device_ops
    batch_all_reduce = ops.batch_all_reduce
    monkeypatch.setattr(ops, "batch_all_reduce",
                        lambda *a: all_reduces.append(1) or batch_all_reduce(*a))
    apply_in_replicas(strategy, opt, variables, lambda r: [np.ones(v.shape, v.dtype) for v in variables])
    assert len(merge_calls) == 4  # one per replica
    assert reductions == [(distrib.ReduceOp.MEAN, 3)]
    assert len(all_reduces) == 1


# -- the backend's fused update ------------------------------------------------------------------------


MIXED = [np.zeros((2, 2), np.float32), np.zeros(3, np.float16), np.zeros(4, np.float64), np.zeros(5, np.float32)]


@pytest.mark.parametrize("config", CONFIGS)
def test_the_backend_is_offered_each_devices_update_once_per_compute_dtype(strategies, monkeypatch, config):
    strategy, (make_optimizer, _) = strategies[4], CONFIGS[config]
    variables = make_variables(strategy, MIXED)
    opt = make_optimizer()
    offers = []

    def decline(rule, items, coefficients):
        offers.append((rule, [(var, grad.dtype, len(slots)) for var, grad, slots in items], coefficients))
        return False

    monkeypatch.setattr(strategy.extended.backend, "fused_optimizer_update", decline)
    apply_in_replicas(strategy, opt, variables, lambda r: [np.ones(v.shape, v.dtype) for v in variables])
    by_group = {(items[0][0].device, items[0][1]): (rule, items, coefficients) for rule, items, coefficients in offers}
    assert len(offers) == len(by_group) == 2 * len(FOUR)  # float32 (with the float16 variable), float64; per device
    for (device, math), (rule, items, coefficients) in by_group.items():
        members = [0, 1, 3] if math == np.float32 else [2]
        assert rule == config
        assert items == [(variables[m].values[FOUR.index(device)], math, len(opt.slot_names)) for m in members]
        assert coefficients == opt._coefficients(math, 1) and all(c.dtype == math for c in coefficients)
    for var in variables:  # declined: the optimizer applied the update itself
        assert not np.array_equal(var.numpy(), np.zeros(var.shape))


def test_an_update_the_backend_applied_is_not_applied_again(strategies, monkeypatch):
    strategy = strategies[4]
    variables = make_variables(strategy, MIXED)
    opt, reference = optimizers.Adam(learning_rate=0.01), optimizers.Adam(learning_rate=0.01)
    twins = make_variables(strategy, MIXED)

    def apply(rule, items, coefficients):
        opt._update_device(np, items, coefficients)
        return True

    for step in range(3):
        grads = [np.full(v.shape, step + 1.0, v.dtype) for v in variables]
        apply_in_replicas(strategy, reference, twins, lambda r: grads)
        with monkeypatch.context() as patch:
            patch.setattr(strategy.extended.backend, "fused_optimizer_update", apply)
            apply_in_replicas(strategy, opt, variables, lambda r: grads)
    for var, twin in zip(variables, twins):
        for component, expected in zip(var.values, twin.values):
            np.testing.assert_array_equal(component.numpy(), expected.numpy())


def test_the_cpu_backend_leaves_the_update_to_the_optimizer(strategies):
    assert strategies[4].extended.backend.fused_optimizer_update("sgd", [], ()) is False


# -- data-parallel training -----------------------------------------------------------------------------


def mlp_gradients(params, x, y):
    """Gradients of the mean squared error of tanh(x W1 + b1) W2 + b2 over the (local) batch."""
    w1, b1, w2, b2 = params
    hidden = np.tanh(x @ w1 + b1)
    d_out = 2 * (hidden @ w2 + b2 - y) / len(x)
    d_pre = (d_out @ w2.T) * (1 - hidden ** 2)
    return [x.T @ d_pre, d_pre.sum(axis=0), hidden.T @ d_out, d_out.sum(axis=0)]


def train(strategy, make_optimizer, batches, initial):
    with strategy.scope():
        params = [distrib.Variable(value, name=name) for name, value in zip(["w1", "b1", "w2", "b2"], initial)]
        opt = make_optimizer()

    def step(x, y):
        grads = mlp_gradients([p.value() for p in params], x, y)
        opt.apply_gradients(zip(grads, params))

    for x, y in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(x, y))
    assert int(opt.iterations.numpy()) == len(batches)
    return params


@pytest.mark.parametrize("config", ["momentum", "adam"])
def test_four_replicas_train_like_one(strategies, config):
    rng = np.random.default_rng(2)
    initial = [rng.standard_normal((5, 8)).astype(np.float32) * 0.5, np.zeros(8, np.float32),
               rng.standard_normal((8, 1)).astype(np.float32) * 0.5, np.zeros(1, np.float32)]
    x = rng.standard_normal((20 * 32, 5)).astype(np.float32)
    y = (np.sin(x.sum(axis=1, keepdims=True)) + 0.1 * rng.standard_normal((20 * 32, 1))).astype(np.float32)
    batches = [(x[i:i + 32], y[i:i + 32]) for i in range(0, len(x), 32)]  # 20 global batches of 32
    make_optimizer = {"momentum": lambda: optimizers.SGD(learning_rate=0.05, momentum=0.9),
                      "adam": lambda: optimizers.Adam(learning_rate=0.01)}[config]
    one = train(strategies[1], make_optimizer, batches, initial)
    four = train(strategies[4], make_optimizer, batches, initial)
    for p1, p4, start in zip(one, four, initial):
        assert not np.allclose(p1.numpy(), start)  # it trained
        for component in p4.values:
            np.testing.assert_allclose(component.numpy(), p1.numpy(), rtol=1e-5, atol=1e-6)


# -- slots, iterations, variables ----------------------------------------------------------------------


def test_slots_are_mirrored_like_their_variable(strategies):
    strategy = strategies[4]
    (w,) = make_variables(strategy, [np.ones((2, 3), np.float32)])
    with strategy.scope():
        opt = optimizers.Adam()
    apply_in_replicas(strategy, opt, [w], lambda r: [np.ones((2, 3), np.float32)])
    for name in ("m", "v"):
        slot = opt.get_slot(w, name)
        assert isinstance(slot, distrib.MirroredVariable)
        assert slot.name == f"w0/{name}" and slot.devices == w.devices
        assert slot.shape == w.shape and slot.dtype == np.float32 and not slot.trainable
        for component in slot.values[1:]:
            np.testing.assert_array_equal(component.numpy(), slot.values[0].numpy())
    np.testing.assert_allclose(opt.get_slot(w, "m").numpy(), np.full((2, 3), 0.1), rtol=1e-6)
    assert opt.variables() == [opt.iterations, opt.get_slot(w, "m"), opt.get_slot(w, "v")]


def test_iterations_is_a_mirrored_int64_counted_once_per_step(strategies):
    strategy = strategies[4]
    (w,) = make_variables(strategy, [np.zeros(2, np.float32)])
    opt = optimizers.SGD(momentum=0.9, name="opt")
    for _ in range(3):
        apply_in_replicas(strategy, opt, [w], lambda r: [np.ones(2, np.float32)])
    iterations = opt.iterations
    assert isinstance(iterations, distrib.MirroredVariable) and iterations.name == "opt/iterations"
    assert iterations.dtype == np.int64 and iterations.aggregation is distrib.VariableAggregation.ONLY_FIRST_REPLICA
    assert [int(c.numpy()) for c in iterations.values] == [3, 3, 3, 3]


def test_build_creates_slots_before_the_first_step(strategies):
    strategy = strategies[4]
    variables = make_variables(strategy, [np.zeros(2, np.float32), np.zeros(3, np.float32)])
    with strategy.scope():
        opt = optimizers.SGD(momentum=0.9)
        opt.build(variables)
    assert [v.name for v in opt.variables()] == ["SGD/iterations", "w0/momentum", "w1/momentum"]
    assert int(opt.iterations.numpy()) == 0


def test_none_gradients_are_skipped(strategies):
    strategy = strategies[4]
    used, unused = make_variables(strategy, [np.zeros(2, np.float32), np.zeros(2, np.float32)])
    opt = optimizers.SGD(learning_rate=1.0, momentum=0.5)
    with pytest.warns(UserWarning, match=r"Gradients do not exist for variables \['w1'\] when minimizing the "
                                         r"loss") as caught:  # Keras's warning
        apply_in_replicas(strategy, opt, [used, unused], lambda r: [np.ones(2, np.float32), None])
    assert len(caught) == 1  # once per step, not once per replica
    assert_every_copy(used, [-1, -1], np.float32)
    assert_every_copy(unused, [0, 0], np.float32)
    with pytest.raises(KeyError, match="SGD has no slots for variable 'w1' yet"):
        opt.get_slot(unused, "momentum")


# -- sparse gradients (IndexedSlices) --------------------------------------------------------------------


def replica_slices(r):
    """Replica r's rows of a (5, 2) gradient: row r twice (repeats add up) and row 4, which every replica names."""
    return distrib.IndexedSlices(np.array([[1, 2], [3, 4], [5, 6]], np.float32) * (r + 1), np.array([r, r, 4]))


def densified(r):
    dense = np.zeros((5, 2), np.float32)
    np.add.at(dense, replica_slices(r).indices, replica_slices(r).values)
    return dense


@pytest.mark.parametrize("config", ["sgd", "adam"])
def test_indexed_slices_apply_as_their_dense_gradient_for_sgd_and_adam(strategies, config):
    # Keras's sparse SGD (a scatter-add) and Adam (moments decay on every row, the gradient scatters in) equal
    # the dense update of the densified gradient
    strategy, (make_optimizer, _) = strategies[4], CONFIGS[config]
    initial = np.arange(10, dtype=np.float32).reshape(5, 2)
    (sparse_w,) = make_variables(strategy, [initial])
    (dense_w,) = make_variables(strategy, [initial])
    sparse_opt, dense_opt = make_optimizer(), make_optimizer()
    for _ in range(3):
        apply_in_replicas(strategy, sparse_opt, [sparse_w], lambda r: [replica_slices(r)])
        apply_in_replicas(strategy, dense_opt, [dense_w], lambda r: [densified(r)])
    assert_every_copy(sparse_w, dense_w.numpy(), np.float32)
    if config == "adam":
        assert_every_copy(sparse_opt.get_slot(sparse_w, "v"), dense_opt.get_slot(dense_w, "v").numpy(), np.float32)


@pytest.mark.parametrize("nesterov", [False, True])
def test_indexed_slices_with_momentum_update_only_the_rows_some_replica_names(strategies, nesterov):
    # Keras's ResourceSparseApplyKerasMomentum: other rows keep their momentum and their weights
    strategy = strategies[4]
    initial = np.arange(10, dtype=np.float32).reshape(5, 2)
    (w,) = make_variables(strategy, [initial])
    opt = optimizers.SGD(learning_rate=0.1, momentum=0.9, nesterov=nesterov)
    apply_in_replicas(strategy, opt, [w], lambda r: [np.ones((5, 2), np.float32)])  # momentum on every row
    apply_in_replicas(strategy, opt, [w], lambda r: [replica_slices(r) if r < 2 else
                                                     distrib.IndexedSlices(np.ones((1, 2), np.float32), [4])])
    expected, m = initial.astype(np.float64), np.zeros((5, 2))
    for g, rows in [(np.ones((5, 2)), [0, 1, 2, 3, 4]), (sum(densified(r) for r in range(2)) / 4, [0, 1, 4])]:
        if rows == [0, 1, 4]:
            g[4] = (densified(0)[4] + densified(1)[4] + 2) / 4
        m[rows] = 0.9 * m[rows] - 0.1 * g[rows]
        expected[rows] += 0.9 * m[rows] - 0.1 * g[rows] if nesterov else m[rows]
    assert_every_copy(w, expected, np.float32)
    assert_every_copy(opt.get_slot(w, "momentum"), m, np.float32)


def test_a_dense_gradient_on_any_replica_makes_a_momentum_update_dense(strategies):
    strategy = strategies[4]
    (w,) = make_variables(strategy, [np.zeros((5, 2), np.float32)])
    opt = optimizers.SGD(learning_rate=1.0, momentum=0.5)
    apply_in_replicas(strategy, opt, [w], lambda r: [np.ones((5, 2), np.float32)])
    # replica 0's zeros name no row, yet its dense gradient decays row 0's momentum and moves it
    apply_in_replicas(strategy, opt, [w], lambda r: [replica_slices(r) if r else np.zeros((5, 2), np.float32)])
    mean = sum(densified(r) for r in range(1, 4)) / 4
    expected = reference_sgd(np.zeros((5, 2)), [np.ones((5, 2)), mean], 1.0, 0.5)
    assert_every_copy(w, expected, np.float32)


def test_indexed_slices_cross_replica_and_without_a_strategy(strategies):
    strategy = strategies[4]
    (w,) = make_variables(strategy, [np.zeros((5, 2), np.float32)])
    opt = optimizers.SGD(learning_rate=1.0)
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: replica_slices(ctx.replica_id_in_sync_group))
    with strategy.scope():
        opt.apply_gradients([(per_replica, w)])
    assert_every_copy(w, -sum(densified(r) for r in range(4)) / 4, np.float32)
    plain = distrib.Variable(np.zeros((5, 2), np.float64), name="plain")
    optimizers.Adam(learning_rate=0.5).apply_gradients([(replica_slices(0), plain)])
    np.testing.assert_allclose(plain.numpy(), reference_adam(np.zeros((5, 2)), [densified(0)], 0.5))


def test_indexed_slices_are_checked_like_scatters(strategies):
    strategy = strategies[4]
    (w,) = make_variables(strategy, [np.zeros((5, 2), np.float32)])
    opt = optimizers.Adam()
    cases = [(IndexError, r"apply_gradients needs indices in \[0, 5\) for variable 'w0'. Received: index 5",
              distrib.IndexedSlices(np.ones((1, 2), np.float32), np.array([5]))),
             (TypeError, r"apply_gradients needs integer indices for variable 'w0'. Received: dtype float64",
              distrib.IndexedSlices(np.ones((1, 2), np.float32), np.array([0.0]))),
             (ValueError, r"needs values of shape indices.shape \+ variable.shape\[1:\] = \(1, 2\) for variable "
                          r"'w0'. Received: shape \(1, 3\)",
              distrib.IndexedSlices(np.ones((1, 3), np.float32), np.array([0]))),
             (TypeError, r"A gradient must hold floating-point numbers for variable 'w0' of dtype float32. "
                         r"Received: dtype complex64",
              distrib.IndexedSlices(np.ones((1, 2), np.complex64), np.array([0])))]
    for error, message, slices in cases:
        with pytest.raises(error, match=message):
            apply_in_replicas(strategy, opt, [w], lambda r, slices=slices: [slices])
    assert_every_copy(w, np.zeros((5, 2)), np.float32)


# -- gradients aggregated already --------------------------------------------------------------------------


@pytest.mark.parametrize("flag", [dict(skip_gradients_aggregation=True), dict(experimental_aggregate_gradients=False)])
def test_aggregated_gradients_apply_as_they_are_on_each_copy(strategies, monkeypatch, flag):
    strategy = strategies[4]
    (w,) = make_variables(strategy, [np.zeros(3, np.float32)])
    opt = optimizers.SGD(learning_rate=1.0)
    reductions = []
    batch_reduce_to = strategy.extended.batch_reduce_to
    monkeypatch.setattr(strategy.extended, "batch_reduce_to",
                        lambda op, pairs, *a: reductions.append(op) or batch_reduce_to(op, pairs, *a))

    def step():  # each replica holds the SUM already, say; no MEAN of it follows
        opt.apply_gradients([(np.full(3, 4.0, np.float32), w)], name="ignored", **flag)

    strategy.run(step)
    assert reductions == []
    assert_every_copy(w, [-4, -4, -4], np.float32)
    # each copy takes its own replica's gradient, as TensorFlow's extended.update(var, fn, args=(grad,)) does
    strategy.run(lambda: opt.apply_gradients(
        [(np.full(3, distrib.get_replica_context().replica_id_in_sync_group, np.float32), w)], **flag))
    assert [c.numpy()[0] for c in w.values] == [-4, -5, -6, -7]


def test_apply_gradients_accepts_a_name(strategies):
    (w,) = make_variables(strategies[4], [np.zeros(2, np.float32)])
    with strategies[4].scope():
        optimizers.SGD(learning_rate=1.0).apply_gradients([(np.ones(2, np.float32), w)], name="step")
    assert_every_copy(w, [-1, -1], np.float32)


def test_repr():
    assert repr(optimizers.SGD(momentum=0.9)) == \
        "<SGD name='SGD' learning_rate=0.01 momentum=0.9 nesterov=False>"
    assert repr(optimizers.Adam()) == \
        "<Adam name='Adam' learning_rate=0.001 beta_1=0.9 beta_2=0.999 epsilon=1e-07>"


# -- errors ------------------------------------------------------------------------------------------------


def test_one_gradient_per_variable(strategies):
    variables = make_variables(strategies[4], [np.zeros(2, np.float32)])
    with pytest.raises(ValueError, match="apply needs one gradient per variable. Received: 2 gradients for 1"):
        optimizers.SGD().apply([np.ones(2), np.ones(2)], variables)
    with pytest.raises(TypeError, match="apply_gradients needs \\(gradient, variable\\) pairs"):
        optimizers.SGD().apply_gradients([(np.ones(2),)])


def test_gradient_shapes_must_match_in_a_replica(strategies):
    strategy = strategies[4]
    (w,) = make_variables(strategy, [np.zeros((2, 3), np.float32)])
    opt = optimizers.SGD()
    with pytest.raises(ValueError, match=r"A gradient must have its variable's shape. Received: shape \(3, 2\) "
                                         r"for variable 'w0' of shape \(2, 3\)"):
        apply_in_replicas(strategy, opt, [w], lambda r: [np.ones((3, 2), np.float32)])
    assert_every_copy(w, np.zeros((2, 3)), np.float32)


def test_gradients_of_numbers_that_are_not_floats_are_refused(strategies):
    # a cast would drop imaginary parts and take bools and ints for numbers; TF2's Keras refuses dtypes that are
    # not the variable's (distrib, like Keras 3, still casts one floating-point dtype to another)
    strategy = strategies[4]
    (w,) = make_variables(strategy, [np.zeros(2, np.float32)])
    opt = optimizers.SGD(learning_rate=1.0)
    for grad, dtype in [(np.ones(2, np.complex64), "complex64"), (np.ones(2, bool), "bool"),
                        (np.ones(2, np.int32), "int32"), (np.array([object(), object()]), "object"),
                        ({"a": 1}, "object")]:
        with pytest.raises(TypeError, match=f"A gradient must hold floating-point numbers for variable 'w0' of "
                                            f"dtype float32. Received: dtype {dtype}"):
            apply_in_replicas(strategy, opt, [w], lambda r, grad=grad: [grad])
    apply_in_replicas(strategy, opt, [w], lambda r: [np.ones(2, np.float64)])
    apply_in_replicas(strategy, opt, [w], lambda r: [[1.0, 1.0]])
    assert_every_copy(w, [-2, -2], np.float32)


def test_a_ragged_list_gradient_is_refused(strategies):
    strategy = strategies[4]
    (w,) = make_variables(strategy, [np.zeros((2, 2), np.float32)])
    with pytest.raises(TypeError, match="A gradient must be an array of numbers for variable 'w0'. Received: a "
                                        "ragged list"):
        apply_in_replicas(strategy, optimizers.Adam(), [w], lambda r: [[[1.0], [1.0, 2.0]]])


def test_all_none_gradients(strategies):
    variables = make_variables(strategies[4], [np.zeros(2, np.float32)])
    with pytest.raises(ValueError, match=r"No gradients provided for any variable: \['w0'\]"):
        apply_in_replicas(strategies[4], optimizers.SGD(), variables, lambda r: [None])


def test_variables_of_another_strategy(strategies):
    (mirrored,) = make_variables(strategies[4], [np.zeros(2, np.float32)])
    plain = distrib.Variable(np.zeros(2, np.float32), name="plain")
    with pytest.raises(ValueError, match="Optimizers update variables of the strategy they run under"):
        apply_in_replicas(strategies[1], optimizers.SGD(), [mirrored], lambda r: [np.ones(2, np.float32)])
    with pytest.raises(ValueError, match="Optimizers update variables of the strategy they run under"):
        optimizers.SGD().apply_gradients([(np.ones(2, np.float32), mirrored)])  # outside its scope
    with pytest.raises(ValueError, match="Optimizers update variables of the strategy they run under"):
        apply_in_replicas(strategies[4], optimizers.SGD(), [plain], lambda r: [np.ones(2, np.float32)])


def test_one_optimizer_per_strategy(strategies):
    opt = optimizers.SGD(momentum=0.9)
    apply_in_replicas(strategies[4], opt, make_variables(strategies[4], [np.zeros(2, np.float32)]),
                      lambda r: [np.ones(2, np.float32)])
    with pytest.raises(ValueError, match="SGD keeps its iterations and slots on <MirroredStrategy"):
        apply_in_replicas(strategies[1], opt, make_variables(strategies[1], [np.zeros(2, np.float32)]),
                          lambda r: [np.ones(2, np.float32)])


def test_what_is_not_a_float_variable(strategies):
    with pytest.raises(TypeError, match="Optimizers update distrib variables. Received: ndarray at position 0"):
        optimizers.SGD().apply_gradients([(np.ones(2), np.zeros(2))])
    counter = distrib.Variable(np.zeros(2, np.int64), name="counter")
    with pytest.raises(TypeError, match="Optimizers update floating-point variables. Received: variable 'counter'"):
        optimizers.SGD().apply_gradients([(np.ones(2), counter)])
    with strategies[4].scope():
        metric = distrib.Variable(np.zeros(2, np.float32), name="metric", synchronization="ON_READ")
        with pytest.raises(TypeError, match="Optimizers update MirroredVariables. Received: SyncOnReadVariable"):
            optimizers.SGD().apply_gradients([(np.ones(2, np.float32), metric)])


def test_get_slot_with_an_unknown_name():
    with pytest.raises(ValueError, match=r"Adam has slots \['m', 'v'\]. Received: 'momentum'"):
        optimizers.Adam().get_slot(distrib.Variable(np.zeros(1)), "momentum")


@pytest.mark.parametrize("make, error, message", [
    (lambda: optimizers.SGD(momentum=1.5), ValueError, r"momentum must be in \[0, 1\]. Received: 1.5"),
    (lambda: optimizers.Adam(beta_1=1.0), ValueError, r"beta_1 must be in \[0, 1\). Received: 1.0"),
    (lambda: optimizers.SGD(learning_rate=-0.1), ValueError, r"learning_rate must be in \[0, inf\)"),
    (lambda: optimizers.SGD(learning_rate="0.1"), TypeError, "learning_rate must be a number. Received: str"),
])
def test_hyperparameters_are_checked(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_replicas_run_apply_gradients_concurrently_without_losing_steps(strategies):
    """The merge runs once per step however the replica threads interleave."""
    strategy = strategies[4]
    (w,) = make_variables(strategy, [np.zeros(1, np.float64)])
    opt = optimizers.SGD(learning_rate=1.0)
    threads_seen = set()

    def grads(replica):
        threads_seen.add(threading.current_thread().name)
        return [np.ones(1)]

    for _ in range(10):
        apply_in_replicas(strategy, opt, [w], grads)
    assert len(threads_seen) == 4
    assert_every_copy(w, [-10.0], np.float64)


def test_a_fresh_optimizer_resumes_from_a_checkpoint_before_its_first_step(tmp_path):
    """`--resume` restores into an optimizer that has no slots yet: they must arrive when it builds them."""
    def train(strategy, optimizer, var, steps):
        grads = strategy.experimental_distribute_values_from_function(
            lambda ctx: np.full(3, ctx.replica_id_in_sync_group + 1.0, np.float32))
        for _ in range(steps):
            strategy.run(lambda g: optimizer.apply_gradients([(g, var)]), args=(grads,))

    four = distrib.MirroredStrategy([f"CPU:{i}" for i in range(4)])
    with four.scope():
        var = distrib.Variable(np.ones(3, np.float32), name="w")
    adam = distrib.optimizers.Adam(0.1)
    train(four, adam, var, 3)
    path = distrib.Checkpoint(w=var, opt=adam).save(str(tmp_path / "ckpt"))
    train(four, adam, var, 2)
    uninterrupted = var.numpy()

    two = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    with two.scope():
        resumed_var = distrib.Variable(np.zeros(3, np.float32), name="w")
    resumed = distrib.optimizers.Adam(0.1)
    distrib.Checkpoint(w=resumed_var, opt=resumed).restore(path)
    grads = two.experimental_distribute_values_from_function(  # the same mean gradient, 2.5, as on 4 replicas
        lambda ctx: np.full(3, 2.0 + ctx.replica_id_in_sync_group, np.float32))
    for _ in range(2):
        two.run(lambda g: resumed.apply_gradients([(g, resumed_var)]), args=(grads,))
    assert int(resumed.iterations.numpy()) == 5
    np.testing.assert_allclose(resumed_var.numpy(), uninterrupted, rtol=1e-6)


def test_restoring_into_the_same_optimizer_rewinds_the_step_its_bias_correction_uses(tmp_path):
    """Adam keeps the step count on the host between its own steps; a restore (a write it did not make) rewinds it."""
    two = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    with two.scope():
        var = distrib.Variable(np.ones(3, np.float32), name="w")
    adam = distrib.optimizers.Adam(0.1)
    grads = two.experimental_distribute_values_from_function(
        lambda ctx: np.full(3, ctx.replica_id_in_sync_group + 1.0, np.float32))

    def train(steps):
        for _ in range(steps):
            two.run(lambda g: adam.apply_gradients([(g, var)]), args=(grads,))
        return var.numpy()

    train(3)
    checkpoint = distrib.Checkpoint(w=var, opt=adam)
    path = checkpoint.save(str(tmp_path / "ckpt"))
    first = train(2)
    checkpoint.restore(path)
    assert int(adam.iterations.numpy()) == 3
    np.testing.assert_array_equal(train(2), first)


def test_an_assigned_iterations_count_is_the_one_the_next_step_uses():
    one = distrib.MirroredStrategy(["CPU:0"])
    grads = one.experimental_distribute_values_from_function(lambda ctx: np.full(3, 0.5, np.float32))

    def adam_step_from_ones(adam, var):
        with one.scope():
            var.assign(np.ones(3, np.float32))
            for slot in ("m", "v"):
                adam.get_slot(var, slot).assign(np.zeros(3, np.float32))
        adam.iterations.assign(np.int64(100))
        one.run(lambda g: adam.apply_gradients([(g, var)]), args=(grads,))
        return var.numpy()

    with one.scope():
        used, fresh = distrib.Variable(np.ones(3, np.float32)), distrib.Variable(np.ones(3, np.float32))
        stepped, unstepped = distrib.optimizers.Adam(0.1), distrib.optimizers.Adam(0.1)
        unstepped.build([fresh])
    one.run(lambda g: stepped.apply_gradients([(g, used)]), args=(grads,))  # counts step 1 on the host
    expected = reference_adam(np.ones(3), [np.zeros(3)] * 100 + [np.full(3, 0.5)], 0.1)
    np.testing.assert_allclose(adam_step_from_ones(stepped, used), expected, rtol=1e-6)
    np.testing.assert_array_equal(adam_step_from_ones(stepped, used), adam_step_from_ones(unstepped, fresh))


# -- learning-rate schedules --------------------------------------------------------------------------------

schedules = optimizers.schedules
STEPS = [0, 1, 5, 9, 10, 11, 25, 99, 100, 101, 1000]


def keras_exponential(step, initial, decay_steps, rate, staircase):
    """keras/optimizers/schedules/learning_rate_schedule.py: initial * rate ** p, p = step / decay_steps (floored)."""
    p = step / decay_steps
    return initial * rate ** (np.floor(p) if staircase else p)


def keras_piecewise(step, boundaries, values):
    """values[0] for step <= boundaries[0], values[i] for boundaries[i-1] < step <= boundaries[i], then values[-1]."""
    if step <= boundaries[0]:
        return values[0]
    if step > boundaries[-1]:
        return values[-1]
    return next(v for low, high, v in zip(boundaries, boundaries[1:], values[1:-1]) if low < step <= high)


def keras_cosine(step, initial, decay_steps, alpha):
    fraction = min(step, decay_steps) / decay_steps
    return initial * ((1 - alpha) * 0.5 * (1 + np.cos(np.pi * fraction)) + alpha)


@pytest.mark.parametrize("staircase", [False, True])
def test_exponential_decay_is_keras_formula(staircase):
    schedule = schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.96, staircase=staircase)
    for step in STEPS:
        np.testing.assert_allclose(schedule(step), keras_exponential(step, 0.1, 10, 0.96, staircase), rtol=1e-12)
    assert schedule(19) == (schedule(10) if staircase else schedule(19)) and (schedule(19) < schedule(10)) != staircase


def test_piecewise_constant_decay_is_keras_formula():
    schedule = schedules.PiecewiseConstantDecay([10, 100], [1.0, 0.5, 0.1])
    for step in STEPS:
        assert schedule(step) == keras_piecewise(step, [10, 100], [1.0, 0.5, 0.1])
    assert [schedule(s) for s in (10, 11, 100, 101)] == [1.0, 0.5, 0.5, 0.1]  # intervals closed on the right
    assert schedules.PiecewiseConstantDecay([5], [2.0, 3.0])(np.int64(6)) == 3.0


@pytest.mark.parametrize("alpha", [0.0, 0.1])
def test_cosine_decay_is_keras_formula(alpha):
    schedule = schedules.CosineDecay(0.5, decay_steps=100, alpha=alpha)
    for step in STEPS:
        np.testing.assert_allclose(schedule(step), keras_cosine(step, 0.5, 100, alpha), rtol=1e-12, atol=1e-15)
    assert schedule(100) == schedule(1000) == pytest.approx(0.5 * alpha)


@pytest.mark.parametrize("make, error, message", [
    (lambda: schedules.ExponentialDecay(0.1, 0, 0.9), ValueError, "decay_steps must be > 0. Received: 0"),
    (lambda: schedules.CosineDecay(0.1, -5), ValueError, "decay_steps must be > 0. Received: -5"),
    (lambda: schedules.ExponentialDecay("0.1", 10, 0.9), TypeError, "initial_learning_rate must be a finite number"),
    (lambda: schedules.PiecewiseConstantDecay([1, 2], [1.0, 0.5]), ValueError,
     "The length of boundaries should be 1 less than the length of values"),
    (lambda: schedules.PiecewiseConstantDecay([2, 1], [1.0, 0.5, 0.1]), ValueError,
     r"boundaries must be strictly increasing. Received: \[2, 1\]"),
])
def test_schedule_arguments_are_checked(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_schedules_import_as_a_module():
    from distrib.optimizers.schedules import CosineDecay
    assert CosineDecay is schedules.CosineDecay and "schedules" in optimizers.__all__


def scheduled_rates(schedule, steps):
    return [schedule(step) for step in range(steps)]  # step t uses the schedule at iterations = t before it


@pytest.mark.parametrize("config", ["momentum", "adam"])
def test_a_schedule_over_several_steps_on_four_replicas_matches_numpy(strategies, config):
    strategy = strategies[4]
    schedule = schedules.PiecewiseConstantDecay([1, 3], [0.1, 0.05, 0.01])
    rng = np.random.default_rng(1)
    initial = rng.standard_normal((3, 4))
    steps = [[rng.standard_normal((3, 4)) for _ in range(4)] for _ in range(5)]  # per step, one per replica
    with strategy.scope():
        opt = (optimizers.SGD(schedule, momentum=0.9) if config == "momentum" else optimizers.Adam(schedule))
    assert opt.learning_rate == 0.1 and opt.schedule is schedule
    (w,) = make_variables(strategy, [initial])
    for step, grads in enumerate(steps):
        apply_in_replicas(strategy, opt, [w], lambda r, grads=grads: [grads[r]])
        assert opt.learning_rate == schedule(step + 1)  # the next step's rate, as Keras 3 reads it
    # the NumPy reference, by hand: the MEAN of the replicas' gradients, the schedule's rate at each step
    var, m, v = initial.copy(), np.zeros((3, 4)), np.zeros((3, 4))
    for t, (grads, lr) in enumerate(zip(steps, scheduled_rates(schedule, len(steps))), start=1):
        g = np.mean(grads, axis=0)
        if config == "momentum":
            m = 0.9 * m - lr * g
            var = var + m
        else:
            m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
            var = var - lr * np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t) * m / (np.sqrt(v) + 1e-7)
    assert_every_copy(w, var, np.float64)


def test_a_callable_schedule_is_called_once_per_step_with_iterations(strategies):
    strategy, calls = strategies[4], []

    def schedule(step):
        calls.append(step)
        return np.float32(1.0 / (step + 1))  # a NumPy scalar is a number too

    (w,) = make_variables(strategy, [np.zeros(2, np.float32)])
    with strategy.scope():
        opt = optimizers.SGD(learning_rate=schedule)
    for _ in range(3):
        apply_in_replicas(strategy, opt, [w], lambda r: [np.ones(2, np.float32)])
    assert calls == [0, 1, 2]
    assert_every_copy(w, [-(1 + 1 / 2 + 1 / 3)] * 2, np.float32)
    with strategy.scope():
        opt.iterations.assign(np.int64(9))  # a rewound or restored count is the step the schedule gets
    apply_in_replicas(strategy, opt, [w], lambda r: [np.ones(2, np.float32)])
    assert calls[-1] == 9


def test_a_checkpoint_restores_the_step_a_schedule_reads(tmp_path, strategies):
    strategy = strategies[4]
    schedule = schedules.ExponentialDecay(0.5, decay_steps=2, decay_rate=0.5)
    (w,) = make_variables(strategy, [np.zeros(2, np.float64)])
    with strategy.scope():
        opt = optimizers.SGD(schedule)
    for _ in range(3):
        apply_in_replicas(strategy, opt, [w], lambda r: [np.ones(2)])
    path = distrib.Checkpoint(w=w, opt=opt).save(str(tmp_path / "ckpt"))
    apply_in_replicas(strategy, opt, [w], lambda r: [np.ones(2)])
    expected = w.numpy()

    (restored_w,) = make_variables(strategy, [np.zeros(2, np.float64)])
    with strategy.scope():
        restored = optimizers.SGD(schedules.ExponentialDecay(0.5, decay_steps=2, decay_rate=0.5))
    distrib.Checkpoint(w=restored_w, opt=restored).restore(path)
    with strategy.scope():
        restored.build([restored_w])  # its iterations get the saved count (else at its first step)
    assert int(restored.iterations.numpy()) == 3 and restored.learning_rate == schedule(3)
    apply_in_replicas(strategy, restored, [restored_w], lambda r: [np.ones(2)])
    assert_every_copy(restored_w, expected, np.float64)
    np.testing.assert_allclose(expected, [-sum(schedule(t) for t in range(4))] * 2)


def test_schedule_refusals(strategies):
    with pytest.raises(TypeError, match="learning_rate must be a number or a schedule: a callable taking the step"):
        optimizers.SGD(learning_rate=lambda: 0.1)  # Keras 3's zero-argument callables are not schedules here
    opt = optimizers.Adam(schedules.CosineDecay(0.1, 10))
    with pytest.raises(TypeError, match="created with a schedule as its `learning_rate`, hence its learning rate is "
                                        "not settable to a number"):
        opt.learning_rate = 0.01
    opt.learning_rate = schedules.CosineDecay(0.2, 10)  # a schedule replaces a schedule, as in Keras
    assert opt.learning_rate == 0.2
    assert repr(opt).startswith("<Adam name='Adam' learning_rate=CosineDecay(initial_learning_rate=0.2")
    strategy = strategies[4]
    (w,) = make_variables(strategy, [np.zeros(2, np.float32)])
    for schedule, error, message in [(lambda step: "0.1", TypeError, "must return a number. Received: str"),
                                     (lambda step: -1.0, ValueError, r"must return a number in \[0, inf\). Received: "
                                                                     r"-1.0 from .* at step 0")]:
        with strategy.scope():
            bad = optimizers.SGD(schedule)
        with pytest.raises(error, match=message):
            apply_in_replicas(strategy, bad, [w], lambda r: [np.ones(2, np.float32)])
    assert_every_copy(w, [0, 0], np.float32)


# -- gradient clipping --------------------------------------------------------------------------------------


def numpy_clip(grads, clipnorm=None, clipvalue=None, global_clipnorm=None):
    """Keras's _clip_gradients in float64: tf.clip_by_norm, tf.clip_by_global_norm or tf.clip_by_value."""
    if clipnorm:
        return [g * clipnorm / max(np.linalg.norm(g), clipnorm) for g in grads]
    if global_clipnorm:
        norm = np.sqrt(sum(np.sum(g * g) for g in grads))
        return [g * global_clipnorm / max(norm, global_clipnorm) for g in grads]
    if clipvalue:
        return [np.clip(g, -clipvalue, clipvalue) for g in grads]
    return grads


@pytest.mark.parametrize("clipping", [dict(clipnorm=1.0), dict(global_clipnorm=1.5), dict(clipvalue=0.3)])
@pytest.mark.parametrize("config", ["momentum", "adam"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_clipping_applies_to_the_mean_of_the_replicas_gradients(strategies, clipping, config, dtype):
    strategy = strategies[4]
    rng = np.random.default_rng(2)
    initial = [rng.standard_normal((3, 4)).astype(dtype), rng.standard_normal(5).astype(dtype)]
    # per step, per replica, per variable; scaled so that some steps clip and, per replica, others would
    steps = [[[rng.standard_normal(w.shape).astype(dtype) * scale for w in initial] for _ in range(4)]
             for scale in (0.05, 2.0, 0.2, 5.0)]
    with strategy.scope():
        opt = (optimizers.SGD(0.1, momentum=0.9, **clipping) if config == "momentum"
               else optimizers.Adam(0.01, **clipping))
    variables = make_variables(strategy, initial)
    for grads in steps:
        apply_in_replicas(strategy, opt, variables, lambda r, grads=grads: grads[r])
    mean = [[np.mean([replica[k].astype(np.float64) for replica in grads], axis=0) for k in range(2)]
            for grads in steps]
    clipped = [numpy_clip(g, **clipping) for g in mean]
    reference = (lambda w, gs: reference_sgd(w, gs, 0.1, 0.9)) if config == "momentum" else \
        (lambda w, gs: reference_adam(w, gs, 0.01))
    for k, var in enumerate(variables):
        assert_every_copy(var, reference(initial[k], [g[k] for g in clipped]), dtype)
        unclipped = reference(initial[k], [g[k] for g in mean])
        assert not np.allclose(unclipped, var.numpy(), **TOLERANCE[dtype])  # the test clips something


def test_clipping_without_a_strategy_and_in_a_cross_replica_context(strategies):
    a, b = distrib.Variable(np.zeros(2), name="a"), distrib.Variable(np.zeros(2), name="b")
    opt = optimizers.SGD(learning_rate=1.0, global_clipnorm=1.0)
    opt.apply_gradients([(np.array([3.0, 0.0]), a), (np.array([0.0, 4.0]), b)])
    np.testing.assert_allclose(np.concatenate([a.numpy(), b.numpy()]), [-0.6, 0, 0, -0.8])
    # gradients applied as they are (no all-reduce) to variables on different devices: the global norm still
    # covers them all
    c = distrib.Variable(np.zeros(2), name="c", device="CPU:1")
    opt.apply_gradients([(np.array([3.0, 0.0]), a), (np.array([0.0, 4.0]), c)], skip_gradients_aggregation=True)
    np.testing.assert_allclose(np.concatenate([a.numpy(), c.numpy()]), [-1.2, 0, 0, -0.8])
    strategy = strategies[4]
    (w,) = make_variables(strategy, [np.zeros(2)])
    with strategy.scope():
        optimizers.SGD(learning_rate=1.0, clipvalue=0.5).apply_gradients([(np.array([2.0, -0.25]), w)])
    assert_every_copy(w, [-0.5, 0.25], np.float64)


def test_clipping_a_zero_or_sparse_gradient(strategies):
    strategy = strategies[4]
    w, e = make_variables(strategy, [np.ones(3), np.zeros((4, 2))])
    with strategy.scope():
        opt = optimizers.SGD(learning_rate=1.0, momentum=0.5, global_clipnorm=1.0)
    rows = lambda r: distrib.IndexedSlices(np.full((1, 2), 3.0), np.array([r % 2]), np.array([4, 2]))  # noqa: E731
    apply_in_replicas(strategy, opt, [w, e], lambda r: [np.zeros(3), rows(r)])  # a zero norm does not divide by 0
    assert_every_copy(w, np.ones(3), np.float64)
    # the mean of the rows: 1.5 in rows 0 and 1, global norm 3, scaled by 1/3
    assert_every_copy(e, [[-0.5, -0.5], [-0.5, -0.5], [0, 0], [0, 0]], np.float64)


def test_skipping_aggregation_clips_each_replicas_own_gradient(strategies):
    strategy = strategies[4]
    (w,) = make_variables(strategy, [np.zeros(2)])
    with strategy.scope():
        opt = optimizers.SGD(learning_rate=1.0, clipnorm=1.0)
    strategy.run(lambda: opt.apply_gradients([(np.array([0.0, 2.0]), w)], skip_gradients_aggregation=True))
    assert_every_copy(w, [0.0, -1.0], np.float64)


@pytest.mark.parametrize("make, error, message", [
    (lambda: optimizers.SGD(clipnorm=1.0, global_clipnorm=1.0), ValueError,
     "Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set. Received: clipnorm=1.0, clipvalue=None, "
     "global_clipnorm=1.0"),
    (lambda: optimizers.Adam(clipnorm=1.0, clipvalue=0.5), ValueError, "Only one of `clipnorm`, `clipvalue`"),
    (lambda: optimizers.SGD(clipvalue=-1.0), ValueError,
     r"clipvalue must be a finite number of at least 0 \(None: no clipping\). Received: -1.0"),
    (lambda: optimizers.Adam(global_clipnorm=float("inf")), ValueError, "global_clipnorm must be a finite number"),
    (lambda: optimizers.SGD(clipnorm=float("nan")), ValueError, "clipnorm must be a finite number"),
    (lambda: optimizers.SGD(clipnorm="1"), TypeError, "clipnorm must be a number or None. Received: str"),
])
def test_clipping_arguments_are_checked(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_zero_clips_nothing_as_in_keras(strategies):
    strategy = strategies[4]
    (w,) = make_variables(strategy, [np.zeros(2)])
    with strategy.scope():
        opt = optimizers.SGD(learning_rate=1.0, clipnorm=0)
    apply_in_replicas(strategy, opt, [w], lambda r: [np.array([3.0, 4.0])])
    assert_every_copy(w, [-3.0, -4.0], np.float64)
    assert repr(opt) == "<SGD name='SGD' learning_rate=1.0 clipnorm=0.0 momentum=0.0 nesterov=False>"
