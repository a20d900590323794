"""Calls on the shards of a variable, each local or on a parameter server: started all at once, then awaited all."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from distrib.backends.cpu import to_numpy
from distrib.parameter_server.partitioners import locate_rows
from distrib.variables import Variable, scatter_rows


class _Done:
    """The result of an operation on a local shard, already computed (a remote shard returns a Pending)."""

    def __init__(self, value: Any = None):
        self._value = value

    def result(self) -> Any:
        return self._value


def start(shard: Any, method: str, *args: Any) -> Any:
    """Starts `method` on one shard: done at once on a local variable, sent without waiting to a parameter server
    (a ParameterServerVariable)."""
    if isinstance(shard, Variable):
        if method == "read":
            return _Done(shard.read_value())
        if method == "read_rows":
            return _Done(shard.read_value()[args[0]])
        if method.startswith("scatter_"):
            scatter_rows(np, shard._writable(), method, *args)
            return _Done()
        getattr(shard, method)(*args)
        return _Done()
    if method in ("read", "read_rows"):
        return shard._start(method, *args)
    if method.startswith("scatter_"):
        return shard._start_scatter(method, *args)
    return shard._start_write(method, *args)


def results(started: Iterable[Any]) -> list:
    """The results of the calls `started` makes, awaited all even when one fails (or fails to start); then the
    first error is raised. A call left unawaited would print Ray's "Unhandled error" later, and the caller would
    hear of a failure while other shards' writes were still landing."""
    pending, results, error = [], [], None
    try:
        for call in started:
            pending.append(call)
    except Exception as exc:  # noqa: BLE001 - raised below, once the calls already sent are done
        error = exc
    for call in pending:
        try:
            results.append(call.result())
        except Exception as exc:  # noqa: BLE001
            error = error or exc
    if error is not None:
        raise error
    return results


def lookup_rows(variable: Any, shards: Sequence[Any], offsets: Sequence[int], ids: Any) -> np.ndarray:
    """`variable.embedding_lookup(ids)` over its `shards` starting at rows `offsets` (one for an unsharded one):
    the ids are checked before anything is read, then each shard is asked for its rows, all at once."""
    if not variable.shape:
        raise ValueError(f"embedding_lookup needs a variable of rank 1 or more: ids select rows along axis 0. "
                         f"Received: variable {variable.name!r} of shape ().")
    ids = to_numpy(ids)
    flat = ids.reshape(-1)
    shard, local = locate_rows(flat, offsets)
    row_shape = tuple(variable.shape[1:])
    out = np.empty((flat.size,) + row_shape, variable.dtype)
    touched = np.unique(shard)
    for p, rows in zip(touched, results(start(shards[p], "read_rows", local[shard == p]) for p in touched)):
        out[shard == p] = rows
    return out.reshape(ids.shape + row_shape)
