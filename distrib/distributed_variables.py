"""The MirroredVariable / SyncOnReadVariable a strategy's scope creates: one component Variable per replica device."""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import numpy as np

from distrib import context
from distrib.backends import Backend
from distrib.options import coerce_enum
from distrib.plan import is_inexact
from distrib.values import (DistributedValues, PerReplica, flatten, holds_leaf, is_zero_scalar, register_leaf_type,
                            select_replica)
from distrib.variables import (IndexedSlices, SparseWrites, Variable, VariableAggregation, VariableSynchronization,
                               _ArrayOperators, _coerce_aggregation, _update_replica, _ValueSequence, check_shape,
                               scatter_rows)


class DistributedVariable(SparseWrites, _ValueSequence, _ArrayOperators, DistributedValues):
    """A variable with one component Variable per replica device; the base of Mirrored/SyncOnRead variables."""

    _is_distributed_variable = True

    def __init__(self, strategy: Any, components: Sequence[Variable], aggregation: VariableAggregation,
                 name: str, trainable: bool):
        super().__init__(components)
        self._strategy, self._aggregation, self._name, self.trainable = strategy, aggregation, name, trainable
        for component in components:
            component._distributed_container = weakref.ref(self)

    # -- which component --------------------------------------------------------------------------------

    def _local(self) -> Variable | None:
        """The component for the current replica or update, or None in a cross-replica context."""
        update_id = getattr(_update_replica, "id", None)
        if update_id is not None:
            return self._values[update_id]
        ctx = context.get_replica_context()
        if ctx is not None and ctx.strategy is self._strategy:
            return self._values[ctx._replica_id]  # the index among this process's replicas
        return None

    def _get(self) -> Variable:
        local = self._local()  # not `or`: a component's truth is its value's
        return local if local is not None else self._values[0]

    @property
    def values(self) -> tuple:
        return self._values

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(c.device for c in self._values)

    @property
    def device(self) -> str:
        """The current replica's copy's device in a replica context (or inside `extended.update`), else the
        primary copy's, as TensorFlow's `_get_closest().device`."""
        return self._get().device

    @property
    def name(self) -> str:
        return self._name

    @property
    def shape(self) -> tuple:
        return self._values[0].shape

    @property
    def dtype(self) -> np.dtype:
        return self._values[0].dtype

    @property
    def aggregation(self) -> VariableAggregation:
        return self._aggregation

    @property
    def synchronization(self) -> VariableSynchronization:
        raise NotImplementedError

    def read_value(self) -> Any:
        return self._get().read_value()

    def numpy(self) -> np.ndarray:
        return np.array(self._strategy.extended.backend.to_host(self.read_value()), copy=True)

    def value(self) -> Any:
        return self.read_value()

    def _in_replica_context(self) -> bool:
        ctx = context.get_replica_context()
        return ctx is not None and ctx.strategy is self._strategy and getattr(_update_replica, "id", None) is None

    def _write(self, method: str, value: Any, read_value: bool = True):
        """The write `method` of `value`, following the variable's synchronization; returns what `method` returns
        (`read_value=False`: whatever is cheapest, which the caller drops)."""
        raise NotImplementedError

    def assign(self, value: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True):
        """Sets the value, following the variable's synchronization and aggregation; returns the variable (a
        MirroredVariable's write in a replica context with an aggregation: the value it left, as TensorFlow's), or
        None with `read_value=False`, as TensorFlow's eager writes."""
        result = self._write("assign", value, read_value)
        return result if read_value else None

    def assign_add(self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True):
        result = self._write("assign_add", delta, read_value)
        return result if read_value else None

    def assign_sub(self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True):
        result = self._write("assign_sub", delta, read_value)
        return result if read_value else None

    def _update_all(self, method: str, value: Any):
        """Applies `component.method(select_replica(i, value))` to every component (cross-replica)."""
        self._strategy.extended.update(self, lambda component, v: getattr(component, method)(v), args=(value,))
        return self

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self._name!r} shape={self.shape} dtype={self.dtype.name} "
                f"devices={self.devices}>")


class MirroredVariable(DistributedVariable):
    """Copies kept equal on every replica: every write updates all of them (synchronization ON_WRITE).

    In a replica context a write needs an aggregation other than NONE to combine the replicas' values (SUM,
    MEAN or ONLY_FIRST_REPLICA); with NONE it changes only the local copy. In a cross-replica context a write
    gives every copy the same value.
    """

    @property
    def synchronization(self) -> VariableSynchronization:
        return VariableSynchronization.ON_WRITE

    def _write(self, method: str, value: Any, read_value: bool = True):
        if isinstance(value, DistributedVariable):
            if isinstance(value, MirroredVariable) and self._aggregation is VariableAggregation.SUM and \
                    self._strategy.num_replicas_in_sync > 1 and self._in_replica_context():
                # one value on every replica, as the same object is (TensorFlow: a bare AssertionError)
                raise ValueError(f"A MirroredVariable holds one value on every replica: SUM-aggregating it into "
                                 f"{self._name!r} would count it {self._strategy.num_replicas_in_sync} times. "
                                 f"Received: {method} of {value.name!r} in a replica context; pass a per-replica "
                                 f"value, or use aggregation MEAN or ONLY_FIRST_REPLICA.")
            value = value.read_value()
        local = self._local()
        if not self._in_replica_context():
            if local is not None:  # inside extended.update: this component only
                getattr(local, method)(value)
                return self
            if isinstance(value, PerReplica) or holds_leaf(value, PerReplica, (list, tuple)):
                raise ValueError(f"A MirroredVariable can only be given one value, or a Mirrored one, in a "
                                 f"cross-replica context ({method} of {self._name!r}). Received: a PerReplica"
                                 f"{'' if isinstance(value, PerReplica) else ' inside a ' + type(value).__name__}"
                                 f"; reduce it first (strategy.extended.reduce_to).")
            return self._update_all(method, value)
        if self._aggregation is VariableAggregation.NONE:
            getattr(local, method)(value)
            return self
        shape = getattr(value, "shape", None)
        ctx = context.get_replica_context()
        # each replica's own mistake raises in that replica, before any collective; with ONLY_FIRST_REPLICA the
        # others' values are never used, and TensorFlow takes any
        if shape is not None and not isinstance(value, DistributedValues) and (
                self._aggregation is not VariableAggregation.ONLY_FIRST_REPLICA or ctx.replica_id_in_sync_group == 0):
            check_shape(method, tuple(shape), self.shape, self._name)
        ctx.merge_call(_merge_mirrored_write, args=(self, method, value))
        # the value this write left, as TensorFlow returns it: a read-only view that later writes never change (the
        # variable itself would read as the last write's value, so a kept step result would change under it)
        return local.read_value()

    def _scatter(self, method: str, sparse_delta: Any):
        aggregation = self._aggregation
        if method in ("scatter_min", "scatter_max", "scatter_update") and aggregation in (VariableAggregation.SUM,
                                                                                        VariableAggregation.MEAN):
            # TensorFlow's rule (values.py), in every context: the replicas' rows have no sum or mean to write
            raise NotImplementedError(f"{method} of MirroredVariable {self._name!r} needs aggregation NONE or "
                                      f"ONLY_FIRST_REPLICA. Received: aggregation {aggregation.name}.")
        local = self._local()
        if not self._in_replica_context():
            if local is not None:  # inside extended.update: this component only
                getattr(local, method)(sparse_delta)
                return self
            if any(isinstance(x, PerReplica) for x in (sparse_delta, getattr(sparse_delta, "indices", None),
                                                       getattr(sparse_delta, "values", None))):
                raise ValueError(f"A MirroredVariable can only be given one IndexedSlices in a cross-replica "
                                 f"context ({method} of {self._name!r}). Received: a PerReplica.")
            return self._update_all(method, sparse_delta)  # the same rows into every copy
        if aggregation is VariableAggregation.NONE:
            getattr(local, method)(sparse_delta)
            return self
        local._sparse_operands(method, sparse_delta)  # each replica's own mistakes raise in that replica
        if method in ("scatter_mul", "scatter_div") and aggregation is not VariableAggregation.ONLY_FIRST_REPLICA \
                and self._strategy.num_replicas_in_sync != len(self._values):
            raise NotImplementedError(f"{method} of MirroredVariable {self._name!r} with aggregation "
                                      f"{aggregation.name} in a replica context is not supported across processes "
                                      f"(it would gather every replica's rows). Received: "
                                      f"{self._strategy.num_replicas_in_sync} replicas in {len(self._values)} "
                                      f"local; use ONLY_FIRST_REPLICA or a cross-replica context.")
        delta = IndexedSlices(sparse_delta.values, sparse_delta.indices)  # leaves kept: regroup tells them apart
        context.get_replica_context().merge_call(_merge_mirrored_scatter, args=(self, method, delta))
        return self


def _merge_mirrored_scatter(strategy: Any, variable: MirroredVariable, method: str, delta: IndexedSlices) -> None:
    """Cross-replica half of a replica-context scatter (SUM, MEAN or ONLY_FIRST_REPLICA), as TensorFlow reduces
    IndexedSlices: ONLY_FIRST_REPLICA applies replica 0's rows to every copy; SUM concatenates the replicas'
    rows, MEAN too with values / n. Add and sub densify each replica's rows instead and take the dense write path
    (same sums, reduced by the strategy's collectives, across processes too); mul and div apply the
    concatenated rows (one process only)."""
    components = variable.values
    count = len(components)
    distributed = any(isinstance(x, PerReplica) for x in delta)

    def replica_rows(i: int) -> tuple[Any, Any]:  # replica i's checked indices and values, on its device
        part = [x.values[i] if isinstance(x, DistributedValues) else x for x in delta]
        return components[i]._sparse_operands(method, IndexedSlices(*part))

    def apply(rows: IndexedSlices) -> None:
        strategy.extended.update(variable, lambda component, d: getattr(component, method)(d), args=(rows,))

    if variable.aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
        apply(_first_replica_rows(strategy, components[0], *replica_rows(0)))
    elif method in ("scatter_add", "scatter_sub"):
        dense = [_densify(components[i], *replica_rows(i)) for i in range(count if distributed else 1)]
        _merge_mirrored_write(strategy, variable, "assign_add" if method == "scatter_add" else "assign_sub",
                              PerReplica(dense) if distributed else dense[0])
    elif not distributed:  # the same rows on every replica: TensorFlow's reduce of a non-distributed value
        if variable.aggregation is VariableAggregation.SUM and count > 1:
            raise ValueError(f"IndexedSlices that are the same object on every replica cannot be SUM-aggregated "
                             f"into {variable.name!r}: they would be applied {count} times. Pass per-replica "
                             f"values, or use aggregation MEAN or ONLY_FIRST_REPLICA.")
        apply(IndexedSlices(*reversed(replica_rows(0))))
    else:
        backend, device = strategy.extended.backend, components[0].device
        rows = [[backend.to_device(a, device) for a in replica_rows(i)] for i in range(count)]
        xp = backend.xp
        with backend.device_scope(device):
            indices = xp.concatenate([r[0].reshape(-1) for r in rows])
            values = xp.concatenate([r[1].reshape((-1,) + variable.shape[1:]) for r in rows])
            if variable.aggregation is VariableAggregation.MEAN:  # a float variable (MEAN needs one)
                values = values / xp.asarray(count, values.dtype)
        apply(IndexedSlices(values, indices))


def _densify(component: Variable, indices: Any, values: Any) -> Any:
    """Zeros of the variable's shape with `values` added at their rows (repeated rows add up), on its device."""
    backend = component._backend
    with backend.device_scope(component.device):
        dense = backend.xp.zeros(component.shape, component.dtype)
        scatter_rows(backend.xp, dense, "scatter_add", indices, values)
    return dense


def _first_replica_rows(strategy: Any, component: Variable, indices: Any, values: Any) -> IndexedSlices:
    """Replica 0's rows as every process sees them. Across processes a broadcast needs one shape everywhere, so
    the row count travels first (one process: `_first_replica_value` returns its argument)."""
    first, backend = strategy.extended._first_replica_value, strategy.extended.backend
    indices = indices.reshape(-1).astype(np.int64)
    values = values.reshape((-1,) + component.shape[1:])
    count = int(np.asarray(backend.to_host(first(np.array([indices.shape[0]], np.int64))))[0])
    if count != indices.shape[0]:  # another process's replica 0 wrote a different number of rows
        indices = np.zeros(count, np.int64)
        values = np.zeros((count,) + component.shape[1:], component.dtype)
    return IndexedSlices(first(values), first(indices))


def _sequence_as_arrays(strategy: Any, variable: MirroredVariable, value: Any) -> Any:
    """A list or tuple the replicas wrote, as arrays, so that aggregation sees them (before, each copy took its
    own replica's list, aggregation skipped). merge_call regrouped it leaf by leaf, as TensorFlow's reduce_to maps
    over the structure: a PerReplica of each replica's array where any leaf differs between replicas; else the
    one array every replica gave, which SUM then refuses as it refuses a number, and MEAN applies as it is. SUM
    refuses a leaf that is the same object on every replica beside ones that differ, as TensorFlow does."""
    if not isinstance(value, (list, tuple)):
        return value
    backend, components = strategy.extended.backend, variable.values
    leaves = flatten(value)[0]
    distributed = [isinstance(leaf, DistributedValues) for leaf in leaves]
    if not any(distributed):
        return backend.to_device(value, components[0].device)
    replicas = strategy.num_replicas_in_sync
    if variable.aggregation is VariableAggregation.SUM and replicas > 1 and \
            any(not d and not is_zero_scalar(leaf) for leaf, d in zip(leaves, distributed)):
        raise ValueError(f"A value that is the same object on every replica cannot be SUM-aggregated into "
                         f"{variable.name!r}: it would be counted {replicas} times. Received: a "
                         f"{type(value).__name__} with such an element beside per-replica ones; pass per-replica "
                         f"values, or use aggregation MEAN or ONLY_FIRST_REPLICA.")
    return PerReplica([backend.to_device(select_replica(i, value), component.device)
                       for i, component in enumerate(components)])


def _merge_mirrored_write(strategy: Any, variable: MirroredVariable, method: str, value: Any) -> None:
    """Cross-replica half of a replica-context write: combine the replicas' values, then update every copy."""
    aggregation = variable.aggregation
    value = _sequence_as_arrays(strategy, variable, value)
    components = None if isinstance(value, DistributedValues) else strategy.extended._local_components(value)
    if components is not None:  # a process of one replica: its own value, combined with the other processes'
        value = PerReplica(components)  # (and in a job with such a process, every process alike)
    if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
        value = strategy.extended._first_replica_value(value.values[0]) if isinstance(value, PerReplica) else value
    elif isinstance(value, PerReplica):
        if aggregation is VariableAggregation.MEAN and not _is_floating(variable.dtype):
            raise ValueError(f"Cannot update non-float variable {variable.name!r} with aggregation MEAN: the mean "
                             f"of its replicas' values is not an integer.")
        value = strategy.extended.reduce_to(aggregation.name, value, destinations=variable)
    elif aggregation is VariableAggregation.SUM and strategy.num_replicas_in_sync > 1 and not is_zero_scalar(value):
        raise ValueError(f"A value that is the same object on every replica cannot be SUM-aggregated into "
                         f"{variable.name!r}: it would be counted {strategy.num_replicas_in_sync} times. Pass a "
                         f"per-replica value, or use aggregation MEAN or ONLY_FIRST_REPLICA.")
    strategy.extended.update(variable, lambda component, v: getattr(component, method)(v), args=(value,))


class SyncOnReadVariable(DistributedVariable):
    """Copies that diverge per replica and are aggregated when read cross-replica (synchronization ON_READ).

    Typical for metrics: each replica accumulates its own copy; a cross-replica read gives their SUM or MEAN
    (or replica 0's with ONLY_FIRST_REPLICA).
    """

    @property
    def synchronization(self) -> VariableSynchronization:
        return VariableSynchronization.ON_READ

    def read_value(self) -> Any:
        local = self._local()
        if local is not None:
            return local.read_value()
        if self._aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            return self._strategy.extended._first_replica_value(self._values[0].read_value())
        if self._aggregation is VariableAggregation.NONE:
            raise ValueError(f"A SyncOnReadVariable with aggregation NONE has no cross-replica value "
                             f"({self._name!r}); read it inside strategy.run, or give it an aggregation.")
        with self._strategy.scope():
            total = self._strategy.reduce(self._aggregation.name, self, axis=None)
        if isinstance(total, np.ndarray):  # read-only like every other read
            total.flags.writeable = False
        return total

    def numpy(self) -> np.ndarray:
        return np.array(self._strategy.extended.backend.to_host(self.read_value()), copy=True)

    def _scatter(self, method: str, sparse_delta: Any):
        # TensorFlow's too (values.py): the copies are summed or averaged on read, which rows cannot follow
        raise NotImplementedError(f"{method} is not supported for a SyncOnReadVariable ({self._name!r}): its "
                                  f"copies are aggregated when read. Received: synchronization ON_READ; use "
                                  f"assign_add with a dense value, or an ON_WRITE variable.")

    def _write(self, method: str, value: Any, read_value: bool = True):
        local = self._local()
        if local is not None:  # replica context or extended.update: the local copy only
            getattr(local, method)(value)
            return self
        if method != "assign" and self._aggregation is VariableAggregation.SUM:
            raise ValueError(f"SyncOnReadVariable {self._name!r} with aggregation SUM does not support {method} in "
                             f"a cross-replica context: the change would be counted once per replica.")
        if isinstance(value, DistributedVariable):  # its value as read here, as TensorFlow does: a SyncOnRead
            value = value.read_value()  # source's aggregate, not its copies one for one
        # a PerReplica (or a list holding some) gives each copy its replica's value, whatever the aggregation (SUM
        # too: the copies then add up to their sum); one value assigned to a SUM variable is shared out
        per_replica = isinstance(value, PerReplica) or holds_leaf(value, PerReplica, (list, tuple))
        if method == "assign" and not per_replica and self._aggregation is VariableAggregation.SUM:
            share = np.asarray(self._strategy.extended.backend.to_host(value)) / self._strategy.num_replicas_in_sync
            value = share if is_inexact(self.dtype) else np.trunc(share).astype(self.dtype)  # 7 over 2 -> 3 + 3
        self._update_all(method, value)
        # what the copies now read as, aggregated, as TensorFlow returns it; with NONE, whose copies have no
        # cross-replica value, the variable (TensorFlow writes, then raises as it reads the result)
        # (not read with `read_value=False`: across processes a read is a collective, and a restore needs none)
        return self if self._aggregation is VariableAggregation.NONE or not read_value else self.read_value()


def _is_floating(dtype: np.dtype) -> bool:
    """TensorFlow's `dtype.is_floating`, which MEAN aggregation needs: floats and bfloat16, not complex numbers."""
    return is_inexact(dtype) and np.dtype(dtype).kind != "c"


def create_distributed_variable(strategy: Any, backend: Backend, devices: Sequence[str], initial_value: Any,
                                trainable: bool | None = None, name: str | None = None,
                                synchronization: VariableSynchronization | str = VariableSynchronization.AUTO,
                                aggregation: VariableAggregation | str = VariableAggregation.NONE,
                                dtype: Any = None) -> DistributedVariable:
    """The strategy's variable: components named `<name>/replica_<i>`, all starting from one initial value."""
    synchronization = coerce_enum(VariableSynchronization, synchronization, "synchronization")
    aggregation = _coerce_aggregation(aggregation)
    if synchronization is VariableSynchronization.NONE:
        raise ValueError("synchronization=NONE is not supported for distributed variables; use AUTO, ON_WRITE "
                         "or ON_READ.")
    on_read = synchronization is VariableSynchronization.ON_READ
    if trainable is None:
        trainable = not on_read  # TensorFlow allows trainable=True with ON_READ too
    if callable(initial_value):
        initial_value = initial_value()  # once: every replica starts from the same value
    primary = Variable.__new__(Variable)
    Variable.__init__(primary, initial_value, trainable, None, dtype=dtype, device=devices[0], backend=backend)
    if aggregation is VariableAggregation.MEAN and not _is_floating(primary.dtype):
        raise ValueError(f"aggregation MEAN needs a floating-point variable. Received: dtype {primary.dtype}; use "
                         f"SUM or ONLY_FIRST_REPLICA for integers and complex numbers.")
    name = name or "Variable"
    components = []
    for i, device in enumerate(devices):
        component = Variable.__new__(Variable)
        Variable.__init__(component, primary.read_value(), trainable, f"{name}/replica_{i}", device=device,
                          backend=backend)
        components.append(component)
    cls = SyncOnReadVariable if synchronization is VariableSynchronization.ON_READ else MirroredVariable
    return cls(strategy, components, aggregation, name, trainable)


for _cls in (MirroredVariable, SyncOnReadVariable):  # not Variable: regroup must see its container
    register_leaf_type(_cls)
