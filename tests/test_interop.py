"""Arrays from other libraries in collectives: NumPy bfloat16 (ml_dtypes) and PyTorch tensors, as TensorFlow takes them."""

from __future__ import annotations

import numpy as np
import pytest

import distrib


@pytest.fixture(scope="module")
def strategy():
    return distrib.MirroredStrategy(["CPU:0", "CPU:1"])


def all_reduce(strategy, op, make):
    values = strategy.experimental_distribute_values_from_function(make)
    out = strategy.run(lambda x: distrib.get_replica_context().all_reduce(op, x), args=(values,))
    return strategy.experimental_local_results(out)


def test_numpy_bfloat16_reduces_on_the_emulator(strategy):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bfloat16 = np.dtype(ml_dtypes.bfloat16)
    results = all_reduce(strategy, "SUM", lambda ctx: np.arange(3).astype(bfloat16) * (ctx.replica_id_in_sync_group + 1))
    for result in results:
        assert result.dtype == bfloat16 and result.astype(np.float32).tolist() == [0.0, 3.0, 6.0]
    values = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(2, bfloat16))
    assert strategy.reduce("MEAN", values, axis=None).astype(np.float32).tolist() == [1.0, 1.0]


def test_torch_tensors_that_require_grad_reduce_as_their_values(strategy):
    torch = pytest.importorskip("torch")
    results = all_reduce(strategy, "SUM", lambda ctx: torch.ones(3, requires_grad=True))
    assert [r.tolist() for r in results] == [[2.0, 2.0, 2.0]] * 2


def test_torch_bfloat16_tensors_reduce_in_bfloat16(strategy):
    torch = pytest.importorskip("torch")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    results = all_reduce(strategy, "SUM", lambda ctx: torch.full((2,), 1.5, dtype=torch.bfloat16))
    for result in results:
        assert result.dtype == np.dtype(ml_dtypes.bfloat16) and result.astype(np.float32).tolist() == [3.0, 3.0]
