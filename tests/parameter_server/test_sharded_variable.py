"""ShardedVariable over local shards: reads, writes, lookups and row updates equal an unsharded variable's."""

from __future__ import annotations

import numpy as np
import pytest

import distrib
from distrib.parameter_server.partitioners import div_offsets


def sharded(value: np.ndarray, parts: int) -> distrib.ShardedVariable:
    offsets = div_offsets(len(value), parts)
    return distrib.ShardedVariable([distrib.Variable(value[a:b]) for a, b in zip(offsets, offsets[1:])],
                                   name="table")


@pytest.mark.parametrize("parts", [1, 2, 5])
def test_every_operation_equals_the_unsharded_variables(parts):
    rng = np.random.default_rng(parts)
    full = rng.standard_normal((13, 3)).astype(np.float32)
    table, plain = sharded(full, parts), distrib.Variable(full)
    ids = np.array([[12, 0], [5, 5], [9, 10]])
    np.testing.assert_array_equal(table.embedding_lookup(ids), plain.numpy()[ids])
    np.testing.assert_array_equal(table.sparse_read([3]), plain.numpy()[[3]])
    delta = rng.standard_normal((13, 3)).astype(np.float32)
    table.assign_add(delta), plain.assign_add(delta)
    table.assign_sub(np.float32(0.5)), plain.assign_sub(np.float32(0.5))
    rows = np.array([0, 12, 12, 7])
    updates = rng.standard_normal((4, 3)).astype(np.float32)
    table.scatter_add(rows, updates)
    expected = plain.numpy()
    np.add.at(expected, rows, updates)
    np.testing.assert_allclose(table.numpy(), expected, rtol=1e-6)
    plain.scatter_add(distrib.IndexedSlices(updates, rows))  # TensorFlow's form, the same rows
    np.testing.assert_allclose(table.numpy(), plain.numpy(), rtol=1e-6)
    table.scatter_sub(distrib.IndexedSlices(updates, rows))
    table.scatter_update([4, 11], np.zeros((2, 3), np.float32))
    np.subtract.at(expected, rows, updates)
    expected[[4, 11]] = 0
    np.testing.assert_allclose(table.read_value(), expected, rtol=1e-6)
    table.assign(full)
    np.testing.assert_array_equal(np.asarray(table), full)
    np.testing.assert_array_equal(table[2:4], full[2:4])


def test_shape_shards_and_repr():
    table = sharded(np.zeros((13, 2), np.float64), 5)
    assert table.shape == (13, 2) and table.dtype == np.float64 and len(table.variables) == 5
    assert repr(table) == "<ShardedVariable 'table' shape=(13, 2) dtype=float64 shards=5 rows=[3, 3, 3, 2, 2]>"


def test_shards_must_agree():
    with pytest.raises(ValueError, match="^A ShardedVariable's shards share the dtype and every dimension but the "
                                         "first. Received: shard 1 float32 \\(2, 3\\)"):
        distrib.ShardedVariable([distrib.Variable(np.zeros((2, 2), np.float32)),
                                 distrib.Variable(np.zeros((2, 3), np.float32))])
    with pytest.raises(ValueError, match="^A ShardedVariable needs at least one shard"):
        distrib.ShardedVariable([])
    with pytest.raises(TypeError, match="^A ShardedVariable's shards are distrib variables. Received: ndarray"):
        distrib.ShardedVariable([np.zeros(3)])


def test_bad_writes_change_nothing():
    table = sharded(np.zeros((5, 2), np.float32), 2)
    with pytest.raises(ValueError, match=r"^assign needs a value of shape \(5, 2\) \(or a scalar\) for "
                                         r"variable 'table'"):
        table.assign(np.zeros((4, 2)))
    with pytest.raises(ValueError, match=r"^scatter_add needs row ids in \[0, 5\). Received: ids from 0 to 5"):
        table.scatter_add([0, 5], np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match=r"^scatter_add needs updates of shape \(2, 2\)"):
        table.scatter_add([0, 1], np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"^Row ids must lie in \[0, 5\)"):
        table.embedding_lookup([7])
    with pytest.raises(TypeError, match=r"^scatter_add needs an IndexedSlices \(with .indices and .values\), or "
                                        r"indices and updates. Received: list and no updates."):
        table.scatter_add([0, 1])
    assert not table.numpy().any()


def test_checkpoint_restores_into_another_shard_count(tmp_path):
    value = np.arange(26, dtype=np.float32).reshape(13, 2)
    path = distrib.Checkpoint(table=sharded(value, 5)).save(tmp_path / "table.ckpt")
    for parts in (1, 2):
        restored = sharded(np.zeros_like(value), parts)
        distrib.Checkpoint(table=restored).restore(path)
        np.testing.assert_array_equal(restored.numpy(), value)
    distrib.Checkpoint(table=(plain := distrib.Variable(np.zeros_like(value)))).restore(path)
    np.testing.assert_array_equal(plain.numpy(), value)


def test_a_refused_write_writes_no_shard():
    # before: each shard checked its own part, so shard 0 was written when shard 1 refused (half-applied)
    table = sharded(np.zeros(4, np.int32), 2)
    with pytest.raises(TypeError, match=r"^assign_add cannot write integers outside int32's range"):
        table.assign_add(np.array([1, 1, 2**40, 1], np.int64))
    with pytest.raises(TypeError, match=r"^scatter_add cannot write integers outside int32's range"):
        table.scatter_add([0, 3], np.array([7, 2**40], np.int64))
    with pytest.raises(ValueError, match=r"^scatter_div cannot divide integers by zero"):
        table.scatter_div([0, 3], np.array([1, 0], np.int32))
    assert table.numpy().tolist() == [0, 0, 0, 0]


def test_every_call_sent_is_awaited_before_an_error_is_raised():
    # before: the first failure was raised at once; the calls after it were never awaited (Ray then printed an
    # "Unhandled error" for them) and their writes landed after the caller had heard of the failure
    from distrib.parameter_server.shard_calls import results

    awaited = []

    class Call:
        def __init__(self, k, error=None):
            self.k, self.error = k, error

        def result(self):
            awaited.append(self.k)
            if self.error:
                raise self.error
            return self.k

    def started():
        yield Call(0, KeyError("first"))
        yield Call(1, ValueError("second"))
        raise RuntimeError("the third cannot start")

    with pytest.raises(RuntimeError, match="the third cannot start"):
        results(started())
    assert awaited == [0, 1]
    assert results(Call(k) for k in range(3)) == [0, 1, 2]


def test_row_updates_of_every_kind_equal_an_unsharded_variables():
    value = np.arange(1.0, 11.0).reshape(5, 2)
    table, plain = sharded(value, 2), distrib.Variable(value)
    rows, updates = np.array([4, 0, 4]), np.array([[2.0, 3.0], [0.5, 4.0], [3.0, 1.0]])
    for method in ("scatter_mul", "scatter_div", "scatter_min", "scatter_max"):
        getattr(table, method)(rows, updates)
        getattr(plain, method)(distrib.IndexedSlices(updates, rows))
        np.testing.assert_array_equal(table.numpy(), plain.numpy(), err_msg=method)
