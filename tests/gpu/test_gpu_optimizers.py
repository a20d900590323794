"""The fused optimizer kernels (optimizer.cu) against optimizers.py's NumPy path, and one launch per pack."""

from __future__ import annotations

import collections

import numpy as np
import pytest

import distrib
from distrib import optimizers
from distrib.backends import get_backend
from distrib.backends.cuda import kernels as cuda_kernels
from distrib.variables import Variable
from gpu_support import shared_gpu_and_emulator

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

OPTIMIZERS = {
    "sgd": lambda: optimizers.SGD(learning_rate=0.1),
    "momentum": lambda: optimizers.SGD(learning_rate=0.1, momentum=0.9),
    "nesterov": lambda: optimizers.SGD(learning_rate=0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optimizers.Adam(learning_rate=0.01),
}
SHAPES = [(3, 4), (), (0,), (1000,), (257, 33)]  # a scalar, an empty tensor, and more than one block's worth


@pytest.fixture(scope="module")
def backend():
    return get_backend("cuda")


def copies(values, slots, device, backend):
    """(variable, slot copies) per value, on `device` of `backend`; slots start at zero in the math dtype."""
    out = []
    for value in values:
        math = np.float32 if value.dtype == np.float16 else value.dtype
        zeros = tuple(Variable(np.zeros(value.shape, math), device=device, backend=backend) for _ in range(slots))
        out.append((Variable(value, device=device, backend=backend), zeros))
    return out


def bits(array: np.ndarray) -> np.ndarray:
    """The array's bit patterns, as unsigned integers of its item size."""
    return array.view(f"u{array.itemsize}")


def assert_bitwise(gpu, cpu):
    for (var, slots), (expected, expected_slots) in zip(gpu, cpu):
        for actual, wanted in zip((var, *slots), (expected, *expected_slots)):
            assert actual.dtype == wanted.dtype
            np.testing.assert_array_equal(bits(actual.numpy()), bits(wanted.numpy()))


@pytest.mark.parametrize("dtypes", [[np.float32], [np.float64], [np.float16], [np.float16, np.float32]],
                         ids=["float32", "float64", "float16", "float16+float32"])
@pytest.mark.parametrize("rule", OPTIMIZERS)
def test_the_fused_update_matches_the_numpy_path_bit_for_bit(backend, rule, dtypes):
    rng = np.random.default_rng(len(rule) + len(dtypes))
    opt = OPTIMIZERS[rule]()
    values = [rng.standard_normal(shape).astype(dtypes[k % len(dtypes)]) for k, shape in enumerate(SHAPES)]
    math = np.dtype(np.float64 if dtypes == [np.float64] else np.float32)
    gpu = copies(values, len(opt.slot_names), "GPU:0", backend)
    cpu = copies(values, len(opt.slot_names), "CPU:0", get_backend("cpu"))
    for step in range(1, 5):
        grads = [rng.standard_normal(v.shape).astype(math) for v in values]
        coefficients = opt._coefficients(math, step)
        read_before = [var.read_value() for var, _ in gpu]
        held = [r.get() for r in read_before]
        assert backend.fused_optimizer_update(
            rule, [(var, cupy.asarray(g), slots) for (var, slots), g in zip(gpu, grads)], coefficients)
        opt._update_device(np, [(var, g, slots) for (var, slots), g in zip(cpu, grads)], coefficients)
        assert_bitwise(gpu, cpu)
        for view, value in zip(read_before, held):  # copy on write: values read earlier never change
            np.testing.assert_array_equal(view.get(), value)


def test_a_pack_bigger_than_the_grid_is_covered_by_the_grid_stride_loop(backend):
    sizes = [7, cuda_kernels.MAX_BLOCKS * cuda_kernels.BLOCK]  # some threads update two elements
    items = [(var, cupy.ones(var.shape, np.float32), slots)
             for var, slots in copies([np.zeros(n, np.float32) for n in sizes], 0, "GPU:0", backend)]
    assert backend.fused_optimizer_update("sgd", items, (np.float32(0.5), np.float32(0.0)))
    for var, _, _ in items:
        np.testing.assert_array_equal(var.numpy(), np.full(var.shape, -0.5, np.float32))


def test_what_the_kernels_cannot_take_is_left_to_the_numpy_path(backend):
    ((var, _),) = copies([np.ones(3, np.float32)], 0, "GPU:0", backend)
    coefficients = (np.float32(0.5), np.float32(0.0))
    item = (var, cupy.ones(3, np.float32), ())
    assert not backend.fused_optimizer_update("sgd", [item, item], coefficients)  # listed twice
    assert not backend.fused_optimizer_update("sgd", [(var, cupy.ones(3, np.float64), ())], coefficients)
    assert not backend.fused_optimizer_update("sgd", [(var, cupy.ones(4, np.float32), ())], coefficients)
    np.testing.assert_array_equal(var.numpy(), np.ones(3, np.float32))


@pytest.fixture
def launches(backend, monkeypatch):
    """Counts optimizer.cu's launches by kernel name."""
    counted = collections.Counter()
    function = backend._kernels.function

    def counting(file, name):
        kernel = function(file, name)
        if file != "optimizer.cu":
            return kernel

        def launch(*args):
            counted[name] += 1
            return kernel(*args)

        return launch

    monkeypatch.setattr(backend._kernels, "function", counting)
    return counted


@pytest.mark.parametrize("rule", OPTIMIZERS)
def test_apply_gradients_launches_once_per_device_and_dtype_and_matches_the_cpu_emulator(launches, rule):
    rng = np.random.default_rng(7)
    initial = [rng.standard_normal(s).astype(d) for s, d in [((3, 4), np.float32), ((5,), np.float16),
                                                             ((2, 2), np.float64), ((300,), np.float32)]]
    steps = [[rng.standard_normal(w.shape).astype(w.dtype) for w in initial] for _ in range(3)]
    results = {}
    for kind, strategy in shared_gpu_and_emulator(2).items():
        with strategy.scope():
            variables = [distrib.Variable(w, name=f"w{k}") for k, w in enumerate(initial)]
            opt = OPTIMIZERS[rule]()
        for grads in steps:  # both replicas pass the same gradients: their mean is exact
            launches.clear()
            strategy.run(lambda: opt.apply_gradients(zip([g.copy() for g in grads], variables)))
        results[kind] = [[c.numpy() for c in v.values] for v in variables]
        if kind == "GPU":  # one launch per dtype for the one GPU both replicas share
            assert launches == {f"{rule}_float32": 1, f"{rule}_float16": 1, f"{rule}_float64": 1}
    for gpu, cpu in zip(results["GPU"], results["CPU"]):
        for actual, expected in zip(gpu, cpu):
            np.testing.assert_array_equal(bits(actual), bits(expected))
