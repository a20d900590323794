"""ShardedVariable: a variable split along axis 0 into shards, read and written whole or by row."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from distrib.backends.cpu import to_numpy
from distrib.parameter_server.partitioners import locate_rows
from distrib.parameter_server.shard_calls import lookup_rows, results, start
from distrib.parameter_server.variable import ParameterServerVariable, RowUpdates, _check_operand, _check_rows
from distrib.variables import Variable, _ArrayOperators


class ShardedVariable(RowUpdates, _ArrayOperators):
    """A variable split along its first axis into shards; `ParameterServerStrategy` builds one per partitioned variable.

    The shards share the dtype and every dimension but the first; the variable's shape is the sum of their
    row counts, then the rest. Reads concatenate the shards; `assign*` split the value by rows; row lookups
    (`embedding_lookup`, `sparse_read`) and row updates (`scatter_*`) touch only the shards, and fetch or send
    only the rows, that the ids name. Operations on several shards are sent to their servers together and
    then awaited. A checkpoint saves the full variable, so it restores into any number of shards.

    Args:
      variables: the shards, in row order: `distrib.Variable`s or parameter-server variables.
      name: the variable's name (the shards are `<name>/part_<i>` when a strategy creates them).

    Example:
      >>> import distrib, numpy as np
      >>> table = distrib.ShardedVariable([distrib.Variable(np.arange(6.0).reshape(3, 2)),
      ...                                  distrib.Variable(np.arange(6.0, 10.0).reshape(2, 2))], name="table")
      >>> table.shape, table.embedding_lookup([4, 0]).tolist()
      ((5, 2), [[8.0, 9.0], [0.0, 1.0]])
      >>> table.scatter_add([4, 4], np.ones((2, 2))).numpy()[4].tolist()  # repeated rows accumulate
      [10.0, 11.0]
    """

    def __init__(self, variables: Sequence[Any], name: str = "ShardedVariable"):
        shards = list(variables)
        if not shards:
            raise ValueError("A ShardedVariable needs at least one shard. Received: an empty list.")
        for position, shard in enumerate(shards):
            if not isinstance(shard, (Variable, ParameterServerVariable)):
                raise TypeError(f"A ShardedVariable's shards are distrib variables. Received: "
                                f"{type(shard).__name__} at position {position}.")
            if len(shard.shape) == 0:
                raise ValueError(f"A ShardedVariable splits along axis 0; shard {position} is a scalar.")
            if shard.dtype != shards[0].dtype or tuple(shard.shape[1:]) != tuple(shards[0].shape[1:]):
                raise ValueError(f"A ShardedVariable's shards share the dtype and every dimension but the first. "
                                 f"Received: shard {position} {shard.dtype} {tuple(shard.shape)} vs shard 0 "
                                 f"{shards[0].dtype} {tuple(shards[0].shape)}.")
        self._variables = shards
        self._name = name
        self._offsets = list(np.cumsum([0] + [s.shape[0] for s in shards]).tolist())
        self.trainable = all(getattr(s, "trainable", True) for s in shards)

    # -- description ------------------------------------------------------------------------------------

    @property
    def variables(self) -> list:
        """The shards, in row order."""
        return list(self._variables)

    @property
    def name(self) -> str:
        return self._name

    @property
    def shape(self) -> tuple:
        return (self._offsets[-1],) + tuple(self._variables[0].shape[1:])

    @property
    def dtype(self) -> np.dtype:
        return self._variables[0].dtype

    @property
    def aggregation(self):
        return self._variables[0].aggregation

    @property
    def synchronization(self):
        return self._variables[0].synchronization

    def __repr__(self) -> str:
        rows = [s.shape[0] for s in self._variables]
        return (f"<ShardedVariable {self._name!r} shape={self.shape} dtype={self.dtype.name} "
                f"shards={len(rows)} rows={rows}>")

    # -- whole reads and writes -------------------------------------------------------------------------

    def read_value(self) -> np.ndarray:
        """The full value: the shards concatenated along axis 0."""
        return np.concatenate(results(start(s, "read") for s in self._variables), axis=0)

    def value(self) -> np.ndarray:
        return self.read_value()

    def numpy(self) -> np.ndarray:
        return self.read_value()

    def assign(self, value: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True):
        """Sets the full value (split by rows over the shards); returns the variable."""
        return self._write_whole("assign", value)

    def assign_add(self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True):
        """Adds `delta` (of the full shape, or broadcastable to it); returns the variable."""
        return self._write_whole("assign_add", delta)

    def assign_sub(self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True):
        """Subtracts `delta` (of the full shape, or broadcastable to it); returns the variable."""
        return self._write_whole("assign_sub", delta)

    def _write_whole(self, method: str, value: Any) -> "ShardedVariable":
        operand = to_numpy(value.read_value() if hasattr(value, "read_value") else value)
        _check_operand(self, method, operand)  # all or nothing: no shard is written when one would refuse
        operand = np.broadcast_to(operand, self.shape)
        results(start(s, method, operand[a:b]) for s, a, b in zip(self._variables, self._offsets, self._offsets[1:]))
        return self

    # -- rows -------------------------------------------------------------------------------------------

    def embedding_lookup(self, ids: Any) -> np.ndarray:
        """The rows `ids` (any shape) as an array of shape `ids.shape + shape[1:]`; only those rows travel."""
        return lookup_rows(self, self._variables, self._offsets, ids)

    def sparse_read(self, indices: Any) -> np.ndarray:
        """The rows `indices`: the same as `embedding_lookup`."""
        return self.embedding_lookup(indices)

    def _scatter(self, method: str, indices: Any, updates: Any) -> "ShardedVariable":
        indices, updates = to_numpy(indices), to_numpy(updates)
        updates = _check_rows(self, method, indices, updates, self.shape[0])  # all or nothing, as _write_whole
        flat, rows = indices.reshape(-1), updates.reshape((-1,) + self.shape[1:])
        shard, local = locate_rows(flat, self._offsets)
        results(start(self._variables[p], method, local[shard == p], rows[shard == p]) for p in np.unique(shard))
        return self
