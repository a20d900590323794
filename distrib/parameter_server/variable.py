"""ParameterServerVariable: a handle to a variable living on a parameter-server actor; reads pull, writes push."""

from __future__ import annotations

from typing import Any

import numpy as np

from distrib.backends.cpu import to_numpy
from distrib.errors import ParameterServerError
from distrib import ray_runtime
from distrib.parameter_server.shard_calls import lookup_rows
from distrib.parameter_server.write_tags import next_tag
from distrib.variables import (VariableAggregation, VariableSynchronization, _ArrayOperators, can_convert,
                               check_integers_fit, check_scatter_kind, check_shape, scatter_values, sparse_rows)


class Pending:
    """A call sent to a parameter server; `result()` waits for it (and names the server if it died)."""

    def __init__(self, ref: Any, ps_index: int):
        self._ref, self._ps_index = ref, ps_index

    def result(self) -> Any:
        return resolve(self._ref, self._ps_index)


def resolve(ref: Any, ps_index: int) -> Any:
    """The result of a call to parameter server `ps_index`, a ParameterServerError if that server is gone."""
    try:
        return ray_runtime.get(ref)
    except ray_runtime.actor_died_errors() as exc:
        raise ParameterServerError(f"Parameter server {ps_index} (/job:ps/task:{ps_index}) died or cannot be "
                                   f"reached; its variables are lost. Create the strategy again and restore the "
                                   f"last checkpoint. Cause: {type(exc).__name__}.", ps_index=ps_index) from exc


class RowUpdates:
    """TensorFlow's `scatter_*` methods, given an IndexedSlices (TensorFlow's `sparse_delta`) or `indices, updates`;
    each returns the variable. Shared by ParameterServerVariable and ShardedVariable, which define `_scatter`."""

    def scatter_add(self, sparse_delta: Any, updates: Any = None):
        """Adds `updates[i]` to row `indices[i]` (repeated rows accumulate)."""
        return self._scatter("scatter_add", *sparse_rows("scatter_add", sparse_delta, updates))

    def scatter_sub(self, sparse_delta: Any, updates: Any = None):
        """Subtracts `updates[i]` from row `indices[i]` (repeated rows accumulate)."""
        return self._scatter("scatter_sub", *sparse_rows("scatter_sub", sparse_delta, updates))

    def scatter_mul(self, sparse_delta: Any, updates: Any = None):
        """Multiplies row `indices[i]` by `updates[i]` (repeated rows accumulate)."""
        return self._scatter("scatter_mul", *sparse_rows("scatter_mul", sparse_delta, updates))

    def scatter_div(self, sparse_delta: Any, updates: Any = None):
        """Divides row `indices[i]` by `updates[i]` (integers truncate toward zero, as in TensorFlow)."""
        return self._scatter("scatter_div", *sparse_rows("scatter_div", sparse_delta, updates))

    def scatter_min(self, sparse_delta: Any, updates: Any = None):
        """Sets row `indices[i]` to the minimum of itself and `updates[i]`."""
        return self._scatter("scatter_min", *sparse_rows("scatter_min", sparse_delta, updates))

    def scatter_max(self, sparse_delta: Any, updates: Any = None):
        """Sets row `indices[i]` to the maximum of itself and `updates[i]`."""
        return self._scatter("scatter_max", *sparse_rows("scatter_max", sparse_delta, updates))

    def scatter_update(self, sparse_delta: Any, updates: Any = None):
        """Sets row `indices[i]` to `updates[i]` (the last one wins for a repeated row)."""
        return self._scatter("scatter_update", *sparse_rows("scatter_update", sparse_delta, updates))

    def _scatter(self, method: str, indices: Any, updates: Any) -> Any:
        raise NotImplementedError


class ParameterServerVariable(RowUpdates, _ArrayOperators):
    """A variable on one parameter server, what `distrib.Variable(...)` builds under a ParameterServerStrategy.

    Reads fetch the value from the server; writes send the operand there and wait until it is applied, so
    a write is visible to every later read, from any worker. Inside a closure scheduled with
    `ClusterCoordinator.schedule`, each write is tagged, and a closure run again after its worker died does
    not apply a write twice. The handle pickles into closures; its server stays where it is.

    Example:
      >>> import distrib, numpy as np
      >>> strategy = distrib.ParameterServerStrategy()
      >>> with strategy.scope():
      ...     v = distrib.Variable(np.zeros(3, np.float32), name="v")
      >>> v.assign_add(np.ones(3, np.float32)).numpy()
      array([1., 1., 1.], dtype=float32)
    """

    def __init__(self, server: Any, ps_index: int, key: int, shape: tuple, dtype: np.dtype, name: str,
                 trainable: bool, aggregation: VariableAggregation):
        self._server, self._ps_index, self._key = server, ps_index, key
        self._shape, self._dtype, self._name = tuple(shape), np.dtype(dtype), name
        self.trainable = trainable
        self._aggregation = aggregation

    # -- description ------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def shape(self) -> tuple:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def device(self) -> str:
        return f"/job:ps/task:{self._ps_index}"

    @property
    def aggregation(self) -> VariableAggregation:
        return self._aggregation

    @property
    def synchronization(self) -> VariableSynchronization:
        return VariableSynchronization.ON_WRITE

    def __hash__(self) -> int:  # one identity for every unpickled copy of the handle (a dict key in optimizers)
        return hash(self._key)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, ParameterServerVariable) and other._key == self._key

    def __repr__(self) -> str:
        return (f"<ParameterServerVariable {self._name!r} shape={self._shape} dtype={self._dtype.name} "
                f"device={self.device}>")

    # -- reading ----------------------------------------------------------------------------------------

    def read_value(self) -> np.ndarray:
        """The current value, fetched from the server (read-only)."""
        return self._start("read").result()

    def value(self) -> np.ndarray:
        return self.read_value()

    def numpy(self) -> np.ndarray:
        """A writable host copy of the value."""
        return np.array(self.read_value())

    def embedding_lookup(self, ids: Any) -> np.ndarray:
        """The rows `ids` (any shape) as an array of shape `ids.shape + shape[1:]`; only those rows travel.

        Checked as a ShardedVariable's (the same code): a table under the partitioner's minimum size stays whole."""

        return lookup_rows(self, [self], [0, self._shape[0] if self._shape else 0], ids)

    def sparse_read(self, indices: Any) -> np.ndarray:
        """The rows `indices`: the same as `embedding_lookup`."""
        return self.embedding_lookup(indices)

    # -- writing ----------------------------------------------------------------------------------------

    def assign(self, value: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True):
        """Sets the value; returns the variable (None with `read_value=False`, as TensorFlow's eager writes)."""
        written = self._wait(self._start_write("assign", value))
        return written if read_value else None

    def assign_add(self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True):
        """Adds `delta`; returns the variable (None with `read_value=False`, as TensorFlow's eager writes)."""
        written = self._wait(self._start_write("assign_add", delta))
        return written if read_value else None

    def assign_sub(self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True):
        """Subtracts `delta`; returns the variable (None with `read_value=False`, as TensorFlow's eager writes)."""
        written = self._wait(self._start_write("assign_sub", delta))
        return written if read_value else None

    def _scatter(self, method: str, indices: Any, updates: Any) -> "ParameterServerVariable":
        return self._wait(self._start_scatter(method, indices, updates))

    # -- calls, started here and awaited by the caller (ShardedVariable starts one per shard) -------------

    def _start(self, method: str, *args: Any) -> Pending:
        try:
            ref = getattr(self._server, method).remote(self._key, *args)
        except ray_runtime.actor_died_errors() as exc:
            raise ParameterServerError(f"Parameter server {self._ps_index} died; restore the last checkpoint.",
                                       ps_index=self._ps_index) from exc
        return Pending(ref, self._ps_index)

    def _start_write(self, method: str, value: Any) -> Pending:
        operand = to_numpy(value.read_value() if hasattr(value, "read_value") else value)
        _check_operand(self, method, operand)
        return self._start("write", method, operand, next_tag(self._key))

    def _start_scatter(self, method: str, indices: Any, updates: Any) -> Pending:
        indices, updates = to_numpy(indices), to_numpy(updates)
        updates = _check_rows(self, method, indices, updates, self._shape[0] if self._shape else 0)
        return self._start("scatter", method, indices, updates, next_tag(self._key))

    def _wait(self, pending: Pending) -> "ParameterServerVariable":
        pending.result()
        return self


def _check_operand(variable: Any, method: str, operand: np.ndarray) -> None:
    """The rules of `Variable.assign*`, checked before anything travels: the variable's shape (or a scalar), a dtype
    that holds the values, integers that fit."""
    check_shape(method, tuple(operand.shape), tuple(variable.shape), variable.name)
    if not can_convert(operand.dtype, variable.dtype):
        raise TypeError(f"{method} cannot write dtype {operand.dtype} into variable {variable.name!r} of dtype "
                        f"{variable.dtype}.")
    check_integers_fit(operand, variable.dtype, method, variable.name)  # the server's cast would wrap them


def _check_rows(variable: Any, method: str, indices: np.ndarray, updates: np.ndarray, rows: int) -> np.ndarray:
    """`updates` of the variable's dtype, once checked as distrib.Variable's scatters check theirs, before anything
    travels: row ids are integers in [0, rows); `updates` holds one row (of the variable's row shape) per id."""
    check_scatter_kind(method, variable.dtype, variable.name)
    if indices.dtype.kind not in "iu":
        raise TypeError(f"{method} needs integer row ids. Received: dtype {indices.dtype} for {variable.name!r}.")
    if indices.size and (indices.min() < 0 or indices.max() >= rows):
        raise ValueError(f"{method} needs row ids in [0, {rows}). Received: ids from {indices.min()} to "
                         f"{indices.max()} for {variable.name!r}.")
    expected = indices.shape + tuple(variable.shape[1:])
    if updates.shape != expected:
        raise ValueError(f"{method} needs updates of shape {expected} (one row per id) for {variable.name!r}. "
                         f"Received: shape {updates.shape}.")
    return scatter_values(method, updates, variable.dtype, variable.name, "updates")
