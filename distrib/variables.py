"""Variables: a single-device Variable (the components of distributed_variables.py's), its enums and checks.

Reads are zero-copy read-only views; a write happens in place unless a view handed out earlier is still alive,
in which case it goes to a fresh buffer (copy on write), so a value you read never changes under you.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import itertools
import sys
import threading
import weakref
from typing import Any

import numpy as np

from distrib import context
from distrib.backends import Backend, get_backend
from distrib.options import coerce_enum


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
    components = variable.values if getattr(variable, "_is_distributed_variable", False) else (variable,)
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
                _check_strategy_arguments(args, kwargs)
                return strategy.extended._create_variable(*args, **kwargs)
        return super().__call__(*args, **kwargs)


def _check_strategy_arguments(args: tuple, kwargs: dict) -> None:
    """Raises TypeError, naming `distrib.Variable`, where `Variable(*args, **kwargs)` under a strategy's scope
    would fail in the strategy's own code (naming its private method)."""
    try:
        bound = _INIT_PARAMETERS.bind(None, *args, **kwargs)
    except TypeError as error:
        raise TypeError(f"distrib.Variable(): {error}.") from None
    chosen = sorted({"device", "backend"} & bound.arguments.keys())
    if chosen:
        raise TypeError(f"distrib.Variable() under a strategy's scope takes no {' or '.join(chosen)}: the strategy "
                        f"places its variables on its devices. Received: {', '.join(chosen)}.")


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
            check_integers_fit(value, np.dtype(dtype), f"Variable(dtype={np.dtype(dtype).name})", name)
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
        if array.dtype != self._buffer.dtype:
            check_integers_fit(array, self._buffer.dtype, what, self._name)
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


_INIT_PARAMETERS = inspect.signature(Variable.__init__)


def check_integers_fit(array: Any, dtype: np.dtype, what: str, name: str | None) -> None:
    """Raises TypeError where integers of `array` do not fit integer `dtype`: a cast would wrap them (300 as int8
    is 44) without a word, and TensorFlow refuses them too."""
    if array.dtype.kind not in "iu" or dtype.kind not in "iu" or np.can_cast(array.dtype, dtype) or not array.size:
        return
    info = np.iinfo(dtype)
    low, high = int(array.min()), int(array.max())
    if low < info.min or high > info.max:
        into = f" into variable {name!r}" if name else ""
        raise TypeError(f"{what} cannot write integers outside {dtype}'s range [{info.min}, {info.max}]{into}. "
                        f"Received: values from {low} to {high} ({array.dtype}).")


def _coerce_aggregation(aggregation: Any) -> VariableAggregation:
    """A VariableAggregation from a member or its name; None means NONE, as in TensorFlow."""
    if aggregation is None:
        return VariableAggregation.NONE
    return coerce_enum(VariableAggregation, aggregation, "aggregation")
