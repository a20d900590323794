"""Strategy, StrategyExtended and ReplicaContext: the backend-agnostic API contract, and the default strategy."""

from __future__ import annotations

import contextlib
import math
import numbers
import threading
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from distrib import context
from distrib.backends import Backend, get_backend
from distrib.cross_device_ops import CrossDeviceOps, NcclAllReduce
from distrib.input import (DistributedDataset, DistributedDatasetsFromFunction, InputContext, InputWorkers,
                           ValueContext)
from distrib.devices import HOST, canonical_name
from distrib.errors import CollectiveMismatchError, ContextError
from distrib.options import CommunicationOptions, InputOptions, ReduceOp, RunOptions
from distrib.values import (DistributedValues, Mirrored, PerReplica, flatten, format_path, is_zero_scalar,
                            map_structure, regroup, select_replica, select_replicas, structure_mismatch, unflatten)
from distrib.variables import (DistributedVariable, MirroredVariable, Variable, VariableAggregation,
                               VariableSynchronization, create_distributed_variable, update_context)


def _component_array(component: Any) -> Any:
    """A variable component's current value; anything else as it is."""
    return component.read_value() if isinstance(component, Variable) else component


# Array kinds that cannot be summed: bool (NumPy's + is logical or), objects, bytes, strings, void.
_NOT_REDUCIBLE = "bOSUV"


def _local_components(value: Any) -> tuple | None:
    """The components of a distributed value or variable; None for anything else."""
    return tuple(value.values) if isinstance(value, DistributedValues) else None


class Strategy:
    """Distributes computation over replicas; the base of MirroredStrategy and of the default strategy.

    Use `scope()` to make it current, `run(fn)` to call `fn` once per replica, and `reduce`, `gather` and
    `experimental_local_results` to bring per-replica results back.
    """

    def __init__(self, extended: "StrategyExtended"):
        self._extended = extended

    @property
    def extended(self) -> "StrategyExtended":
        """Additional APIs for algorithms that need to be distribution-aware."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas are kept in sync."""
        return len(self._extended.worker_devices)

    @property
    def cluster_resolver(self):
        """The cluster resolver of a multi-worker strategy; None on one machine."""
        return None

    @contextlib.contextmanager
    def scope(self) -> Iterator["Strategy"]:
        """Makes this the current strategy, in a cross-replica context, for the duration of the block.

        Example:
          >>> import distrib
          >>> strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
          >>> with strategy.scope():
          ...     distrib.get_strategy() is strategy
          True
        """
        top = context.current()
        if top.strategy is self:
            with context.frame(self, top.replica_context):
                yield self
            return
        if not context.is_default(top.strategy):
            raise ValueError(f"Mixing different distrib strategies is not allowed: {self!r} was entered inside "
                             f"{top.strategy!r}.")
        with context.frame(self, None):
            yield self

    # -- running replicas -------------------------------------------------------------------------------

    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None,
            options: RunOptions | None = None) -> Any:
        """Calls `fn(*args, **kwargs)` once per replica, each in its own thread and replica context.

        `PerReplica` leaves of `args`/`kwargs` are unwrapped to the replica's component. Results are regrouped:
        values that differ per replica become `PerReplica`, the same object everywhere is returned as is.

        Raises:
          Whatever `fn` raised in a replica, as itself, with the replica id added to its message.
        """
        if not callable(fn):
            raise TypeError(f"run() needs a callable fn. Received: {type(fn).__name__}.")
        if options is not None and not isinstance(options, RunOptions):
            raise TypeError(f"options must be a distrib.RunOptions. Received: {type(options).__name__}.")
        if isinstance(args, (str, bytes)) or not isinstance(args, (list, tuple)):
            raise TypeError(f"args must be a tuple or list. Received: {type(args).__name__}.")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs must be a dict. Received: {type(kwargs).__name__}.")
        top = context.current()
        if top.strategy is self and top.replica_context is not None and not context.is_default(self):
            raise ContextError("Strategy.run cannot be called inside a replica function of the same strategy "
                               "(nested run). Call it from the cross-replica context.")
        with self.scope():
            return self._extended._call_for_each_replica(fn, tuple(args), dict(kwargs or {}))

    # -- bringing results back ------------------------------------------------------------------------

    def experimental_local_results(self, value: Any) -> tuple:
        """The per-replica components of `value`, as a tuple; a plain value gives a 1-tuple.

        Nested structures are split leaf by leaf, so a dict of PerReplica gives one dict per replica.
        """
        leaves, spec = flatten(value)
        components = [_local_components(leaf) for leaf in leaves]
        counts = {len(c) for c in components if c is not None}
        if not counts:
            return (value,)
        if len(counts) > 1:
            raise ValueError(f"experimental_local_results needs distributed values of one length. Received lengths "
                             f"{sorted(counts)}.")
        (count,) = counts
        return tuple(unflatten(spec, [leaf if c is None else c[i] for leaf, c in zip(leaves, components)])
                     for i in range(count))

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | Sequence[int] | None = None) -> Any:
        """Reduces a per-replica value across replicas to one host NumPy array (a nested structure works too).

        With `axis`, each replica's value is also reduced along that axis first; MEAN then divides by the
        *global* number of elements along it, so a partial batch split 4/2 divides by 6.

        Example:
          >>> import distrib, numpy as np
          >>> s = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
          >>> v = s.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group))
          >>> float(s.reduce("SUM", v, axis=None))
          1.0
        """
        self._extended._require_cross_replica("Strategy.reduce")
        op = ReduceOp.from_value(reduce_op)
        with self.scope():
            return map_structure(lambda leaf: self._reduce_leaf(op, leaf, axis), value)

    def _reduce_leaf(self, op: ReduceOp, value: Any, axis) -> Any:
        extended = self._extended
        if axis is None:
            result = extended._reduce_to(op, value, (HOST,), None)
            return _host_result(extended, result)
        backend = extended._backend
        components = _local_components(value)
        if components is None:  # TensorFlow runs the per-replica reduction on every replica
            components = (value,) * self.num_replicas_in_sync
        arrays = [backend.to_device(c, d) for c, d in zip(components, extended.worker_devices)]
        axes = _normalize_axes(axis, arrays[0].ndim)
        xp = backend.xp
        sums = []
        for array, device in zip(arrays, extended.worker_devices):
            with backend.device_scope(device):  # each replica's partial sum on its own device and stream
                sums.append(xp.sum(array, axis=axes, dtype=array.dtype if array.dtype.kind != "b" else None))
        total = backend.to_host(extended._cross_device_ops.reduce_to(backend, ReduceOp.SUM, sums,
                                                                     extended.worker_devices, (HOST,))[0])
        if op is ReduceOp.SUM:
            return total
        count = sum(math.prod(a.shape[i] for i in axes) for a in arrays)
        return np.asarray(total / np.asarray(count, dtype=total.dtype))  # 0-d division gives a NumPy scalar

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates the per-replica components of `value` along `axis` into one host NumPy array.

        Shapes may differ along `axis` only. In a replica context use `ReplicaContext.all_gather` instead.
        """
        self._extended._require_cross_replica("Strategy.gather", hint="inside a replica function use "
                                              "distrib.get_replica_context().all_gather(value, axis)")
        backend = self._extended._backend

        def gather_leaf(leaf):
            arrays = [backend.to_host(c) for c in self.experimental_local_results(leaf)]
            _check_gather_shapes("Strategy.gather", [a.shape for a in arrays], [a.dtype for a in arrays],
                                 axis, path=())
            return np.concatenate(arrays, axis=axis)

        return map_structure(gather_leaf, value)

    # -- input --------------------------------------------------------------------------------------------

    def experimental_distribute_dataset(self, dataset: Iterable, options: InputOptions | None = None
                                        ) -> DistributedDataset:
        """Splits each global batch of `dataset` along axis 0 across the replicas; iterate once per epoch.

        `dataset` is any iterable of global batches: arrays or nested structures of them (NumPy, or any array
        with `__dlpack__` or `__array__`). A batch of B rows gives each replica ceil(B / N) consecutive rows, the
        last replicas fewer or none (empty batches keep the trailing shape), so a partial last batch, or one
        smaller than the number of replicas, is fine. Each step yields the batch's structure with PerReplica
        leaves placed on the replicas' devices; the next steps are prepared in a background thread.

        Example:
          >>> import distrib, numpy as np
          >>> s = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
          >>> data = np.arange(6, dtype=np.float32)
          >>> [s.experimental_local_results(b) for b in s.experimental_distribute_dataset([data[:4], data[4:]])]
          [(array([0., 1.], dtype=float32), array([2., 3.], dtype=float32)), (array([4.], dtype=float32), array([5.], dtype=float32))]
        """
        self._extended._require_cross_replica("experimental_distribute_dataset")
        return DistributedDataset(dataset, self._extended._input_workers(), options)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Iterable],
                                          options: InputOptions | None = None) -> DistributedDatasetsFromFunction:
        """Builds the input pipeline(s) with `dataset_fn(InputContext)`; each replica takes one element per step.

        `dataset_fn` batches per replica (`ctx.get_per_replica_batch_size(global_batch_size)`) and shards by
        `ctx.input_pipeline_id` of `ctx.num_input_pipelines`. With `InputOptions(experimental_replication_mode=
        InputReplicationMode.PER_REPLICA)` it is called once per replica instead of once per worker.
        """
        self._extended._require_cross_replica("distribute_datasets_from_function")
        return DistributedDatasetsFromFunction(dataset_fn, self._extended._input_workers(), options)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Builds a `PerReplica` from `value_fn(ValueContext(i, n))`, called once per replica.

        `value_fn` runs with replica i's device current, so arrays it creates land there; values it returns
        are not moved (a GPU array on the wrong device is copied when a collective uses it).
        """
        if not callable(value_fn):
            raise TypeError(f"value_fn must be callable. Received: {type(value_fn).__name__}.")
        self._extended._require_cross_replica("experimental_distribute_values_from_function")
        extended = self._extended
        count = self.num_replicas_in_sync
        results = []
        for replica_id, device in enumerate(extended.worker_devices):
            with extended._backend.device_scope(device):
                results.append(value_fn(ValueContext(replica_id, count)))
        return regroup(results, PerReplica, always_wrap=True)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} devices={self._extended.worker_devices}>"


def _host_result(extended: "StrategyExtended", result: Any) -> Any:
    if isinstance(result, DistributedValues):
        result = result.values[0]
    return extended._backend.to_host(result)


def _normalize_axes(axis, ndim: int) -> tuple[int, ...]:
    axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    out = []
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, numbers.Integral):
            raise TypeError(f"axis must be an int, a tuple of ints or None. Received: {axis!r}.")
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for a value of rank {ndim}.")
        out.append(int(a) % ndim)
    return tuple(out)


def _check_gather_shapes(api: str, shapes: Sequence[tuple], dtypes: Sequence, axis: int, path: tuple) -> int:
    """Checks that shapes agree except along `axis` and dtypes agree; returns the normalized axis."""
    ndim = len(shapes[0])
    if ndim == 0:
        raise ValueError(f"{api} needs values of rank >= 1 to concatenate along axis {axis}. Received: a scalar "
                         f"at path {format_path(path)}.")
    (axis,) = _normalize_axes(axis, ndim)
    for replica_id, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        if dtype != dtypes[0]:
            raise CollectiveMismatchError(f"{api} needs the same dtype on every replica. Received: replica "
                                          f"{replica_id}, path {format_path(path)}, dtype {dtype} vs {dtypes[0]}.")
        if len(shape) != ndim or any(a != b for i, (a, b) in enumerate(zip(shape, shapes[0])) if i != axis):
            raise CollectiveMismatchError(f"{api} needs shapes that differ only along axis {axis}. Received: "
                                          f"replica {replica_id}, path {format_path(path)}, shape {shape} vs "
                                          f"{shapes[0]}.")
    return axis


class StrategyExtended:
    """Additional APIs for algorithms that need to be distribution-aware: reduce_to, batch_reduce_to, ...

    Args:
      container_strategy: the Strategy this extends.
      backend: where arrays live and collectives run.
      devices: the replicas' devices, canonical names.
      cross_device_ops: how values are reduced across devices.
      communication_options: defaults merged under every collective's own options.
    """

    def __init__(self, container_strategy: Strategy, backend: Backend, devices: Sequence[str],
                 cross_device_ops: CrossDeviceOps, communication_options: CommunicationOptions):
        self._container_strategy = container_strategy
        self._backend = backend
        self._devices = tuple(devices)
        self._cross_device_ops = cross_device_ops
        self._options = communication_options
        self._colocation = threading.local()  # .variable: the one colocate_vars_with is in effect for

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The devices replicas run on, in replica order."""
        return self._devices

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The devices variables are placed on (every replica's device for a mirrored strategy)."""
        return self._devices

    @property
    def experimental_require_static_shapes(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} devices={self._devices}>"

    @property
    def backend(self) -> Backend:
        return self._backend

    # -- context checks ---------------------------------------------------------------------------------

    def _require_cross_replica(self, api: str, hint: str = "") -> None:
        top = context.current()
        if top.replica_context is not None and not context.is_default(top.strategy):
            raise ContextError(f"{api} must be called in a cross-replica context (outside Strategy.run, or in a "
                               f"merge_call's merge_fn), not inside a replica function{'; ' + hint if hint else ''}.")
        if not context.is_default(top.strategy) and top.strategy is not self._container_strategy:
            raise ValueError(f"Mixing different distrib strategies is not allowed: {api} of "
                             f"{self._container_strategy!r} was called inside {top.strategy!r}'s scope.")

    # -- destinations -----------------------------------------------------------------------------------

    def _destinations(self, destinations: Any) -> tuple[str, ...]:
        if destinations is None:
            raise ValueError("destinations must be a device name, a distributed value or a distributed variable. "
                             "Received: None.")
        if isinstance(destinations, (list, tuple)):
            raise ValueError(f"destinations can not be a list or tuple; pass a device name or a distributed value. "
                             f"Received: {destinations!r}.")
        if isinstance(destinations, str):
            if destinations == HOST:
                return (HOST,)
            name = canonical_name(destinations)
            if name in self._devices:
                return (name,)
            if name == "CPU:0":  # the host CPU, when it is not one of the replicas' devices
                return (HOST,)
            raise ValueError(f"Unknown destination {destinations!r}: expected one of the strategy's devices "
                             f"{self._devices}, 'CPU:0' or 'host' for the host CPU.")
        if isinstance(destinations, DistributedVariable):
            return destinations.devices
        if isinstance(destinations, DistributedValues):
            if len(destinations.values) == len(self._devices):
                return self._devices
            raise ValueError(f"destinations has {len(destinations.values)} components but the strategy has "
                             f"{len(self._devices)} replicas.")
        raise TypeError(f"destinations must be a device name, a distributed value or a distributed variable. "
                        f"Received: {type(destinations).__name__}.")

    # -- reductions -------------------------------------------------------------------------------------

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any,
                  options: CommunicationOptions | None = None) -> Any:
        """Reduces `value` (usually a PerReplica) to `destinations`; returns a `Mirrored` there.

        A `Mirrored` value with MEAN is returned unchanged; a plain value with MEAN too; a plain value with SUM
        on more than one replica raises ValueError (it would be counted once per replica).
        """
        self._require_cross_replica("reduce_to")
        op = ReduceOp.from_value(reduce_op)
        return self._reduce_to(op, value, self._destinations(destinations), options)

    def _reduce_to(self, op: ReduceOp, value: Any, destinations: tuple[str, ...],
                   options: CommunicationOptions | None) -> Any:
        (result,) = self._batch_reduce_to(op, [(value, destinations)], options)
        return result

    def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]],
                        options: CommunicationOptions | None = None) -> list:
        """Several reduce_to calls in one: pairs reduced onto their own devices share packed all-reduces.

        Example:
          >>> import distrib, numpy as np
          >>> s = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
          >>> v = s.experimental_distribute_values_from_function(lambda ctx: np.ones(3, np.float32))
          >>> [m.values[0].tolist() for m in s.extended.batch_reduce_to("SUM", [(v, v), (v, v)])]
          [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
        """
        self._require_cross_replica("batch_reduce_to")
        op = ReduceOp.from_value(reduce_op)
        if isinstance(value_destination_pairs, (str, bytes)) or not isinstance(value_destination_pairs,
                                                                                (list, tuple)):
            raise TypeError("value_destination_pairs must be a list of (value, destinations) pairs.")
        pairs = []
        for k, pair in enumerate(value_destination_pairs):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise TypeError(f"value_destination_pairs[{k}] must be a (value, destinations) pair. Received: "
                                f"{pair!r}.")
            pairs.append((pair[0], self._destinations(pair[1])))
        return self._batch_reduce_to(op, pairs, options)

    def _batch_reduce_to(self, op: ReduceOp, pairs: Sequence[tuple[Any, tuple[str, ...]]],
                         options: CommunicationOptions | None) -> list:
        options = self._options.merge(options)
        backend, devices = self._backend, self._devices
        results: list[Any] = [None] * len(pairs)
        all_reduce_ids, all_reduce_values = [], []
        for k, (value, destinations) in enumerate(pairs):
            components = _local_components(value)
            mirrored = isinstance(value, (Mirrored, MirroredVariable))  # TensorFlow's is_mirrored
            if mirrored and op is ReduceOp.MEAN:
                results[k] = value
            elif mirrored:
                raise ValueError("reduce_to(SUM) of a Mirrored value would count it once per replica; a Mirrored "
                                 "value is already reduced. Reduce the PerReplica value it came from instead.")
            elif components is None:
                results[k] = self._reduce_non_distributed(op, value, destinations)
            elif len(components) != len(devices):
                raise ValueError(f"reduce_to needs one component per replica ({len(devices)}). Received: "
                                 f"{len(components)}.")
            else:
                arrays = [backend.to_device(_component_array(c), d) for c, d in zip(components, devices)]
                _check_reduce_inputs(arrays, k)
                if destinations == devices:
                    all_reduce_ids.append(k)
                    all_reduce_values.append(arrays)
                else:
                    results[k] = Mirrored(self._cross_device_ops.reduce_to(backend, op, arrays, devices,
                                                                           destinations))
        if all_reduce_ids:
            per_replica = [list(values) for values in zip(*all_reduce_values)]
            reduced = self._cross_device_ops.batch_all_reduce(backend, op, per_replica, devices, options)
            for k, arrays in zip(all_reduce_ids, zip(*reduced)):
                results[k] = Mirrored(arrays)
        return results

    def _reduce_non_distributed(self, op: ReduceOp, value: Any, destinations: tuple[str, ...]) -> Any:
        if is_zero_scalar(value) or op is ReduceOp.MEAN:
            return value
        if len(self._devices) > 1:
            raise ValueError(f"A non-distributed value cannot be reduced with SUM on {len(self._devices)} replicas: it "
                             f"would be counted once per replica. Received: {type(value).__name__}. Pass a "
                             f"PerReplica (from run or experimental_distribute_values_from_function) instead.")
        return self._broadcast(value, destinations)

    def _batch_all_reduce(self, op: ReduceOp, per_replica: Sequence[Sequence[Any]],
                          options: CommunicationOptions | None) -> list[list[Any]]:
        """All-reduce of `per_replica[r][v]` (arrays already on replica r's device), for ReplicaContext."""
        return self._cross_device_ops.batch_all_reduce(self._backend, op, per_replica, self._devices,
                                                       self._options.merge(options))

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """Copies `tensor` to every destination device as a Mirrored; Python numbers are returned unchanged."""
        self._require_cross_replica("broadcast_to")
        if isinstance(tensor, (int, float)) and not isinstance(tensor, bool):
            return tensor
        return self._broadcast(tensor, self._destinations(destinations))

    def _broadcast(self, value: Any, destinations: tuple[str, ...]) -> Mirrored:
        if destinations == (HOST,):
            return Mirrored([self._backend.to_host(value)])
        source = self._backend.to_device(value, destinations[0])
        return Mirrored(self._cross_device_ops.broadcast(self._backend, source, destinations))

    # -- variables --------------------------------------------------------------------------------------

    def _create_variable(self, initial_value: Any, trainable: bool | None = None, name: str | None = None,
                         synchronization: VariableSynchronization | str = VariableSynchronization.AUTO,
                         aggregation: VariableAggregation | str = VariableAggregation.NONE,
                         dtype: Any = None) -> DistributedVariable:
        """What `distrib.Variable(...)` builds inside this strategy's scope."""
        if context.get_replica_context() is not None:
            raise ContextError("Create variables in the cross-replica context (inside strategy.scope(), outside "
                               "strategy.run), so that every replica shares them.")
        colocated = getattr(self._colocation, "variable", None)
        devices = colocated.devices if colocated is not None else self._devices
        return create_distributed_variable(self._container_strategy, self._backend, devices, initial_value,
                                           trainable, name, synchronization, aggregation, dtype)

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Variables created in this block are placed on the same devices as `colocate_with_variable`.

        Example:
          >>> import distrib, numpy as np
          >>> s = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
          >>> with s.scope():
          ...     v1 = distrib.Variable(np.zeros(3, np.float32))
          ...     with s.extended.colocate_vars_with(v1):
          ...         v2 = distrib.Variable(np.float32(1))
          >>> v2.devices == v1.devices
          True
        """
        top = context.current()
        if top.strategy is not self._container_strategy:
            raise ContextError("colocate_vars_with must be used inside the strategy's scope().")
        if not isinstance(colocate_with_variable, DistributedVariable) or \
                colocate_with_variable._strategy is not self._container_strategy:
            raise ValueError(f"colocate_vars_with needs a variable created in this strategy's scope. Received: "
                             f"{colocate_with_variable!r}.")
        with context.thread_value(self._colocation, "variable", colocate_with_variable):
            yield

    def update(self, var: Any, fn: Callable, args: Sequence = (), kwargs: dict | None = None,
               group: bool = True) -> Any:
        """Runs `fn(component, *args_i, **kwargs_i)` on each of `var`'s components, on its device.

        `args`/`kwargs` are unwrapped per component (a Mirrored gives its i-th value; distributed variables
        read their i-th component). From a replica context this goes through merge_call. With `group`, the
        results come back regrouped (the variable itself when fn returns its components), else per replica.
        """
        if not callable(fn):
            raise TypeError(f"update needs a callable fn. Received: {type(fn).__name__}.")
        ctx = context.get_replica_context()
        if ctx is not None and ctx.strategy is self._container_strategy:
            return ctx.merge_call(lambda strategy, *a, **kw: strategy.extended.update(var, fn, a, kw, group),
                                  args=args, kwargs=kwargs)
        if isinstance(var, DistributedVariable):
            if var._strategy is not self._container_strategy:
                raise ValueError(f"update got a variable of another strategy: {var!r}.")
            components = var.values
        elif isinstance(var, Variable):
            components = (var,)
        else:
            raise TypeError(f"update needs a variable. Received: {type(var).__name__}.")
        kwargs = kwargs or {}
        results = []
        with self._container_strategy.scope():  # fn sees this strategy, cross-replica, as in TensorFlow
            for i, component in enumerate(components):
                with update_context(i), self._backend.device_scope(component.device):
                    results.append(fn(component, *select_replica(i, tuple(args)), **select_replica(i, kwargs)))
        return regroup(results, Mirrored if group else PerReplica)

    def _input_workers(self) -> InputWorkers:
        """This process's share of the input: one worker feeding every local replica."""
        return InputWorkers(self._backend, self._devices)

    # -- replica execution (implemented by each strategy) -----------------------------------------------

    def _call_for_each_replica(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def _rendezvous(self, replica_context: "ReplicaContext", kind: str, merge: Callable[[list], list],
                    payload: Any, options: CommunicationOptions | None) -> Any:
        """Blocks the calling replica until every replica arrives, then returns its share of `merge(payloads)`.

        `merge` runs once, on the thread that called `run`, in the cross-replica context; it receives one
        payload per replica in replica order and returns one result per replica.
        """
        raise NotImplementedError


def _check_reduce_inputs(arrays: Sequence[Any], position: int) -> None:
    first = arrays[0]
    if first.dtype.kind in _NOT_REDUCIBLE:
        raise TypeError(f"Reductions need numeric values. Received: dtype {first.dtype} at value {position}.")
    for replica_id, array in enumerate(arrays[1:], start=1):
        if array.shape != first.shape or array.dtype != first.dtype:
            raise CollectiveMismatchError(
                f"reduce_to needs the same shape and dtype on every replica. Received: replica {replica_id}, value "
                f"{position}, {array.dtype}{list(array.shape)} vs {first.dtype}{list(first.shape)}.")


class ReplicaContext:
    """The APIs available inside a replica function: all_reduce, all_gather, merge_call and the replica's id.

    Get it with `distrib.get_replica_context()` inside the function passed to `Strategy.run`.

    Example:
      >>> import distrib, numpy as np
      >>> s = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
      >>> def step():
      ...     ctx = distrib.get_replica_context()
      ...     return ctx.all_reduce("SUM", np.float32(ctx.replica_id_in_sync_group + 1))
      >>> [float(x) for x in s.experimental_local_results(s.run(step))]
      [3.0, 3.0]
    """

    def __init__(self, strategy: Strategy, replica_id_in_sync_group: int):
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's id, from 0 to num_replicas_in_sync - 1."""
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def devices(self) -> tuple[str, ...]:
        """The device this replica runs on, as a 1-tuple."""
        return (self._strategy.extended.worker_devices[self._replica_id],)

    def _require_current(self, api: str) -> None:
        if context.get_replica_context() is not self:
            raise ContextError(f"ReplicaContext.{api} must be called inside the function passed to Strategy.run, "
                               f"on the replica it belongs to (replica {self._replica_id}).")

    def merge_call(self, merge_fn: Callable, args: Sequence = (), kwargs: dict | None = None) -> Any:
        """Runs `merge_fn(strategy, *args, **kwargs)` once, cross-replica, with per-replica args as PerReplica.

        Every replica must call merge_call (and every collective, which is one) the same number of times.
        Returns this replica's component of the result.
        """
        self._require_current("merge_call")
        if not callable(merge_fn):
            raise TypeError(f"merge_fn must be callable. Received: {type(merge_fn).__name__}.")
        strategy = self._strategy

        def merge(payloads: list) -> list:
            merged_args = regroup([p[0] for p in payloads])
            merged_kwargs = regroup([p[1] for p in payloads])
            result = merge_fn(strategy, *merged_args, **merged_kwargs)
            return select_replicas(result, len(payloads))

        return strategy.extended._rendezvous(self, "merge_call", merge, (tuple(args), dict(kwargs or {})), None)

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: CommunicationOptions | None = None) -> Any:
        """Reduces `value` (a nested structure of arrays) across replicas; every replica gets the result.

        All leaves travel in one batched reduction, packed by dtype and `options.bytes_per_pack`. MEAN of
        integers gives floats (1..4 averages to 2.5).

        Raises:
          CollectiveMismatchError (a ValueError): replicas passed different structures, shapes or dtypes.
        """
        self._require_current("all_reduce")
        op = ReduceOp.from_value(reduce_op)
        if options is not None and not isinstance(options, CommunicationOptions):
            raise TypeError(f"options must be a CommunicationOptions. Received: {type(options).__name__}.")
        leaves, spec = flatten(value)
        if not leaves:
            return value
        extended = self._strategy.extended
        arrays = extended._backend.to_device_all(leaves, extended.worker_devices[self._replica_id])
        if any(dtype.kind in _NOT_REDUCIBLE for dtype in {a.dtype for a in arrays}):  # few distinct dtypes
            k = next(k for k, a in enumerate(arrays) if a.dtype.kind in _NOT_REDUCIBLE)
            raise TypeError(f"all_reduce needs numeric values. Received: dtype {arrays[k].dtype} at path "
                            f"{format_path(spec.paths()[k])}.")

        def merge(payloads: list) -> list:
            _check_same_layout("all_reduce", payloads)
            return extended._batch_all_reduce(op, [p[1] for p in payloads], options)

        results = extended._rendezvous(self, "all_reduce", merge, (spec, arrays), options)
        return unflatten(spec, results)

    def all_gather(self, value: Any, axis: int, options: CommunicationOptions | None = None) -> Any:
        """Concatenates `value` from every replica along `axis`; shapes may differ along `axis` only."""
        self._require_current("all_gather")
        leaves, spec = flatten(value)
        if not leaves:
            return value
        extended = self._strategy.extended
        arrays = extended._backend.to_device_all(leaves, extended.worker_devices[self._replica_id])

        def merge(payloads: list) -> list:
            _check_same_layout("all_gather", payloads, gather_axis=axis)
            gathered = [extended._cross_device_ops.all_gather(extended._backend, list(column),
                                                              extended.worker_devices, axis)
                        for column in zip(*(p[1] for p in payloads))]
            return [list(per_replica) for per_replica in zip(*gathered)]

        return unflatten(spec, extended._rendezvous(self, "all_gather", merge, (spec, arrays), options))

    def __repr__(self) -> str:
        return (f"<ReplicaContext replica_id_in_sync_group={self._replica_id} "
                f"num_replicas_in_sync={self.num_replicas_in_sync}>")


def _check_same_layout(api: str, payloads: list, gather_axis: int | None = None) -> None:
    """Every replica's (spec, arrays) must match replica 0's: structure, then each leaf's shape and dtype."""
    spec0, arrays0 = payloads[0]
    for replica_id, (spec, _) in enumerate(payloads[1:], start=1):  # every structure first: leaves line up after
        if spec != spec0:
            raise CollectiveMismatchError(structure_mismatch(f"{api} needs the same structure on every replica",
                                                              replica_id, spec0.paths(), spec.paths(), spec0, spec))
    if gather_axis is not None:
        for k, path in enumerate(spec0.paths()):
            _check_gather_shapes(api, [p[1][k].shape for p in payloads], [p[1][k].dtype for p in payloads],
                                 gather_axis, path)
        return
    shapes0, dtypes0 = [a.shape for a in arrays0], [a.dtype for a in arrays0]
    for replica_id, (_, arrays) in enumerate(payloads[1:], start=1):
        if [a.shape for a in arrays] == shapes0 and [a.dtype for a in arrays] == dtypes0:
            continue  # the common case, checked in bulk
        for k, path in enumerate(spec0.paths()):
            for what, mine, first in (("shape", arrays[k].shape, shapes0[k]), ("dtype", arrays[k].dtype, dtypes0[k])):
                if mine != first:
                    raise CollectiveMismatchError(f"{api} needs the same {what} on every replica. Received: replica "
                                                  f"{replica_id}, path {format_path(path)}, {what} {mine} vs {first}.")


class _DefaultExtended(StrategyExtended):
    """The default strategy: one replica, the calling thread, no communication."""

    def __init__(self, container_strategy: Strategy):
        self._container_strategy = container_strategy
        self._devices = ("CPU:0",)
        self._cross_device_ops = NcclAllReduce(num_packs=1)
        self._options = CommunicationOptions()
        self._colocation = threading.local()
        self._backend_instance: Backend | None = None

    @property
    def _backend(self) -> Backend:  # created on first use so that importing distrib probes no GPU
        if self._backend_instance is None:
            self._backend_instance = get_backend("cpu")
        return self._backend_instance

    def _call_for_each_replica(self, fn, args, kwargs):
        return fn(*select_replica(0, args), **select_replica(0, kwargs))

    def _rendezvous(self, replica_context, kind, merge, payload, options):
        if kind == "all_reduce":  # one replica: nothing to reduce, the value comes back as it went in
            return payload[1]
        with context.frame(self._container_strategy, None):
            return merge([payload])[0]


class _DefaultStrategy(Strategy):
    """The strategy in effect outside any scope: one replica, no distribution."""

    def __init__(self):
        super().__init__(_DefaultExtended(self))

    def scope(self):
        return contextlib.nullcontext(self)

    def __repr__(self) -> str:
        return "<DefaultStrategy>"


_DEFAULT_STRATEGY = _DefaultStrategy()
_DEFAULT_REPLICA_CONTEXT = ReplicaContext(_DEFAULT_STRATEGY, 0)
context.set_default_frame(context.Frame(_DEFAULT_STRATEGY, _DEFAULT_REPLICA_CONTEXT))
