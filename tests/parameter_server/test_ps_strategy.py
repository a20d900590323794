"""ParameterServerStrategy on a local Ray cluster: placement, partitioning, sharded ops, optimizers, checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import distrib
import distrib.runner
from distrib.cluster_resolver import RayClusterResolver
from distrib.errors import ContextError
from distrib.experimental.partitioners import FixedShardsPartitioner, MinSizePartitioner
from distrib.install_hint import pip_install
from support import import_torch

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def strategy(ray_cluster):
    """2 parameter servers, variables split into at most 2 shards of at least 16 bytes."""
    strategy = distrib.ParameterServerStrategy(RayClusterResolver(num_workers=1, num_ps=2),
                                               variable_partitioner=MinSizePartitioner(16, max_shards=2))
    yield strategy
    strategy._cluster.shutdown()


def test_variables_go_round_robin_and_large_ones_are_sharded(strategy):
    with strategy.scope():
        small = [distrib.Variable(np.float32(k), name=f"s{k}") for k in range(3)]
        table = distrib.Variable(np.arange(26, dtype=np.float32).reshape(13, 2), name="table")
    assert len({v.device for v in small}) == 2  # scalars cannot be split: whole, on alternating servers
    assert isinstance(table, distrib.ShardedVariable)
    assert [v.shape for v in table.variables] == [(7, 2), (6, 2)]
    assert [v.name for v in table.variables] == ["table/part_0", "table/part_1"]
    assert {v.device for v in table.variables} == {"/job:ps/task:0", "/job:ps/task:1"}
    assert strategy.extended.parameter_devices == ("/job:ps/task:0", "/job:ps/task:1")


def test_sharded_operations_on_servers_equal_an_unsharded_variables(strategy):
    rng = np.random.default_rng(0)
    full = rng.standard_normal((13, 4)).astype(np.float32)
    with strategy.scope():
        table = distrib.Variable(full, name="embeddings")
    expected = full.copy()
    np.testing.assert_array_equal(table.numpy(), expected)
    ids = np.array([[12, 0, 6], [7, 7, 1]])
    np.testing.assert_array_equal(table.embedding_lookup(ids), expected[ids])
    rows, updates = np.array([0, 12, 12, 6, 7]), rng.standard_normal((5, 4)).astype(np.float32)
    table.scatter_add(rows, updates)
    np.add.at(expected, rows, updates)
    table.assign_sub(np.full((13, 4), 0.25, np.float32))
    expected -= 0.25
    table.scatter_update([3], np.ones((1, 4), np.float32))
    expected[3] = 1
    np.testing.assert_allclose(table.numpy(), expected, rtol=1e-6)
    table.assign(full)
    np.testing.assert_array_equal(table.read_value(), full)


def test_a_variable_with_one_partition_is_a_plain_variable(strategy):
    with strategy.scope():
        v = distrib.Variable(np.zeros(2, np.float32), name="tiny")  # 8 bytes: one shard of >= 16
        with strategy.extended.colocate_vars_with(v):
            beside = distrib.Variable(np.zeros((100, 4), np.float32), name="beside")
    assert isinstance(v, distrib.parameter_server.variable.ParameterServerVariable)
    assert not isinstance(beside, distrib.ShardedVariable) and beside.device == v.device
    assert v.assign_add(np.ones(2, np.float32)).numpy().tolist() == [1.0, 1.0]
    assert v.assign_add(np.ones(2, np.float32), read_value=False) is None  # as TensorFlow's eager writes
    assert v.assign_sub(np.ones(2, np.float32), read_value=False) is None and v.numpy().tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"^assign_add needs a value of shape \(2,\) \(or a scalar\) for "
                                         r"variable 'tiny'"):
        v.assign_add(np.ones(3, np.float32))
    with strategy.scope():
        square = distrib.Variable(np.zeros((3, 3), np.float32), name="square")
    # as distrib.Variable's writes: no broadcasting but a scalar's, no cast that changes values; checked before
    # anything travels (the server's Variable refused it with its own message)
    with pytest.raises(ValueError, match=r"^assign needs a value of shape \(3, 3\) \(or a scalar\) for variable "
                                         r"'square'. Received: shape \(3, 1\)"):
        square.assign(np.ones((3, 1), np.float32))
    with pytest.raises(TypeError, match=r"^assign_add cannot write dtype complex64 into variable 'square'"):
        square.assign_add(np.ones((3, 3), np.complex64))
    assert square.assign_add(np.float32(2)).numpy().tolist() == [[2.0] * 3] * 3


def test_an_unpartitioned_table_looks_rows_up_as_a_sharded_one(strategy):
    # before: a table under the partitioner's minimum size had no embedding_lookup, and its sparse_read wrapped -1
    # to the last row, raised NumPy's IndexError from the server for 100 and a raw error for 1.5
    with strategy.scope():
        small = distrib.Variable(np.arange(3, dtype=np.float32).reshape(3, 1), name="small_table")  # 12 bytes
    assert not isinstance(small, distrib.ShardedVariable)
    assert small.embedding_lookup([[2, 0]]).tolist() == [[[2.0], [0.0]]]
    assert small.sparse_read([1]).tolist() == [[1.0]]
    with pytest.raises(ValueError, match=r"^Row ids must lie in \[0, 3\). Received: \[-1\]"):
        small.sparse_read([-1])
    with pytest.raises(ValueError, match=r"^Row ids must lie in \[0, 3\). Received: \[100\]"):
        small.embedding_lookup([100])
    with pytest.raises(TypeError, match=r"^Row ids must be integers. Received: dtype float64"):
        small.sparse_read([1.5])


def test_server_variables_refuse_integers_that_would_wrap_and_scatter_every_kind(strategy):
    # before: scatters cast int64 updates into int32 on the server (2**40 + 3 became 3), and a sharded variable
    # had its first shard written when the second refused the operand
    with strategy.scope():
        plain = distrib.Variable(np.zeros(2, np.int32), name="plain_ints")  # 8 bytes: one shard
        ints = distrib.Variable(np.zeros(8, np.int32), name="sharded_ints")  # 32 bytes: two
    assert isinstance(ints, distrib.ShardedVariable) and not isinstance(plain, distrib.ShardedVariable)
    for variable in (plain, ints):
        with pytest.raises(TypeError, match=r"^scatter_add cannot write integers outside int32's range"):
            variable.scatter_add([1], np.array([2**40 + 3], np.int64))
        with pytest.raises(TypeError, match=r"^scatter_update cannot write integers outside int32's range"):
            variable.scatter_update(distrib.IndexedSlices(np.array([2**32 + 9], np.int64), np.array([0])))
    with pytest.raises(TypeError, match=r"^assign_add cannot write integers outside int32's range"):
        ints.assign_add(np.array([1, 1, 1, 1, 1, 1, 2**40, 1], np.int64))
    assert not plain.numpy().any() and not ints.numpy().any()
    ints.assign(np.arange(1, 9, dtype=np.int32))
    ints.scatter_mul([0, 7, 7], np.array([5, 2, 3], np.int64))  # int64 that fits: cast, as distrib.Variable's
    ints.scatter_div([1, 6], np.array([-2, 2], np.int32))  # truncates toward zero
    ints.scatter_max([2], np.array([10], np.int32))
    plain.scatter_min([0, 1], np.array([-4, 3], np.int32))
    assert ints.numpy().tolist() == [5, -1, 10, 4, 5, 6, 3, 48] and plain.numpy().tolist() == [-4, 0]


def test_the_strategy_api_runs_one_replica(strategy):
    assert strategy.num_replicas_in_sync == 1
    assert isinstance(strategy.cluster_resolver, RayClusterResolver)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.arange(3.0) + ctx.replica_id_in_sync_group)
    out = strategy.run(lambda x: distrib.get_replica_context().all_reduce("SUM", x * 2), args=(values,))
    assert strategy.experimental_local_results(out)[0].tolist() == [0.0, 2.0, 4.0]
    assert strategy.reduce("SUM", out, axis=0) == 6.0
    assert strategy.gather(out, axis=0).tolist() == [0.0, 2.0, 4.0]
    batches = [np.arange(4.0), np.arange(4.0, 8.0)]
    local = strategy.experimental_local_results
    assert [local(b)[0].tolist() for b in strategy.experimental_distribute_dataset(batches)] == \
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    made = strategy.distribute_datasets_from_function(lambda ctx: [np.full(2, ctx.num_replicas_in_sync)])
    assert [local(b)[0].tolist() for b in made] == [[1, 1]]
    with strategy.scope():
        assert distrib.get_strategy() is strategy


def test_optimizer_slots_live_beside_their_variables_and_updates_run_there(strategy):
    with strategy.scope():
        table = distrib.Variable(np.ones((6, 2), np.float32), name="opt_table")
        bias = distrib.Variable(np.ones(1, np.float32), name="opt_bias")
        optimizer = distrib.optimizers.SGD(learning_rate=0.5, momentum=0.5)
        optimizer.build([table, bias])
    momentum = optimizer.get_slot(table, "momentum")
    assert [s.device for s in momentum.variables] == [v.device for v in table.variables]
    assert optimizer.get_slot(bias, "momentum").device == bias.device
    for _ in range(2):
        strategy.run(lambda: optimizer.apply_gradients([(np.ones((6, 2), np.float32), table),
                                                        (np.ones(1, np.float32), bias)]))
    reference = distrib.Variable(np.ones((6, 2), np.float32))
    reference_optimizer = distrib.optimizers.SGD(learning_rate=0.5, momentum=0.5)
    for _ in range(2):
        reference_optimizer.apply_gradients([(np.ones((6, 2), np.float32), reference)])
    np.testing.assert_allclose(table.numpy(), reference.numpy())
    assert int(optimizer.iterations.numpy()) == 2


def test_bfloat16_variables_train_on_the_servers_as_on_one_device(strategy):
    bfloat16 = pytest.importorskip("ml_dtypes").bfloat16
    with strategy.scope():
        weights = distrib.Variable(np.linspace(-1, 1, 8).astype(bfloat16), name="bf16_weights")
        optimizer = distrib.optimizers.Adam(learning_rate=0.1)
        optimizer.build([weights])
    reference = distrib.Variable(np.linspace(-1, 1, 8).astype(bfloat16))
    reference_optimizer = distrib.optimizers.Adam(learning_rate=0.1)
    gradient = np.full(8, 0.5, bfloat16)
    for _ in range(2):
        strategy.run(lambda: optimizer.apply_gradients([(gradient, weights)]))
        reference_optimizer.apply_gradients([(gradient, reference)])
    assert weights.dtype == bfloat16
    np.testing.assert_array_equal(weights.numpy(), reference.numpy())


def test_torch_tensors_that_require_grad_go_into_server_variables_as_their_values(strategy):
    torch = import_torch()
    values = torch.arange(12.0).reshape(6, 2).requires_grad_(True)
    with strategy.scope():
        table = distrib.Variable(values, name="torch_table")  # sharded over both servers
        bias = distrib.Variable(torch.zeros(2, requires_grad=True), name="torch_bias")
        optimizer = distrib.optimizers.SGD(learning_rate=0.5)
        optimizer.build([table, bias])
    table.assign_add(torch.ones(6, 2, requires_grad=True))
    table.scatter_sub(torch.tensor([5]), torch.ones(1, 2, requires_grad=True))
    strategy.run(lambda: optimizer.apply_gradients([(torch.ones(6, 2, requires_grad=True), table),
                                                    (torch.ones(2, requires_grad=True), bias)]))
    expected = np.arange(12.0, dtype=np.float32).reshape(6, 2) + 0.5
    expected[5] -= 1
    np.testing.assert_array_equal(table.numpy(), expected)
    np.testing.assert_array_equal(bias.numpy(), [-0.5, -0.5])


def test_extended_update_runs_fn_on_the_server_holding_the_variable(strategy):
    with strategy.scope():
        v = distrib.Variable(np.arange(3, dtype=np.float32), name="updated")

    def scale(var, factor):  # receives the server's own variable
        var.assign(var.read_value() * factor)
        return os.getpid()

    server_pid = strategy.extended.update(v, scale, args=(np.float32(2),))
    assert server_pid != os.getpid() and v.numpy().tolist() == [0.0, 2.0, 4.0]
    with pytest.raises(TypeError, match="^update runs fn where one variable lives"):
        strategy.extended.update(np.zeros(3), scale)


def test_extended_update_returns_the_variable_fn_returns_and_names_a_result_that_cannot_travel(strategy):
    # before: fn returning the server's variable (TensorFlow's `x.assign(...)` idiom) wrote, then raised
    # "cannot pickle '_thread.lock' object" from Ray
    with strategy.scope():
        v = distrib.Variable(np.float64(1.0), name="assigned")
    assert strategy.extended.update(v, lambda x: x.assign(2.0)) is v and float(v.numpy()) == 2.0
    assert strategy.extended.update(v, lambda x: (x.assign_add(1.0), 7)) == (v, 7)
    with pytest.raises(TypeError, match=r"^A function run on parameter server \d returned a value that cannot travel "
                                        r"back \(its writes were applied\).*Received: generator from 'rows'"):
        def rows(x):
            x.assign_add(1.0)
            return (k for k in range(2))
        strategy.extended.update(v, rows)
    assert float(v.numpy()) == 4.0


def test_checkpoints_restore_across_shard_counts(strategy, tmp_path, ray_cluster):
    value = np.arange(26, dtype=np.float32).reshape(13, 2)
    with strategy.scope():
        table = distrib.Variable(value, name="ckpt_table")
        optimizer = distrib.optimizers.SGD(learning_rate=0.1, momentum=0.9)
        optimizer.build([table])
    optimizer.get_slot(table, "momentum").assign(value / 2)
    path = distrib.Checkpoint(table=table, optimizer=optimizer, step=3).save(tmp_path / "ps.ckpt")
    table.assign(np.zeros_like(value))
    assert distrib.Checkpoint(table=table, optimizer=optimizer, step=0).restore(path) == {"step": 3}
    np.testing.assert_array_equal(table.numpy(), value)
    three = distrib.ParameterServerStrategy(RayClusterResolver(num_workers=1, num_ps=3),
                                            variable_partitioner=FixedShardsPartitioner(3))
    with three.scope():
        restored = distrib.Variable(np.zeros_like(value), name="ckpt_table")
        restored_optimizer = distrib.optimizers.SGD(learning_rate=0.1, momentum=0.9)
        restored_optimizer.build([restored])
    distrib.Checkpoint(table=restored, optimizer=restored_optimizer, step=0).restore(path)
    assert len(restored.variables) == 3
    np.testing.assert_array_equal(restored.numpy(), value)
    np.testing.assert_array_equal(restored_optimizer.get_slot(restored, "momentum").numpy(), value / 2)
    plain = distrib.Variable(np.zeros_like(value))
    distrib.Checkpoint(table=plain).restore(path, allow_partial=True)
    np.testing.assert_array_equal(plain.numpy(), value)
    three._cluster.shutdown()


def test_runner_wrapper_reads_tf_config(monkeypatch, ray_cluster):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["w0:1"], "ps": ["p0:1", "p1:1"]},
                                                "task": {"type": "chief", "index": 0}}))
    strategy = distrib.runner.ParameterServerStrategy(min_shard_bytes=64)
    assert strategy.cluster_resolver.num_tasks("ps") == 2
    with strategy.scope():
        table = distrib.Variable(np.zeros((10, 4), np.float32))   # 160 bytes: 2 shards (max_shards = 2 ps)
        small = distrib.Variable(np.zeros((3, 4), np.float32))    # 48 bytes: one
    assert [v.shape for v in table.variables] == [(5, 4), (5, 4)] and small.shape == (3, 4)
    strategy._cluster.shutdown()
    monkeypatch.delenv("TF_CONFIG")
    with pytest.raises(ValueError, match="^runner.ParameterServerStrategy reads the cluster from TF_CONFIG"):
        distrib.runner.ParameterServerStrategy()


def test_clear_errors(strategy):
    with pytest.raises(ValueError, match="^ParameterServerStrategy keeps one copy of each variable"):
        with strategy.scope():
            distrib.Variable(np.zeros(2), synchronization="ON_READ", aggregation="SUM")
    with pytest.raises(ContextError, match="^distrib.Variable must be called in a cross-replica context"):
        with strategy.scope():
            strategy.run(lambda: distrib.Variable(np.zeros(2)))
    with pytest.raises(ValueError, match="^ParameterServerStrategy needs at least one \"ps\" and one \"worker\""):
        distrib.ParameterServerStrategy(distrib.cluster_resolver.TFConfigClusterResolver())
    with pytest.raises(TypeError, match="^variable_partitioner must be a Partitioner"):
        distrib.ParameterServerStrategy(RayClusterResolver(1, 1), variable_partitioner=3)


def test_distrib_imports_without_ray_and_the_strategy_says_what_to_install():
    program = ("import sys; sys.modules['ray'] = None\n"  # as if Ray were not installed
               "import distrib, numpy as np\n"
               "from distrib.errors import BackendUnavailableError\n"
               "assert distrib.experimental.partitioners.FixedShardsPartitioner(2)([4], np.float32) == [2]\n"
               "try:\n"
               "    distrib.ParameterServerStrategy(distrib.cluster_resolver.RayClusterResolver(1, 1))\n"
               "except BackendUnavailableError as exc:\n"
               "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout
    assert out.startswith(f"ParameterServerStrategy runs on Ray, which is not installed. Install it with "
                          f"{pip_install('ps')}.")


def test_the_ray_resolver_reads_the_cluster(ray_cluster):
    resolver = RayClusterResolver()  # the session's cluster: one node, 2 CPUs
    assert resolver.num_tasks("ps") == 1 and resolver.num_tasks("worker") == 1
    node = resolver.cluster_spec()["ps"][0]
    assert RayClusterResolver(num_workers=3, num_ps=2).cluster_spec()["worker"] == [node] * 3
