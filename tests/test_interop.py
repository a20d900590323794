"""Arrays from other libraries: NumPy bfloat16 (ml_dtypes) and PyTorch tensors, taken as NumPy arrays of their values.

TensorFlow has no rule for torch tensors; distrib applies its rules for NumPy inputs, so each torch program here
is checked against the same program on the tensor's NumPy twin (its values, in its dtype).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import distrib
from support import import_torch

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes (NumPy's bfloat16) comes with distrib[test]")
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def strategy():
    return distrib.MirroredStrategy(["CPU:0", "CPU:1"])


@pytest.fixture(scope="module")
def torch():
    return import_torch()


def all_reduce(strategy, op, make):
    values = strategy.experimental_distribute_values_from_function(make)
    out = strategy.run(lambda x: distrib.get_replica_context().all_reduce(op, x), args=(values,))
    return strategy.experimental_local_results(out)


def test_numpy_bfloat16_reduces_on_the_emulator(strategy):
    results = all_reduce(strategy, "SUM",
                         lambda ctx: np.arange(3).astype(BFLOAT16) * (ctx.replica_id_in_sync_group + 1))
    for result in results:
        assert result.dtype == BFLOAT16 and result.astype(np.float32).tolist() == [0.0, 3.0, 6.0]
    values = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(2, BFLOAT16))
    assert strategy.reduce("MEAN", values, axis=None).astype(np.float32).tolist() == [1.0, 1.0]


# -- torch tensors against their NumPy twins ----------------------------------------------------------------------

# The tensors a user hands over, replica r's of each kind (r shifts the values so replicas differ).
TENSORS = {
    "float32": lambda torch, r: torch.arange(6, dtype=torch.float32).reshape(2, 3) + r,
    "float16": lambda torch, r: torch.arange(6, dtype=torch.float16).reshape(2, 3) + r,
    "bfloat16": lambda torch, r: torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) + r,
    "int64": lambda torch, r: torch.arange(6).reshape(2, 3) + r,
    "requires_grad": lambda torch, r: torch.arange(6.0, requires_grad=True).reshape(2, 3) * 2 + r,
    "parameter": lambda torch, r: torch.nn.Parameter(torch.arange(6.0).reshape(2, 3) + r),
    "non_contiguous": lambda torch, r: (torch.arange(6.0).reshape(3, 2) + r).T,
    "zero_d": lambda torch, r: torch.tensor(2.5) + r,
    "conjugated": lambda torch, r: (torch.tensor([1 + 2j, 3 - 1j]) + r).conj(),  # a lazy conjugate view
}


def numpy_twin(tensor) -> np.ndarray:
    """The tensor's values as a NumPy array of the same dtype (bfloat16 as ml_dtypes')."""
    name = str(tensor.dtype).removeprefix("torch.")
    resolved = tensor.detach().resolve_conj()
    if name == "bfloat16":
        return resolved.float().numpy().astype(BFLOAT16)
    return resolved.numpy().copy()


def assert_same(got, want):
    """`got` is a NumPy array with `want`'s dtype, shape and values."""
    assert type(got) is np.ndarray, type(got)
    assert (got.dtype, got.shape) == (want.dtype, want.shape)
    compare = np.complex128 if want.dtype.kind == "c" else np.float64
    np.testing.assert_array_equal(got.astype(compare), want.astype(compare))


def both(torch, kind, program):
    """`program(make)` run with torch tensors and with their NumPy twins: (torch's results, NumPy's results)."""
    make = TENSORS[kind]
    return (program(lambda r: make(torch, r)), program(lambda r: numpy_twin(make(torch, r))))


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("kind", TENSORS)
def test_torch_tensors_all_reduce_in_run_as_their_numpy_twins(strategy, torch, kind, op):
    def program(make):
        def replica():
            ctx = distrib.get_replica_context()
            return ctx.all_reduce(op, make(ctx.replica_id_in_sync_group))

        return strategy.experimental_local_results(strategy.run(replica))

    got, want = both(torch, kind, program)
    for g, w in zip(got, want):
        assert_same(g, w)


@pytest.mark.parametrize("kind", TENSORS)
def test_strategy_reduce_and_gather_take_torch_tensors_as_their_numpy_twins(strategy, torch, kind):
    def program(make):
        values = strategy.run(lambda: make(distrib.get_replica_context().replica_id_in_sync_group))
        results = [strategy.reduce("SUM", values, axis=None), strategy.reduce("MEAN", values, axis=None)]
        if kind != "zero_d":
            results += [strategy.reduce("SUM", values, axis=0), strategy.gather(values, axis=0)]
        return results

    got, want = both(torch, kind, program)
    for g, w in zip(got, want):
        assert_same(g, w)


def test_a_scalar_tensor_cannot_be_gathered_as_a_scalar_array_cannot(strategy, torch):
    values = strategy.run(lambda: torch.tensor(2.5, requires_grad=True))
    with pytest.raises(ValueError, match=r"Strategy.gather needs values of rank >= 1"):
        strategy.gather(values, axis=0)


def test_values_from_function_keep_the_tensors_and_reduce_to_numpy(strategy, torch):
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.full((2,), 1.5, dtype=torch.bfloat16) * (ctx.replica_id_in_sync_group + 1))
    assert all(isinstance(v, torch.Tensor) for v in strategy.experimental_local_results(values))
    assert_same(strategy.reduce("SUM", values, axis=None), np.array([4.5, 4.5], BFLOAT16))


def test_run_returns_the_tensors_the_function_returns(strategy, torch):
    tensor = torch.ones(2, requires_grad=True)
    assert all(r is tensor for r in strategy.experimental_local_results(strategy.run(lambda: tensor)))


def test_collective_results_do_not_share_memory_with_the_tensors(torch):
    """A gradient zeroed in place after its all-reduce leaves the result as it was, on one replica too."""
    single = distrib.MirroredStrategy(["CPU:0"])
    grad = torch.arange(3.0)
    (result,) = single.experimental_local_results(
        single.run(lambda: distrib.get_replica_context().all_reduce("SUM", grad)))
    grad.zero_()
    assert result.tolist() == [0.0, 1.0, 2.0]


# -- variables ------------------------------------------------------------------------------------------------------


def test_a_variable_made_from_a_tensor_that_requires_grad_holds_its_values(strategy, torch):
    with strategy.scope():
        v = distrib.Variable(torch.arange(3.0, requires_grad=True) * 2)
    assert_same(v.numpy(), np.array([0.0, 2.0, 4.0], np.float32))


def test_a_bfloat16_variable_averages_its_replicas_torch_assignments(strategy, torch):
    with strategy.scope():
        v = distrib.Variable(torch.zeros(3, dtype=torch.bfloat16), aggregation="MEAN")
    assert v.dtype == BFLOAT16
    strategy.run(lambda: v.assign(
        torch.full((3,), 1.0, dtype=torch.bfloat16) + distrib.get_replica_context().replica_id_in_sync_group))
    assert_same(v.numpy(), np.full(3, 1.5, BFLOAT16))


def test_variables_are_assigned_from_tensors_with_numpys_casting_rule(strategy, torch):
    with strategy.scope():
        v = distrib.Variable(np.zeros((2, 2), np.float32))
    v.assign(torch.arange(4, dtype=torch.int64).reshape(2, 2).T)  # int64 into float32: same kind, as NumPy allows
    assert_same(v.numpy(), np.array([[0.0, 2.0], [1.0, 3.0]], np.float32))
    v.assign_add(torch.ones(2, 2, dtype=torch.float16, requires_grad=True))
    assert_same(v.numpy(), np.array([[1.0, 3.0], [2.0, 4.0]], np.float32))
    with pytest.raises(TypeError, match=r"assign cannot write dtype complex64 into variable"):
        v.assign(torch.ones(2, 2, dtype=torch.complex64))


# -- tensors that hold no plain array: one clear TypeError ----------------------------------------------------------


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch warns that complex32 is experimental, qint8 deprecated
@pytest.mark.parametrize("make, message", [
    (lambda torch: torch.eye(2).to_sparse(), r"A torch tensor must be dense \(layout torch.strided\). Received: a "
                                             r"torch.float32 tensor of shape \(2, 2\) and layout torch.sparse_coo; "
                                             r"pass tensor.to_dense\(\)"),
    (lambda torch: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
     r"A torch tensor must hold plain numbers, not quantized ones"),
    (lambda torch: torch.empty(3, device="meta"), r"A torch tensor must hold values; a meta tensor has only"),
    (lambda torch: torch.ones(2, dtype=torch.complex32), r"A torch tensor must have a dtype NumPy holds"),
    (lambda torch: torch.empty(2, dtype=torch.uint4), r"A torch tensor must have a dtype NumPy holds"),
], ids=["sparse", "quantized", "meta", "complex32", "uint4"])
def test_tensors_without_a_plain_array_raise_a_type_error_saying_what_to_do(strategy, torch, make, message):
    tensor = make(torch)
    with pytest.raises(TypeError, match=message):
        strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", tensor))
    with pytest.raises(TypeError, match=message):
        strategy.reduce("SUM", strategy.experimental_distribute_values_from_function(lambda ctx: tensor), axis=None)


REFUSED_SPARSE_TENSORS = """
import torch, distrib
strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
for _ in range(3):
    try:
        strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", torch.ones(2).to_sparse()))
    except TypeError:
        pass
"""


def test_a_program_that_had_tensors_refused_exits_cleanly(torch):
    # before, the refusal was raised on the replica threads, and in 14 of 20 runs the process then died at exit
    # in torch's C++ ("terminate called without an active exception", status 134)
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", REFUSED_SPARSE_TENSORS], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "DISTRIB_BACKEND": "cpu"})
        assert done.returncode == 0, done.stderr


def test_the_readmes_pytorch_example_runs(torch, capsys):
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    program = re.search(r"## PyTorch tensors\n\n.*?```python\n(.*?)```", readme, re.S).group(1)
    exec(compile(program, "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["array([1.5, 1.5, 1.5], dtype=float32)", "tensor([1.5000, 1.5000, 1.5000])"]
