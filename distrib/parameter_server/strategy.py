"""ParameterServerStrategy: variables on parameter-server actors (sharded by a partitioner), closures on workers."""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, Iterator

import numpy as np
import optree

from distrib import context
from distrib.backends import get_backend
from distrib.backends.cpu import to_numpy
from distrib.cluster_resolver import ClusterResolver, RayClusterResolver, TFConfigClusterResolver
from distrib.cross_device_ops import ReductionToOneDevice
from distrib.errors import ContextError
from distrib.extended import StrategyExtended
from distrib.options import CommunicationOptions, coerce_enum
from distrib.parameter_server import optimizer_updates
from distrib.parameter_server.partitioners import Partitioner, div_offsets
from distrib.parameter_server.server import ServerVariable
from distrib.parameter_server.sharded_variable import ShardedVariable
from distrib.parameter_server.variable import ParameterServerVariable
from distrib.replica_context import ReplicaContext
from distrib.strategy import Strategy
from distrib.values import select_replica
from distrib.variables import VariableAggregation, VariableSynchronization, check_numeric

# Worker-side copies of strategies, by the id of the coordinator's strategy: every closure a worker runs
# sees the same object, so optimizers' checks by identity hold there too.
_WORKER_SIDE: "weakref.WeakValueDictionary[int, ParameterServerStrategy]" = weakref.WeakValueDictionary()


class ParameterServerStrategy(Strategy):
    """Asynchronous training: variables live on parameter servers, a `ClusterCoordinator` runs steps on workers.

    Servers and workers are Ray actors: with no cluster configured, a local Ray cluster starts on this
    machine; with `RAY_ADDRESS` set, the program joins that cluster. Variables created under `scope()` are
    placed on the servers round robin; with a `variable_partitioner`, a variable is split along axis 0 into a
    `ShardedVariable` whose shards go to consecutive servers ("div" placement: the first shards one row
    longer). Variables created under `extended.colocate_vars_with(v)` go where `v` is (an optimizer's slots:
    beside their variable, sharded the same way) and are not partitioned otherwise. Optimizers apply their
    updates on the servers. Each worker runs one replica: `num_replicas_in_sync` is 1, and `run`, `reduce`,
    `gather` and the dataset methods behave as one replica's, on whichever worker a closure runs.

    Args:
      cluster_resolver: a `TFConfigClusterResolver` (its `worker` and `ps` counts) or a `RayClusterResolver`;
        None reads `TF_CONFIG` when it is set, else the Ray cluster.
      variable_partitioner: a `distrib.experimental.partitioners.Partitioner`, or None (no partitioning).

    Example:
      >>> import distrib, numpy as np
      >>> from distrib.experimental.partitioners import FixedShardsPartitioner
      >>> strategy = distrib.ParameterServerStrategy(
      ...     distrib.cluster_resolver.RayClusterResolver(num_workers=1, num_ps=2),
      ...     variable_partitioner=FixedShardsPartitioner(2))
      >>> with strategy.scope():
      ...     table = distrib.Variable(np.arange(10.0).reshape(5, 2), name="table")
      >>> table
      <ShardedVariable 'table' shape=(5, 2) dtype=float64 shards=2 rows=[3, 2]>
      >>> [v.device for v in table.variables]
      ['/job:ps/task:0', '/job:ps/task:1']
    """

    def __init__(self, cluster_resolver: ClusterResolver | None = None,
                 variable_partitioner: Partitioner | None = None):
        if cluster_resolver is None:
            resolver = TFConfigClusterResolver()
            cluster_resolver = resolver if resolver.cluster_spec() else RayClusterResolver()
        if not isinstance(cluster_resolver, ClusterResolver):
            raise TypeError(f"cluster_resolver must be a distrib cluster resolver. Received: "
                            f"{type(cluster_resolver).__name__}.")
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise TypeError(f"variable_partitioner must be a Partitioner (a callable). Received: "
                            f"{type(variable_partitioner).__name__}.")
        num_ps, num_workers = cluster_resolver.num_tasks("ps"), cluster_resolver.num_tasks("worker")
        if num_ps < 1 or num_workers < 1:
            raise ValueError(f"ParameterServerStrategy needs at least one \"ps\" and one \"worker\" task. Received: "
                             f"{cluster_resolver.cluster_spec()}.")
        from distrib.parameter_server.cluster import Cluster  # starts Ray: only when a strategy is made

        self._cluster_resolver = cluster_resolver
        self._partitioner = variable_partitioner
        self._cluster = Cluster(num_ps, num_workers)
        self._coordinator = None
        self._on_worker = False
        super().__init__(ParameterServerExtended(self, num_ps))

    @property
    def cluster_resolver(self) -> ClusterResolver | None:
        return self._cluster_resolver

    def __repr__(self) -> str:
        where = "worker side" if self._on_worker else f"workers={self._cluster.num_workers}"
        return f"<ParameterServerStrategy ps={self._extended._num_ps} {where} partitioner={self._partitioner!r}>"

    def _worker_factory(self) -> Callable[[], "ParameterServerStrategy"]:
        """Makes this strategy as a worker sees it; holds no reference to the strategy itself, so a scheduled
        closure that carries it does not keep a dropped strategy (and its actors) alive."""
        key = id(self) if not self._on_worker else self._key
        return functools.partial(_worker_side_strategy, key, self._extended._num_ps, self._partitioner)

    def __reduce__(self):
        factory = self._worker_factory()
        return factory.func, factory.args


def _worker_side_strategy(key: int, num_ps: int, partitioner: Any) -> ParameterServerStrategy:
    """The strategy as a closure sees it on a worker: runs one replica, reaches variables through their handles."""
    strategy = _WORKER_SIDE.get(key)
    if strategy is None:
        strategy = ParameterServerStrategy.__new__(ParameterServerStrategy)
        strategy._cluster_resolver, strategy._partitioner, strategy._cluster = None, partitioner, None
        strategy._coordinator, strategy._on_worker, strategy._key = None, True, key
        Strategy.__init__(strategy, ParameterServerExtended(strategy, num_ps))
        _WORKER_SIDE[key] = strategy
    return strategy


class ParameterServerExtended(StrategyExtended):
    """ParameterServerStrategy's extended API: variable placement and partitioning, one local replica."""

    def __init__(self, container_strategy: ParameterServerStrategy, num_ps: int):
        super().__init__(container_strategy, get_backend("cpu"), ("CPU:0",), ReductionToOneDevice(),
                         CommunicationOptions())
        self._num_ps = num_ps
        self._replica_context = ReplicaContext(container_strategy, 0)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        return tuple(f"/job:ps/task:{i}" for i in range(self._num_ps))

    # -- one replica, on the calling thread -------------------------------------------------------------

    def _call_for_each_replica(self, fn, args, kwargs, options=None):
        with context.frame(self._container_strategy, self._replica_context):
            return fn(*select_replica(0, args), **select_replica(0, kwargs))

    def _rendezvous(self, replica_id, kind, merge, payload, options):
        if kind == "all_reduce":  # one replica: nothing to reduce
            return payload[1]
        with context.frame(self._container_strategy, None):
            return merge([payload])[0]

    # -- variables --------------------------------------------------------------------------------------

    def _create_variable(self, initial_value: Any, trainable: bool | None = None, name: str | None = None,
                         synchronization: VariableSynchronization | str = VariableSynchronization.AUTO,
                         aggregation: VariableAggregation | str = VariableAggregation.NONE,
                         dtype: Any = None) -> Any:
        strategy = self._container_strategy
        if strategy._on_worker:
            raise ContextError("A ParameterServerStrategy creates variables on the coordinator, inside "
                               "strategy.scope(); a scheduled closure cannot create them.")
        context.require_cross_replica("distrib.Variable", hint="create variables inside strategy.scope(), outside "
                                      "strategy.run")
        synchronization = coerce_enum(VariableSynchronization, synchronization, "synchronization")
        if synchronization is VariableSynchronization.ON_READ:
            raise ValueError("ParameterServerStrategy keeps one copy of each variable; synchronization ON_READ "
                             "has no meaning there. Received: ON_READ.")
        aggregation = coerce_enum(VariableAggregation, aggregation, "aggregation")
        value = to_numpy(initial_value() if callable(initial_value) else initial_value)
        value = np.array(value.astype(dtype, copy=False) if dtype is not None else value, order="C")
        check_numeric(value.dtype)
        name = name or "Variable"
        trainable = True if trainable is None else bool(trainable)
        cluster = strategy._cluster
        colocated = getattr(self._colocation, "variable", None)
        if isinstance(colocated, ShardedVariable) and value.shape == colocated.shape:
            placement = [v._ps_index for v in colocated.variables]
            offsets = np.cumsum([0] + [v.shape[0] for v in colocated.variables]).tolist()
        elif colocated is not None:
            placement, offsets = [colocated.variables[0]._ps_index if isinstance(colocated, ShardedVariable)
                                  else colocated._ps_index], [0, None]
        else:
            parts = self._partitions(value, name)
            offsets = div_offsets(value.shape[0], parts) if parts > 1 else [0, None]
            first = cluster.next_ps()
            placement = [(first + i) % self._num_ps for i in range(len(offsets) - 1)]
            for _ in placement[1:]:  # the next variable starts after this one's last shard
                cluster.next_ps()
        if len(placement) == 1:
            return cluster.create_variable(placement[0], value, name, trainable, aggregation)
        shards = [cluster.create_variable(ps, value[a:b], f"{name}/part_{i}", trainable, aggregation)
                  for i, (ps, a, b) in enumerate(zip(placement, offsets, offsets[1:]))]
        return ShardedVariable(shards, name=name)

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether `v` is a parameter-server variable (one variable or the shards of one), as this strategy's
        scope creates them."""
        return isinstance(v, (ParameterServerVariable, ShardedVariable))

    def _partitions(self, value: np.ndarray, name: str) -> int:
        partitioner = self._container_strategy._partitioner
        if partitioner is None or value.ndim == 0:
            return 1
        parts = list(partitioner(value.shape, value.dtype))
        if len(parts) != value.ndim or any(p != 1 for p in parts[1:]) or parts[0] < 1:
            raise ValueError(f"A partitioner must return one positive count per axis, more than 1 only for axis 0. "
                             f"Received: {parts} for variable {name!r} of shape {value.shape}.")
        return parts[0]

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Variables created in this block go where `colocate_with_variable` is, with its sharding if they share its
        shape (an optimizer's slots), unpartitioned beside its first shard otherwise."""
        if context.current().strategy is not self._container_strategy:
            raise ContextError("colocate_vars_with must be used inside the strategy's scope().")
        if not isinstance(colocate_with_variable, (ParameterServerVariable, ShardedVariable)):
            raise ValueError(f"colocate_vars_with needs a variable created in this strategy's scope. Received: "
                             f"{colocate_with_variable!r}.")
        with context.thread_value(self._colocation, "variable", colocate_with_variable):
            yield

    def update(self, var: Any, fn: Any, args: Any = (), kwargs: dict | None = None, group: bool = True) -> Any:
        """Runs `fn(var, *args, **kwargs)` on the parameter server that holds `var`; returns what fn returns.

        `fn` travels there by pickling and receives the variable itself; writes it makes are applied once
        even when a closure runs again. A variable fn returns (`lambda x: x.assign(...)`, TensorFlow's idiom) comes
        back as its handle, `var` for instance; any other result must pickle, or a TypeError names it (fn's writes
        stand then, as when fn raises after writing).
        """
        if not callable(fn):
            raise TypeError(f"update needs a callable fn. Received: {type(fn).__name__}.")
        if not isinstance(var, ParameterServerVariable):
            raise TypeError(f"update runs fn where one variable lives: a variable of this strategy that is not "
                            f"sharded. Received: {var!r}; update each of a ShardedVariable's .variables instead.")
        args, kwargs = (var, *args), kwargs or {}
        result = optimizer_updates.call_on_server(var, fn, args, kwargs, ("update", var._key)).result()
        handles = {leaf._key: leaf for leaf in optree.tree_leaves((args, kwargs), none_is_leaf=True)
                   if isinstance(leaf, ParameterServerVariable)}
        return optree.tree_map(lambda leaf: handles.get(leaf.key, leaf) if isinstance(leaf, ServerVariable) else leaf,
                               result, none_is_leaf=True)

    # -- optimizers: their updates run on the servers ---------------------------------------------------

    def _build_optimizer(self, optimizer: Any, variables: list) -> None:
        optimizer_updates.build(self._container_strategy, optimizer, variables)

    def _apply_optimizer(self, optimizer: Any, grads: list, variables: list) -> Any:
        return optimizer_updates.apply(self._container_strategy, optimizer, grads, variables)

