"""StrategyExtended: reduce_to, batch_reduce_to, update, broadcast_to, and the interface ReplicaContext uses."""

from __future__ import annotations

import abc
import contextlib
import math
import operator
import threading
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from distrib import context
from distrib.backends import Backend
from distrib.cross_device_ops import CrossDeviceOps
from distrib.destinations import resolve_destinations
from distrib.devices import HOST
from distrib.distributed_variables import DistributedVariable, MirroredVariable, create_distributed_variable
from distrib.errors import ContextError
from distrib.input import InputWorkers
from distrib.interrupts import deferred_interrupts
from distrib.options import CommunicationOptions, ReduceOp, RunOptions
from distrib.plan import integer_mean, is_inexact
from distrib.reduce_inputs import (PER_REPLICA, REDUCIBLE, check_reduce_inputs, component_array, never_placed,
                                   placed_batch)
from distrib.replica_context import normalize_axes
from distrib.values import (DistributedValues, Mirrored, PerReplica, flatten, holds_leaf, is_zero_scalar,
                            local_components, regroup, register_leaf_type, select_replicas, unflatten)
from distrib.variables import Variable, VariableAggregation, VariableSynchronization, update_context

NOT_NOW = object()  # `_run_at_once`: this run takes the general path


def _sum_dtype(dtype: np.dtype) -> np.dtype | None:
    """The dtype a partial sum keeps: the value's, in native byte order (a ufunc's dtype= takes no byte order);
    None for booleans, which NumPy sums as integers."""
    if dtype.kind == "b":
        return None
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def _refuse_nested_distributed(value: Any, position: int) -> None:
    """TypeError where a pair of batch_reduce_to holds distributed values inside a structure: taken as one plain
    value, it would come back unreduced (MEAN) or be refused as non-distributed (SUM)."""
    if holds_leaf(value, DistributedValues):
        raise TypeError(f"batch_reduce_to takes one distributed value per (value, destinations) pair; pair "
                        f"{position}'s value is a {type(value).__name__} holding distributed values. Pass each as a "
                        f"pair of its own, or use reduce_to, which reduces a structure leaf by leaf.")


class StrategyExtended(abc.ABC):
    """Additional APIs for algorithms that need to be distribution-aware: reduce_to, batch_reduce_to, ...

    Args:
      container_strategy: the Strategy this extends.
      backend: where arrays live and collectives run.
      devices: the replicas' devices, canonical names.
      cross_device_ops: how values are reduced across devices.
      communication_options: defaults merged under every collective's own options.
    """

    _first_local_replica = 0  # the global id of this process's first replica (nonzero on later workers)
    _inline: Any = None  # the replica context of a run on the calling thread (MirroredExtended's `_merge_inline`)

    def __init__(self, container_strategy: Any, backend: Backend, devices: Sequence[str],
                 cross_device_ops: CrossDeviceOps, communication_options: CommunicationOptions):
        self._container_strategy = container_strategy
        self._backend = backend
        register_leaf_type(backend.xp.ndarray)  # flatten's and regroup's fast paths: 4x faster for 200 CuPy arrays
        self._devices = tuple(devices)
        self._cross_device_ops = cross_device_ops
        self._options = communication_options
        self._host_arrays = backend.xp is np  # emulated devices: an array is on every device already
        self._placed = backend.placed_check(self._devices) or never_placed  # values that need no placement
        self._colocation = threading.local()  # .variable: the one colocate_vars_with is in effect for

    @property
    def _container_strategy(self) -> Any:
        return self._strategy_ref()

    @_container_strategy.setter
    def _container_strategy(self, strategy: Any) -> None:
        # weak: the strategy owns this object, and a cycle would keep a dropped strategy's threads until a gc
        self._strategy_ref = weakref.ref(strategy)

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

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process writes checkpoints (in a multi-worker job, only the chief does)."""
        return True

    def _barrier(self, what: str) -> None:
        """Waits until every process of the job reaches this point; one process: nothing to wait for."""

    def _first_replica_value(self, value: Any) -> Any:
        """Replica 0's `value` (given by each process for its first local replica), as every process sees it."""
        return value

    def __repr__(self) -> str:
        return f"<{type(self).__name__} devices={self._devices}>"

    @property
    def backend(self) -> Backend:
        """Where this strategy's arrays live and its collectives run."""
        return self._backend

    def _require_cross_replica(self, api: str, hint: str = "") -> None:
        context.require_cross_replica(api, self._strategy_ref(), hint)

    # -- destinations -----------------------------------------------------------------------------------

    def _destinations(self, destinations: Any) -> tuple[str, ...]:
        return resolve_destinations(destinations, self._devices)

    # -- reductions -------------------------------------------------------------------------------------

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any,
                  options: CommunicationOptions | None = None) -> Any:
        """Reduces `value` (usually a PerReplica) to `destinations`; returns a `Mirrored` there.

        A `Mirrored` value with MEAN is returned unchanged; a plain value with MEAN too; a plain value with SUM
        on more than one replica raises ValueError (it would be counted once per replica). A nested structure
        (a dict, list or tuple of values, as a merge_call hands its args) is reduced leaf by leaf, in one batch,
        as TensorFlow maps its reduction over the structure.
        """
        context.require_cross_replica("reduce_to", self._strategy_ref())
        op = ReduceOp.from_value(reduce_op)
        resolved = resolve_destinations(destinations, self._devices)
        if isinstance(value, (dict, list, tuple)) and not isinstance(value, DistributedValues):
            leaves, spec = flatten(value)
            return unflatten(spec, self._batch_reduce_to(op, [(leaf, resolved) for leaf in leaves], options))
        return self._batch_reduce_to(op, [(value, resolved)], options)[0]

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
        if not value_destination_pairs:
            return []
        if not _PAIR_TYPES.issuperset(map(type, value_destination_pairs)) or \
                set(map(len, value_destination_pairs)) != {2}:  # checked in bulk: a step batches every gradient
            for k, pair in enumerate(value_destination_pairs):
                if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                    shown = repr(pair)
                    if "\n" in shown:  # a distributed value's runs over lines: its type says enough
                        shown = f"a {type(pair).__name__}"
                    raise TypeError(f"value_destination_pairs[{k}] must be a (value, destinations) pair. "
                                    f"Received: {shown}.")
        values, destinations = zip(*value_destination_pairs)
        devices = self._devices
        if set(map(type, destinations)) == PER_REPLICA and set(map(len, map(_VALUES, destinations))) == \
                {len(devices)}:  # each onto a PerReplica of this strategy: `resolve_destinations`' first case
            resolved = [devices] * len(destinations)
        else:
            resolved = [resolve_destinations(d, devices) for d in destinations]
        return self._batch_reduce_to(op, list(zip(values, resolved)), options)

    def _batch_reduce_to(self, op: ReduceOp, pairs: Sequence[tuple[Any, tuple[str, ...]]],
                         options: CommunicationOptions | None) -> list:
        options = self._merged_options(options)
        backend, devices = self._backend, self._devices
        if len(pairs) == 1 and pairs[0][1] == devices:  # one value onto its own devices: a step's usual reduce_to,
            arrays = self._placed_components(pairs[0][0], 0)  # without the batching below
            if arrays is not None:
                reduced = self._cross_device_ops.batch_all_reduce(backend, op, list(map(list, zip(arrays))),
                                                                  devices, options)
                return [Mirrored(list(map(_FIRST, reduced)))]
        per_replica = self._placed_batch(pairs) if len(pairs) > 1 else None
        if per_replica is not None:  # a step's gradients: every value in place, checked in bulk, no loop over them
            reduced = self._cross_device_ops.batch_all_reduce(backend, op, per_replica, devices, options)
            return Mirrored._wrap_all(list(zip(*reduced)))
        results: list[Any] = [None] * len(pairs)
        # (ids, per-value arrays) reduced in one batch: onto the values' own devices, and onto the host
        all_reduce_batch: tuple[list, list] = ([], [])
        host_batch: tuple[list, list] = ([], [])
        for k, (value, destinations) in enumerate(pairs):
            batch = all_reduce_batch if destinations == devices else host_batch if destinations == (HOST,) else None
            arrays = None if batch is None else self._placed_components(value, k)
            if arrays is not None:
                batch[0].append(k)
                batch[1].append(arrays)
                continue
            components = self._local_components(value)
            mirrored = isinstance(value, (Mirrored, MirroredVariable))  # TensorFlow's is_mirrored
            if mirrored and op is ReduceOp.MEAN:
                results[k] = value
            elif mirrored:
                raise ValueError("reduce_to(SUM) of a Mirrored value would count it once per replica; a Mirrored "
                                 "value is already reduced. Reduce the PerReplica value it came from instead.")
            elif components is None:
                _refuse_nested_distributed(value, k)
                results[k] = self._reduce_non_distributed(op, value, destinations)
            elif len(components) != len(devices):
                raise ValueError(f"reduce_to needs one component per replica ({len(devices)}). Received: "
                                 f"{len(components)}.")
            else:
                arrays = [backend.to_device(component_array(c), d) for c, d in zip(components, devices)]
                check_reduce_inputs(arrays, k)
                if batch is not None:
                    batch[0].append(k)
                    batch[1].append(arrays)
                else:
                    results[k] = Mirrored(self._cross_device_ops.reduce_to(backend, op, arrays, devices,
                                                                           destinations, options.timeout))
        ids, values = all_reduce_batch
        if ids:
            per_replica = list(map(list, zip(*values)))
            reduced = self._cross_device_ops.batch_all_reduce(backend, op, per_replica, devices, options)
            for k, arrays in zip(ids, zip(*reduced)):
                results[k] = Mirrored(arrays)
        ids, values = host_batch
        if ids:
            per_replica = [list(column) for column in zip(*values)]
            for k, array in zip(ids, self._cross_device_ops.batch_reduce_to_host(backend, op, per_replica, devices,
                                                                                 options.timeout)):
                results[k] = Mirrored([array])
        return results

    def _placed_batch(self, pairs: Sequence[tuple[Any, tuple[str, ...]]]) -> list[list[Any]] | None:
        """`placed_batch` of these (value, resolved destinations) pairs on this strategy's devices."""
        values, destinations = zip(*pairs)
        return placed_batch(values, destinations, self._devices, self._placed, self._plain_values_are_components)

    def _placed_components(self, value: Any, position: int) -> tuple | None:
        """The components of `value`, checked, when it is a PerReplica of the backend's own arrays on the replicas'
        devices already (NumPy arrays on emulated devices, CuPy arrays each on its GPU); else None, for the general
        route, which places each component."""
        if type(value) is PerReplica and len(value._values) == len(self._devices) and self._placed(value._values):
            arrays = value._values
            if len(arrays) > 1 or arrays[0].dtype not in REDUCIBLE:  # else nothing to check
                check_reduce_inputs(arrays, position)
            return arrays
        return None

    _plain_values_are_components = False  # a plain value to reduce is one replica's (multi-worker, one each)

    def _local_components(self, value: Any) -> tuple | None:
        """This process's per-replica components of a value to reduce; None for a value that is not distributed."""
        return local_components(value)

    def _reduce_non_distributed(self, op: ReduceOp, value: Any, destinations: tuple[str, ...]) -> Any:
        if is_zero_scalar(value) or op is ReduceOp.MEAN:
            return value
        replicas = self._container_strategy.num_replicas_in_sync  # every process's: each decides alike
        if replicas > 1:
            raise ValueError(f"A non-distributed value cannot be reduced with SUM on {replicas} replicas: it "
                             f"would be counted once per replica. Received: {type(value).__name__}. Pass a "
                             f"PerReplica (from run or experimental_distribute_values_from_function) instead.")
        return self._broadcast(value, destinations)


    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """Copies `tensor` to every destination device as a Mirrored; Python numbers (bools too, as in
        TensorFlow) are returned unchanged."""
        self._require_cross_replica("broadcast_to")
        if isinstance(tensor, (int, float)):
            return tensor
        return self._broadcast(tensor, self._destinations(destinations))

    def _broadcast(self, value: Any, destinations: tuple[str, ...]) -> Mirrored:
        if destinations == (HOST,):
            return Mirrored([self._backend.to_host(value)])
        source = self._backend.to_device(value, destinations[0])
        return Mirrored(self._cross_device_ops.broadcast(self._backend, source, destinations, self._options.timeout))

    # -- variables --------------------------------------------------------------------------------------

    def _create_variable(self, initial_value: Any, trainable: bool | None = None, name: str | None = None,
                         synchronization: VariableSynchronization | str = VariableSynchronization.AUTO,
                         aggregation: VariableAggregation | str = VariableAggregation.NONE,
                         dtype: Any = None) -> DistributedVariable:
        """What `distrib.Variable(...)` builds inside this strategy's scope.

        Inside `strategy.run` every replica calls it; one merge_call then creates one variable from replica 0's
        initial value and hands it to every replica, as TensorFlow's MirroredStrategy does.
        """
        top = context.current()
        if top.replica_context is not None and top.strategy is self._container_strategy:
            return top.replica_context.merge_call(lambda strategy: self._create_variable(
                initial_value, trainable, name, synchronization, aggregation, dtype))
        context.require_cross_replica("distrib.Variable", self._container_strategy)
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
        count = len(components)
        per_args = select_replicas(tuple(args), count, exact=False)  # each copy's args, walked once for all
        per_kwargs = select_replicas(kwargs or {}, count, exact=False)
        results = []
        # fn sees this strategy, cross-replica, as in TensorFlow; Ctrl-C lands before or after all copies
        with self._container_strategy._enter_scope(), deferred_interrupts():
            for i, component in enumerate(components):
                with update_context(i), self._backend.device_scope(component.device):
                    results.append(fn(component, *per_args[i], **per_kwargs[i]))
        return regroup(results, Mirrored if group else PerReplica)

    # -- TensorFlow's smaller StrategyExtended methods ------------------------------------------------------

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether `v` is a variable created while this strategy's scope was in effect."""
        return isinstance(v, DistributedVariable) and v._strategy is self._container_strategy

    def value_container(self, value: Any) -> Any:
        """The distributed variable that `value` (one of its per-replica components) belongs to; else `value`."""
        ref = getattr(value, "_distributed_container", None)
        container = ref() if ref is not None else None
        return value if container is None else container

    def non_slot_devices(self, var_list: Sequence[Any]) -> tuple[str, ...]:
        """The devices of state not tied to one variable (an optimizer's step count): every replica's device."""
        del var_list
        return self._devices

    def update_non_slot(self, colocate_with: Any, fn: Callable, args: Sequence = (), kwargs: dict | None = None,
                        group: bool = True) -> Any:
        """Runs `fn(*args_i, **kwargs_i)` once per device of `colocate_with` (from `non_slot_devices`) in an
        update context, as `update` does per component; the results regrouped (Mirrored with `group`)."""
        if not callable(fn):
            raise TypeError(f"update_non_slot needs a callable fn. Received: {type(fn).__name__}.")
        self._require_cross_replica("update_non_slot")
        devices = (colocate_with,) if isinstance(colocate_with, str) else tuple(colocate_with)
        per_args = select_replicas(tuple(args), len(devices), exact=False)
        per_kwargs = select_replicas(kwargs or {}, len(devices), exact=False)
        results = []
        with self._container_strategy._enter_scope(), deferred_interrupts():
            for i, device in enumerate(devices):
                with update_context(i), self._backend.device_scope(device):
                    results.append(fn(*per_args[i], **per_kwargs[i]))
        return regroup(results, Mirrored if group else PerReplica)

    def _input_workers(self) -> InputWorkers:
        """This process's share of the input: one worker feeding every local replica."""
        return InputWorkers(self._backend, self._devices)

    # -- host and device results, for Strategy.reduce and Strategy.gather ----------------------------------

    def _reduce_to_host(self, op: ReduceOp, leaves: Sequence[Any], axis) -> list[np.ndarray]:
        """Each leaf reduced across replicas (and first along `axis` within each) to one host NumPy array; the
        per-replica leaves travel in one batched reduction (one buffer per dtype)."""
        if axis is None:
            results = self._batch_reduce_to(op, [(leaf, (HOST,)) for leaf in leaves], None)
            return [self._backend.to_host(r.values[0] if isinstance(r, DistributedValues) else r) for r in results]
        backend, devices = self._backend, self._devices
        sums, counts = [], []  # per leaf: each replica's partial sum; the elements it summed, per replica
        for k, leaf in enumerate(leaves):
            components = local_components(leaf)
            if components is None:  # TensorFlow runs the per-replica reduction on every replica
                components = (leaf,) * len(devices)
            arrays = [backend.to_device(c, d) for c, d in zip(components, devices)]
            if arrays[0].dtype == np.bool_:  # its sum along the axis would be an int64 count: refused, as with
                check_reduce_inputs(arrays[:1], k)  # axis=None and in TensorFlow
            axes = normalize_axes(axis, arrays[0].ndim)
            partial = []
            for array, device in zip(arrays, devices):
                with backend.device_scope(device):  # each replica's partial sum on its own device and stream
                    partial.append(backend.xp.sum(array, axis=axes, dtype=_sum_dtype(array.dtype)))
            check_reduce_inputs(partial, k)
            sums.append(partial)
            counts.append([math.prod(a.shape[i] for i in axes) for a in arrays])
        if not sums:
            return []
        if op is ReduceOp.MEAN:  # MEAN divides by the global count: it travels with the sums, as one more value
            sums.append([backend.to_device(np.array(c, np.int64), d) for c, d in zip(zip(*counts), devices)])
        per_replica = [list(values) for values in zip(*sums)]
        totals = self._cross_device_ops.batch_reduce_to_host(backend, ReduceOp.SUM, per_replica, devices,
                                                             self._options.timeout)
        if op is ReduceOp.SUM:
            return totals
        global_counts = totals.pop()
        # 0-d division gives a NumPy scalar
        return [np.asarray(total / np.asarray(count, dtype=total.dtype)) if is_inexact(total.dtype)
                else integer_mean(total, int(count)) for total, count in zip(totals, global_counts)]

    # -- the ReplicaHost interface (distrib/replica_context.py) ------------------------------------------

    def _merged_options(self, options: CommunicationOptions | None) -> CommunicationOptions:
        return self._options if options is None else self._options.merge(options)

    def _to_replica_device(self, values: Sequence[Any], replica_id: int) -> list[Any]:
        return self._backend.to_device_all(values, self._devices[replica_id])

    def _batch_all_reduce(self, op: ReduceOp, per_replica: Sequence[Sequence[Any]],
                          options: CommunicationOptions) -> list[list[Any]]:
        return self._cross_device_ops.batch_all_reduce(self._backend, op, per_replica, self._devices, options)

    def _batch_all_gather(self, per_replica: Sequence[Sequence[Any]], axis: int,
                          options: CommunicationOptions) -> list[list[Any]]:
        return self._cross_device_ops.batch_all_gather(self._backend, per_replica, self._devices, axis, options)

    @abc.abstractmethod
    def _rendezvous(self, replica_id: int, kind: str, merge: Callable[[list], list], payload: Any,
                    options: CommunicationOptions) -> Any:
        """See `ReplicaHost._rendezvous`."""

    @abc.abstractmethod
    def _call_for_each_replica(self, fn: Callable, args: tuple, kwargs: dict, options: RunOptions | None = None
                               ) -> Any:
        """Runs `fn` once per replica, each in its replica context; the results regrouped."""

    def call_for_each_replica(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None) -> Any:
        """TensorFlow's `extended.call_for_each_replica`: `fn(*args, **kwargs)` once per replica, exactly as
        `Strategy.run(fn, args, kwargs)` calls it (same contexts, unwrapping and regrouping)."""
        return self._container_strategy.run(fn, args=args, kwargs=kwargs)

    def _run_at_once(self, fn: Callable, args: Sequence, kwargs: dict | None) -> Any:
        """All of `Strategy.run` without options in one call where the strategy has a path for it, else NOT_NOW
        (then `_call_for_each_replica` runs it)."""
        return NOT_NOW

    def _refuse_collective(self) -> None:
        """Tells the other processes of a job that this one will not make the collective whose values it has just
        refused (see MultiWorkerExtended); nothing in one process."""

    def _close(self) -> None:
        """Releases what the strategy holds (threads); nothing by default."""


_FIRST = operator.itemgetter(0)
_VALUES = operator.attrgetter("_values")
_PAIR_TYPES = frozenset((tuple, list))
