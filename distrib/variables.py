"""Variables: a single-device Variable (the components of distributed_variables.py's), its enums and checks.

Reads are zero-copy read-only views; a write happens in place unless a view handed out earlier is still alive,
in which case it goes to a fresh buffer (copy on write), so a value you read never changes under you. Each write
(assign, assign_add/sub, scatter_*) holds the variable's lock for its read-modify-write, as TensorFlow's
resource-variable updates are atomic: replicas writing one variable at once lose no update.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import itertools
import sys
import threading
import weakref
from typing import Any, NamedTuple

import numpy as np

from distrib import context
from distrib.backends import Backend, get_backend
from distrib.options import coerce_enum


def can_convert(source: np.dtype, target: np.dtype) -> bool:
    """Whether values of dtype `source` may be written into dtype `target`: NumPy's `same_kind` rule (no float to
    integer, complex to real, or anything but bool to bool), ml_dtypes' bfloat16 counted as a float (NumPy's own
    rule lets complex into it), and any integers into any integers (signed into unsigned too, which `same_kind`
    refuses): `check_integers_fit` then refuses the values that do not fit."""
    if source == target:  # the usual write: nothing to decide (each write asks)
        return True
    source_kind, target_kind = source.kind, target.kind
    if source_kind in "iu" and target_kind in "iu":
        return True
    if source_kind == "V" or target_kind == "V":  # .name is slow: asked only here
        source, target = _as_float(source), _as_float(target)
    return np.can_cast(source, target, casting="same_kind")


def _as_float(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float32) if dtype.name == "bfloat16" else dtype


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


_CREATION_ORDER = itertools.count()


def creation_order(variable: Any) -> int | None:
    """When `variable` (plain or distributed: its first copy's) was created among this process's variables; None
    for a variable that keeps no such number (a parameter server's)."""
    components = variable.values if getattr(variable, "_is_distributed_variable", False) else (variable,)
    return getattr(components[0], "_created", None)


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


class IndexedSlices(NamedTuple):
    """Rows of a sparse update: `values[i]` goes to row `indices[i]` of an array of `dense_shape` (tf.IndexedSlices).

    The `sparse_delta` of `Variable.scatter_*`; `dense_shape` is informational (scatters use the variable's shape).
    """

    values: Any
    indices: Any
    dense_shape: Any = None


def sparse_rows(method: str, sparse_delta: Any, updates: Any = None) -> tuple[Any, Any]:
    """(indices, updates) of a scatter given TensorFlow's way, one IndexedSlices, or as `indices, updates`.

    Raises:
      TypeError: `sparse_delta` has no `.indices` and `.values`, and no `updates` came with it.
    """
    if updates is not None:
        return sparse_delta, updates
    if hasattr(sparse_delta, "indices") and hasattr(sparse_delta, "values"):
        return sparse_delta.indices, sparse_delta.values
    raise TypeError(f"{method} needs an IndexedSlices (with .indices and .values), or indices and updates. "
                    f"Received: {type(sparse_delta).__name__} and no updates.")


# method -> NumPy ufunc applied row by row; "scatter_update" assigns instead
_SCATTER_UFUNCS = {"scatter_add": "add", "scatter_sub": "subtract", "scatter_mul": "multiply",
                   "scatter_div": "divide", "scatter_min": "minimum", "scatter_max": "maximum"}


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
    def __lt__(self, other): return self.value() < other
    def __le__(self, other): return self.value() <= other
    def __gt__(self, other): return self.value() > other
    def __ge__(self, other): return self.value() >= other
    def __pow__(self, other): return self.value() ** other
    def __rpow__(self, other): return other ** self.value()
    def __floordiv__(self, other): return self.value() // other
    def __rfloordiv__(self, other): return other // self.value()
    def __mod__(self, other): return self.value() % other
    def __rmod__(self, other): return other % self.value()
    def __abs__(self): return abs(self.value())
    def __float__(self): return float(self.value())
    def __int__(self): return int(self.value())
    def __complex__(self): return complex(self.value())
    # == and hash stay the object's identity (TensorFlow's variables compare by value only with its
    # Tensor equality switched on): optimizers and checkpoints key dicts by variable.


class _ValueSequence:
    """Truth, length and iteration of a variable follow its value, as TensorFlow's do: `bool()` is the value's
    (NumPy's error for several elements), `len()` and iteration go along the first dimension (TypeError for a
    scalar). Without them `bool(v)` was always True, `list(Variable(0.0))` empty and `len()` of a distributed
    variable its replica count."""

    def __bool__(self) -> bool:
        return bool(self.read_value())

    def __len__(self) -> int:
        shape = self.shape
        if not shape:
            raise TypeError(f"len() of a scalar variable ({self.name!r}, shape ()) is not defined, as NumPy's "
                            f"len() of a 0-d array.")
        return shape[0]

    def __iter__(self):
        if not self.shape:
            raise TypeError(f"iteration over a scalar variable ({self.name!r}, shape ()) is not defined, as over "
                            f"a 0-d array.")
        return iter(self.read_value())


class SparseWrites:
    """TensorFlow's `scatter_*` methods, each given an IndexedSlices (`sparse_delta`) and returning the variable;
    shared by Variable and the distributed variables, which define `_scatter(method, sparse_delta)`."""

    def scatter_add(self, sparse_delta: Any, use_locking: bool = False, name: str | None = None):
        """Adds `sparse_delta.values` to the rows `sparse_delta.indices` (repeated rows add up)."""
        return self._scatter("scatter_add", sparse_delta)

    def scatter_sub(self, sparse_delta: Any, use_locking: bool = False, name: str | None = None):
        """Subtracts `sparse_delta.values` from its rows (repeated rows accumulate); returns the variable."""
        return self._scatter("scatter_sub", sparse_delta)

    def scatter_mul(self, sparse_delta: Any, use_locking: bool = False, name: str | None = None):
        """Multiplies its rows by `sparse_delta.values` (repeated rows accumulate); returns the variable."""
        return self._scatter("scatter_mul", sparse_delta)

    def scatter_div(self, sparse_delta: Any, use_locking: bool = False, name: str | None = None):
        """Divides its rows by `sparse_delta.values` (integers truncate toward zero, as in TensorFlow); returns
        the variable."""
        return self._scatter("scatter_div", sparse_delta)

    def scatter_min(self, sparse_delta: Any, use_locking: bool = False, name: str | None = None):
        """Sets its rows to the minimum of themselves and `sparse_delta.values`; returns the variable."""
        return self._scatter("scatter_min", sparse_delta)

    def scatter_max(self, sparse_delta: Any, use_locking: bool = False, name: str | None = None):
        """Sets its rows to the maximum of themselves and `sparse_delta.values`; returns the variable."""
        return self._scatter("scatter_max", sparse_delta)

    def scatter_update(self, sparse_delta: Any, use_locking: bool = False, name: str | None = None):
        """Sets the rows `sparse_delta.indices` to `sparse_delta.values` (for a repeated row, the last one on the
        CPU; TensorFlow leaves the order undefined); returns the variable."""
        return self._scatter("scatter_update", sparse_delta)

    def _scatter(self, method: str, sparse_delta: Any):
        raise NotImplementedError


class Variable(SparseWrites, _ValueSequence, _ArrayOperators, metaclass=_VariableMeta):
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
            dtype = np.dtype(dtype)
            if not can_convert(value.dtype, dtype):  # as TensorFlow, which refuses a value its dtype cannot hold
                into = f" for variable {name!r}" if name else ""
                raise TypeError(f"Variable(dtype={dtype.name}) cannot convert a value of dtype {value.dtype}"
                                f"{into}: the cast could change values (0.5 as an integer is 0, 1+2j as a float "
                                f"1, 0.5 as a bool True). Convert the value first if that is meant.")
            check_integers_fit(value, dtype, f"Variable(dtype={dtype.name})", name)
            value = value.astype(dtype, copy=False)
        check_numeric(value.dtype)
        self._lock = threading.Lock()  # held by each write's read-modify-write (and by reads: see read_value)
        self._buffer = self._own(value)
        self._write_serial = 0  # changes at every write (see _writable): lets a reader keep a host copy of the value
        self._created = next(_CREATION_ORDER)  # a program that creates its variables in the same order gives the
        # same numbers again: optimizer slots of variables whose names repeat are saved in this order
        # ON_READ copies diverge: not trainable unless asked, as in TensorFlow
        on_read = self._synchronization is VariableSynchronization.ON_READ
        self.trainable = (not on_read) if trainable is None else bool(trainable)
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
        with self._lock:  # not in the middle of a write in place: the view holds a finished value, and keeps it
            view = self._buffer.view()
        if isinstance(view, np.ndarray):
            view.flags.writeable = False
        return view

    def value(self) -> Any:
        return self.read_value()

    def numpy(self) -> np.ndarray:
        """A host NumPy copy of the value."""
        return np.array(self._backend.to_host(self.read_value()), copy=True)

    # -- writing --------------------------------------------------------------------------------------

    def _writable(self) -> Any:
        """The buffer to write in place, or a fresh copy of it when a read view is still alive (copy on write).

        A caller that may race with another thread's write of this variable holds `_lock` until it has written
        and dropped the buffer; otherwise the other's copy on write sees this caller's reference, takes a copy
        of a half-written buffer and one of the two updates is lost."""
        if sys.getrefcount(self._buffer) > _IDLE_REFCOUNT:
            self._buffer = self._own(self._buffer)
        self._write_serial = next(_WRITE_SERIALS)
        return self._buffer

    def _operand(self, value: Any, what: str) -> Any:
        array = self._backend.to_device(value.read_value() if isinstance(value, Variable) else value, self._device)
        check_shape(what, tuple(array.shape), self.shape, self._name)
        if not can_convert(array.dtype, self._buffer.dtype):
            raise TypeError(f"{what} cannot write dtype {array.dtype} into variable {self._name!r} of dtype "
                            f"{self._buffer.dtype}.")
        if array.dtype != self._buffer.dtype:
            check_integers_fit(array, self._buffer.dtype, what, self._name)
            if not np.can_cast(array.dtype, self._buffer.dtype, casting="same_kind"):  # signed into unsigned
                array = array.astype(self._buffer.dtype)  # integers, checked to fit: the writes' casts refuse it
        return array

    def assign(self, value: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True):
        """Sets the value (of the variable's shape, or a scalar, which fills it); returns the variable (None with
        `read_value=False`, as TensorFlow's eager writes).

        Every write is atomic: replicas (threads) writing one variable at once each see the other's update, as
        with TensorFlow's resource variables (with or without `use_locking`)."""
        operand = self._operand(value, "assign")
        with self._lock:
            self._backend.xp.copyto(self._writable(), operand, casting="same_kind")
        return self if read_value else None

    def assign_add(self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True):
        """Adds `delta` (of the variable's shape, or a scalar) in place, atomically; returns the variable (None
        with `read_value=False`)."""
        self._update(self._backend.xp.add, self._operand(delta, "assign_add"))
        return self if read_value else None

    def assign_sub(self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True):
        """Subtracts `delta` (of the variable's shape, or a scalar) in place, atomically; returns the variable
        (None with `read_value=False`)."""
        self._update(self._backend.xp.subtract, self._operand(delta, "assign_sub"))
        return self if read_value else None

    def _update(self, ufunc: Any, operand: Any) -> None:
        """buffer = ufunc(buffer, operand), under the lock (see `_writable`)."""
        with self._lock:
            buffer = self._writable()
            ufunc(buffer, operand, out=buffer, casting="same_kind")
            del buffer  # before the lock goes: the next writer must not see this reference and copy for nothing

    # -- sparse writes: SparseWrites' scatter_* methods call this --------------------------------------------

    def _scatter(self, method: str, sparse_delta: Any):
        indices, values = self._sparse_operands(method, sparse_delta)
        with self._lock:  # checked first: all or nothing
            scatter_rows(self._backend.xp, self._writable(), method, indices, values)
        return self

    def _sparse_operands(self, method: str, sparse_delta: Any) -> tuple[Any, Any]:
        """`sparse_delta`'s indices and values on the variable's device, checked as TensorFlow's scatter kernels do,
        the values cast to the variable's dtype."""
        if not (hasattr(sparse_delta, "indices") and hasattr(sparse_delta, "values")):
            raise TypeError(f"{method} needs an IndexedSlices (with .indices and .values) for variable "
                            f"{self._name!r}. Received: {type(sparse_delta).__name__}.")
        if not self.shape:
            raise ValueError(f"{method} needs a variable of rank 1 or more: indices select rows along axis 0. "
                             f"Received: variable {self._name!r} of shape ().")
        dtype = self._buffer.dtype
        check_scatter_kind(method, dtype, self._name)
        to_device = self._backend.to_device
        indices = to_device(sparse_delta.indices, self._device)
        values = sparse_delta.values
        values = to_device(values.read_value() if isinstance(values, Variable) else values, self._device)
        if indices.dtype.kind not in "iu":
            raise TypeError(f"{method} needs integer indices for variable {self._name!r}. Received: dtype "
                            f"{indices.dtype}.")
        rows = self.shape[0]
        if indices.size:
            low, high = int(indices.min()), int(indices.max())
            if low < 0 or high >= rows:  # TensorFlow refuses negative indices too (no wrapping from the end)
                bad = low if low < 0 else high
                raise IndexError(f"{method} needs indices in [0, {rows}) for variable {self._name!r}. Received: "
                                 f"index {bad}.")
        expected = tuple(indices.shape) + self.shape[1:]
        if tuple(values.shape) != expected:
            raise ValueError(f"{method} needs values of shape indices.shape + variable.shape[1:] = {expected} for "
                             f"variable {self._name!r}. Received: shape {tuple(values.shape)}.")
        return indices, scatter_values(method, values, dtype, self._name, "values")

    def __repr__(self) -> str:
        return f"<Variable {self._name!r} shape={self.shape} dtype={self.dtype.name} device={self._device}>"


_INIT_PARAMETERS = inspect.signature(Variable.__init__)


def scatter_rows(xp: Any, buffer: Any, method: str, indices: Any, values: Any) -> None:
    """Applies `method` to `buffer`'s rows `indices` in place (checked operands of `buffer`'s dtype); repeated
    rows accumulate, as tf.compat.v1.scatter_* do, except for scatter_update, where the last one wins on NumPy."""
    if method == "scatter_update":
        buffer[indices] = values
        return
    name = _SCATTER_UFUNCS[method]
    integer_div = name == "divide" and buffer.dtype.kind in "iu"
    if xp is np and not integer_div:
        with np.errstate(divide="ignore", invalid="ignore"):  # x / 0 is inf or nan, as in TensorFlow
            getattr(np, name).at(buffer, indices, values)
        return
    if xp is not np and name in ("add", "subtract", "minimum", "maximum"):
        # Unverified without a GPU: cupyx's atomic scatters cover float16/32/64 and (u)int32/uint64 only, so other
        # dtypes (and a CuPy without them) take the rounds below.
        import cupyx
        scatter = {"add": cupyx.scatter_add, "subtract": cupyx.scatter_add, "minimum": cupyx.scatter_min,
                   "maximum": cupyx.scatter_max}[name]
        try:
            scatter(buffer, indices, -values if name == "subtract" else values)
            return
        except (TypeError, NotImplementedError):
            pass
    ufunc = _truncating_divide if integer_div else getattr(xp, name)
    for positions in _rounds(indices):  # no row twice within a round: plain fancy indexing is then exact
        positions = xp.asarray(positions)
        rows = indices.reshape(-1)[positions]
        part = values.reshape((-1,) + tuple(buffer.shape[1:]))[positions]
        buffer[rows] = ufunc(buffer[rows], part)


def _rounds(indices: Any) -> list[np.ndarray]:
    """Positions of the flat `indices` split into rounds with each row at most once, in order of appearance."""
    flat = np.asarray(indices.get() if hasattr(indices, "get") else indices).reshape(-1)  # CuPy: a host copy
    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]]) if flat.size else np.zeros(0, np.intp)
    occurrence = np.empty(flat.size, np.intp)  # k for the k-th appearance of its row
    occurrence[order] = np.arange(flat.size) - np.repeat(starts, np.diff(np.r_[starts, flat.size]))
    return [np.flatnonzero(occurrence == k) for k in range(int(occurrence.max()) + 1 if flat.size else 0)]


def _truncating_divide(a: Any, b: Any) -> Any:
    """Integer division rounding toward zero, as C and TensorFlow's kernels do (NumPy's // rounds down)."""
    quotient = a // b
    return quotient + ((quotient * b != a) & ((a < 0) != (b < 0)))


def check_scatter_kind(method: str, dtype: np.dtype, name: str | None) -> None:
    """Raises TypeError where TensorFlow has no `method` kernel for a variable of `dtype` (no min/max of complex
    numbers; bool variables take scatter_update only)."""
    if (method in ("scatter_min", "scatter_max") and dtype.kind == "c") or \
            (method != "scatter_update" and dtype.kind == "b"):
        raise TypeError(f"{method} needs a variable of real numbers (TensorFlow has no such kernel for {dtype}). "
                        f"Received: variable {name!r} of dtype {dtype}.")


def scatter_values(method: str, values: Any, dtype: np.dtype, name: str | None, what: str) -> Any:
    """A scatter's `values` (`what` they are called, for messages) cast to the variable's `dtype`, once checked:
    a cast of the same kind, integers that fit, no integer division by zero."""
    if not can_convert(values.dtype, dtype):
        raise TypeError(f"{method} cannot write dtype {values.dtype} into variable {name!r} of dtype {dtype}.")
    if values.dtype != dtype:
        check_integers_fit(values, dtype, method, name)
        values = values.astype(dtype)
    if method == "scatter_div" and dtype.kind in "iu" and values.size and bool((values == 0).any()):
        raise ValueError(f"{method} cannot divide integers by zero (variable {name!r}). Received: a zero among the "
                         f"{what}.")
    return values


def check_shape(what: str, shape: tuple, variable_shape: tuple, name: str | None) -> None:
    """Raises ValueError unless a value of `shape` may be written into a variable of `variable_shape`: the same
    shape, as TensorFlow requires ("Shape mismatch"), or a scalar (a number or 0-d array, which fills every
    element: parameter-server writes pass such a value on to the server's Variable). No other broadcasting: it
    filled the rows of a (3, 3) variable with a (3, 1) value and tiled a (3,) one."""
    if shape != variable_shape and shape != ():
        raise ValueError(f"{what} needs a value of shape {variable_shape} (or a scalar) for variable {name!r}. "
                         f"Received: shape {shape}: the shapes are incompatible, and only a scalar is broadcast.")


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
