"""Variables: a single-device Variable, and the MirroredVariable / SyncOnReadVariable a strategy's scope creates.

Reads are zero-copy read-only views; a write happens in place unless a view handed out earlier is still alive,
in which case it goes to a fresh buffer (copy on write), so a value you read never changes under you.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import sys
import threading
import weakref
from typing import Any, Sequence

import numpy as np

from distrib import context
from distrib.backends import Backend, get_backend
from distrib.options import coerce_enum
from distrib.plan import is_inexact
from distrib.values import DistributedValues, PerReplica, is_zero_scalar, register_leaf_type


def check_numeric(dtype: Any) -> None:
    """A variable holds numbers: booleans, integers, floats (ml_dtypes' bfloat16, NumPy kind 'V', included)."""
    if dtype.kind in "OSUV" and dtype.name != "bfloat16":
        raise TypeError(f"A variable holds a numeric array. Received: dtype {dtype}.")


class VariableSynchronization(enum.Enum):
    """When a distributed variable's copies are brought in sync."""

    AUTO = "AUTO"  # ON_WRITE
    NONE = "NONE"
    ON_WRITE = "ON_WRITE"  # MirroredVariable: every write updates every copy
    ON_READ = "ON_READ"  # SyncOnReadVariable: copies diverge, aggregated when read cross-replica


class VariableAggregation(enum.Enum):
    """How replica-context writes to a variable (or cross-replica reads of a SyncOnRead one) combine."""

    NONE = "NONE"
    SUM = "SUM"
    MEAN = "MEAN"
    ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"


def write_serials(variable: Any) -> tuple[int, ...]:
    """Changes whenever any copy of `variable` is written: while it stays, a host copy of the value stays right."""
    components = variable.values if isinstance(variable, DistributedVariable) else (variable,)
    return tuple(component._write_serial for component in components)


def _idle_refcount() -> int:
    holder = type("Holder", (), {})()
    holder.buffer = np.empty(1)
    return sys.getrefcount(holder.buffer)


_IDLE_REFCOUNT = _idle_refcount()
_WRITE_SERIALS = itertools.count(1)  # every write of any variable takes the next: a value never seen before
_update_replica = threading.local()  # the component index inside StrategyExtended.update


def update_context(replica_id: int) -> contextlib.AbstractContextManager:
    """While `update` runs fn on component `replica_id`, reads of distributed variables see that component."""
    return context.thread_value(_update_replica, "id", replica_id)


class _VariableMeta(type):
    """`Variable(...)` under a strategy's scope builds that strategy's distributed variable instead."""

    def __call__(cls, *args, **kwargs):
        if cls is Variable:
            strategy = context.get_strategy()
            if context.has_strategy():
                return strategy.extended._create_variable(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class _ArrayOperators:
    """Arithmetic and NumPy conversion through `value()`, so variables read like arrays."""

    def value(self) -> Any:
        raise NotImplementedError

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.numpy(), dtype=dtype)

    def __add__(self, other): return self.value() + other
    def __radd__(self, other): return other + self.value()
    def __sub__(self, other): return self.value() - other
    def __rsub__(self, other): return other - self.value()
    def __mul__(self, other): return self.value() * other
    def __rmul__(self, other): return other * self.value()
    def __truediv__(self, other): return self.value() / other
    def __rtruediv__(self, other): return other / self.value()
    def __matmul__(self, other): return self.value() @ other
    def __rmatmul__(self, other): return other @ self.value()
    def __neg__(self): return -self.value()
    def __getitem__(self, key): return self.value()[key]


class Variable(_ArrayOperators, metaclass=_VariableMeta):
    """A mutable array on one device. Under `strategy.scope()`, `Variable(...)` creates a distributed variable.

    Args:
      initial_value: an array-like, or a callable returning one (called once).
      trainable: whether optimizers and `trainable_variables` lists should include it; default True, and False
        for `synchronization=ON_READ` (whose copies diverge; True is allowed, as in TensorFlow).
      name: a name, used in checkpoints and error messages.
      synchronization: a `VariableSynchronization` (distributed variables only).
      aggregation: a `VariableAggregation` or its name (None means NONE): how replica-context writes combine
        (distributed variables only).
      dtype: the dtype to convert `initial_value` to (default: its own).

    Example:
      >>> import distrib, numpy as np
      >>> v = distrib.Variable(np.zeros(3, np.float32))
      >>> v.assign_add(np.ones(3, np.float32)).numpy()
      array([1., 1., 1.], dtype=float32)
    """

    def __init__(self, initial_value: Any, trainable: bool | None = None, name: str | None = None,
                 synchronization: VariableSynchronization | str = VariableSynchronization.AUTO,
                 aggregation: VariableAggregation | str = VariableAggregation.NONE, dtype: Any = None, *,
                 device: str = "CPU:0", backend: Backend | None = None):
        self._synchronization = coerce_enum(VariableSynchronization, synchronization, "synchronization")
        self._aggregation = _coerce_aggregation(aggregation)
        self._backend = backend if backend is not None else get_backend("cpu")
        self._device = device
        if callable(initial_value):
            initial_value = initial_value()
        value = self._backend.to_device(initial_value, device)
        if dtype is not None:
            value = value.astype(dtype, copy=False)
        check_numeric(value.dtype)
        self._buffer = self._own(value)
        self._write_serial = 0  # changes at every write (see _writable): lets a reader keep a host copy of the value
        self.trainable = True if trainable is None else bool(trainable)
        self._name = name or "Variable"
        self._distributed_container: weakref.ref | None = None

    def _own(self, array: Any) -> Any:
        """A private, writable, contiguous buffer holding `array`, on the variable's device."""
        with self._backend.device_scope(self._device):
            return self._backend.xp.array(array, copy=True, order="C")

    # -- reading --------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def shape(self) -> tuple:
        return tuple(self._buffer.shape)

    @property
    def dtype(self) -> np.dtype:
        return self._buffer.dtype

    @property
    def device(self) -> str:
        return self._device

    @property
    def synchronization(self) -> VariableSynchronization:
        return self._synchronization

    @property
    def aggregation(self) -> VariableAggregation:
        return self._aggregation

    def read_value(self) -> Any:
        """The current value as a read-only view (no copy); later writes never change it."""
        view = self._buffer.view()
        if isinstance(view, np.ndarray):
            view.flags.writeable = False
        return view

    def value(self) -> Any:
        return self.read_value()

    def numpy(self) -> np.ndarray:
        """A host NumPy copy of the value."""
        return np.array(self._backend.to_host(self._buffer), copy=True)

    # -- writing --------------------------------------------------------------------------------------

    def _writable(self) -> Any:
        """The buffer to write in place, or a fresh copy of it when a read view is still alive (copy on write)."""
        if sys.getrefcount(self._buffer) > _IDLE_REFCOUNT:
            self._buffer = self._own(self._buffer)
        self._write_serial = next(_WRITE_SERIALS)
        return self._buffer

    def _operand(self, value: Any, what: str) -> Any:
        array = self._backend.to_device(value.read_value() if isinstance(value, Variable) else value, self._device)
        if array.shape != self._buffer.shape and array.size != 1:
            try:
                np.broadcast_shapes(array.shape, self._buffer.shape)
            except ValueError:
                raise ValueError(f"{what} needs a value of shape {self.shape} for variable {self._name!r}. "
                                 f"Received: shape {tuple(array.shape)}.") from None
            if np.broadcast_shapes(array.shape, self._buffer.shape) != self._buffer.shape:
                raise ValueError(f"{what} needs a value of shape {self.shape} for variable {self._name!r}. "
                                 f"Received: shape {tuple(array.shape)}.")
        if not np.can_cast(array.dtype, self._buffer.dtype, casting="same_kind"):
            raise TypeError(f"{what} cannot write dtype {array.dtype} into variable {self._name!r} of dtype "
                            f"{self._buffer.dtype}.")
        return array

    def assign(self, value: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True):
        """Sets the value; returns the variable."""
        operand = self._operand(value, "assign")
        self._backend.xp.copyto(self._writable(), operand, casting="same_kind")
        return self

    def assign_add(self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True):
        """Adds `delta` in place; returns the variable."""
        buffer = self._writable()
        self._backend.xp.add(buffer, self._operand(delta, "assign_add"), out=buffer, casting="same_kind")
        return self

    def assign_sub(self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True):
        """Subtracts `delta` in place; returns the variable."""
        buffer = self._writable()
        self._backend.xp.subtract(buffer, self._operand(delta, "assign_sub"), out=buffer, casting="same_kind")
        return self

    def __repr__(self) -> str:
        return f"<Variable {self._name!r} shape={self.shape} dtype={self.dtype.name} device={self._device}>"


class DistributedVariable(_ArrayOperators, DistributedValues):
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
        return self._local() or self._values[0]

    @property
    def values(self) -> tuple:
        return self._values

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(c.device for c in self._values)

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

    def _write(self, method: str, value: Any):
        raise NotImplementedError

    def assign(self, value: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True):
        """Sets the value, following the variable's synchronization and aggregation; returns the variable."""
        return self._write("assign", value)

    def assign_add(self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True):
        return self._write("assign_add", delta)

    def assign_sub(self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True):
        return self._write("assign_sub", delta)

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

    def _write(self, method: str, value: Any):
        if isinstance(value, DistributedVariable):
            value = value.read_value()
        local = self._local()
        if not self._in_replica_context():
            if local is not None:  # inside extended.update: this component only
                getattr(local, method)(value)
                return self
            if isinstance(value, PerReplica):
                raise ValueError(f"A MirroredVariable can only be given one value, or a Mirrored one, in a "
                                 f"cross-replica context ({method} of {self._name!r}). Received: a PerReplica; "
                                 f"reduce it first (strategy.extended.reduce_to).")
            return self._update_all(method, value)
        if self._aggregation is VariableAggregation.NONE:
            getattr(local, method)(value)
            return self
        ctx = context.get_replica_context()
        ctx.merge_call(_merge_mirrored_write, args=(self, method, value))
        return self


def _merge_mirrored_write(strategy: Any, variable: MirroredVariable, method: str, value: Any) -> None:
    """Cross-replica half of a replica-context write: combine the replicas' values, then update every copy."""
    aggregation = variable.aggregation
    if not isinstance(value, DistributedValues) and strategy.extended._local_components(value) is not None:
        value = PerReplica((value,))  # one replica per process: its own value, combined with the other processes'
    if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
        value = strategy.extended._first_replica_value(value.values[0]) if isinstance(value, PerReplica) else value
    elif isinstance(value, PerReplica):
        if aggregation is VariableAggregation.MEAN and not is_inexact(variable.dtype):
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

    def _write(self, method: str, value: Any):
        local = self._local()
        if local is not None:  # replica context or extended.update: the local copy only
            getattr(local, method)(value)
            return self
        if method != "assign" and self._aggregation is VariableAggregation.SUM:
            raise ValueError(f"SyncOnReadVariable {self._name!r} with aggregation SUM does not support {method} in "
                             f"a cross-replica context: the change would be counted once per replica.")
        if method == "assign" and self._aggregation is VariableAggregation.SUM:
            share = np.asarray(self._strategy.extended.backend.to_host(value)) / self._strategy.num_replicas_in_sync
            value = share if is_inexact(self.dtype) else np.trunc(share).astype(self.dtype)  # 7 over 2 -> 3 + 3
        return self._update_all(method, value)


def _coerce_aggregation(aggregation: Any) -> VariableAggregation:
    """A VariableAggregation from a member or its name; None means NONE, as in TensorFlow."""
    if aggregation is None:
        return VariableAggregation.NONE
    return coerce_enum(VariableAggregation, aggregation, "aggregation")


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
    if aggregation is VariableAggregation.MEAN and not is_inexact(primary.dtype):
        raise ValueError(f"aggregation MEAN needs a floating-point variable. Received: dtype {primary.dtype}; use "
                         f"SUM or ONLY_FIRST_REPLICA for integers.")
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
