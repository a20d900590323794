"""Partitioners (how many shards a variable gets along axis 0) and the "div" placement of rows on shards."""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import numpy as np

__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner", "div_offsets",
           "locate_rows"]


def _positive_int(value: Any, argument: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{argument} must be an integer. Received: {type(value).__name__}.")
    if value < 1:
        raise ValueError(f"{argument} must be at least 1. Received: {value}.")
    return int(value)


def _shape_and_axis(shape: Any, axis: Any) -> tuple[tuple[int, ...], int]:
    """`shape` as a tuple of non-negative ints and `axis` checked against it (only axis 0 is sharded)."""
    try:
        dims = tuple(int(d) for d in shape)
    except TypeError as exc:
        raise TypeError(f"A partitioner needs a fully defined shape (a sequence of ints). Received: {shape!r}.") \
            from exc
    if any(d < 0 for d in dims):
        raise ValueError(f"A partitioner needs a fully defined shape. Received: {dims}.")
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral) or not 0 <= axis < max(len(dims), 1):
        raise ValueError(f"axis must index the shape. Received: axis {axis!r} for shape {dims}.")
    if not dims:
        raise ValueError("A partitioner splits a variable along an axis; a scalar has none. Received: shape ().")
    return dims, int(axis)


def _element_bytes(dtype: Any, bytes_per_string: int) -> int:
    dtype = np.dtype(dtype)
    return bytes_per_string if dtype.kind in "OSU" else dtype.itemsize


def _partitions(dims: tuple[int, ...], axis: int, parts: int) -> list[int]:
    result = [1] * len(dims)
    result[axis] = parts
    return result


class Partitioner:
    """The base of partitioners: `partitioner(shape, dtype, axis=0)` returns the number of partitions per axis.

    Only the first axis is ever split (every other entry is 1). A `ParameterServerStrategy` calls its
    partitioner for every variable created in its scope.
    """

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        raise NotImplementedError


class FixedShardsPartitioner(Partitioner):
    """Allocates a fixed number of shards: `min(num_shards, shape[axis])`.

    Args:
      num_shards: the number of shards, at least 1.

    Example:
      >>> from distrib.experimental.partitioners import FixedShardsPartitioner
      >>> FixedShardsPartitioner(num_shards=2)([10, 3], "float32")
      [2, 1]
      >>> FixedShardsPartitioner(num_shards=8)([5], "float32")  # never more shards than rows
      [5]
    """

    def __init__(self, num_shards: int):
        self._num_shards = _positive_int(num_shards, "num_shards")

    def __call__(self, shape, dtype, axis=0):
        dims, axis = _shape_and_axis(shape, axis)
        return _partitions(dims, axis, max(1, min(self._num_shards, dims[axis])))

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self._num_shards})"


class MinSizePartitioner(Partitioner):
    """Allocates at least `min_shard_bytes` per shard, and at most `max_shards` shards.

    `parts = max(1, min(shape[axis], max_shards, ceil(total_bytes / min_shard_bytes)))`, where strings count
    `bytes_per_string` bytes per element.

    Args:
      min_shard_bytes: the smallest shard, in bytes (default 256 KiB).
      max_shards: the most shards (usually the number of parameter servers).
      bytes_per_string: the size assumed for each string element.

    Example:
      >>> from distrib.experimental.partitioners import MinSizePartitioner
      >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)([6, 1], "float32")
      [2, 1]
      >>> MinSizePartitioner(min_shard_bytes=4, max_shards=10)([6, 1], "float32")
      [6, 1]
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16):
        self._min_shard_bytes = _positive_int(min_shard_bytes, "min_shard_bytes")
        self._max_shards = _positive_int(max_shards, "max_shards")
        self._bytes_per_string = _positive_int(bytes_per_string, "bytes_per_string")

    def __call__(self, shape, dtype, axis=0):
        dims, axis = _shape_and_axis(shape, axis)
        total_bytes = math.prod(dims) * _element_bytes(dtype, self._bytes_per_string)
        wanted = -(-total_bytes // self._min_shard_bytes)
        return _partitions(dims, axis, max(1, min(dims[axis], self._max_shards, wanted)))

    def __repr__(self) -> str:
        return (f"MinSizePartitioner(min_shard_bytes={self._min_shard_bytes}, max_shards={self._max_shards}, "
                f"bytes_per_string={self._bytes_per_string})")


class MaxSizePartitioner(Partitioner):
    """Allocates shards of at most `max_shard_bytes` each (at least one row each), capped by `max_shards`.

    `per_shard = max(1, floor(max_shard_bytes / bytes per row))`, `parts = ceil(shape[axis] / per_shard)`,
    then at most `max_shards`; a shape with no rows or empty rows gets 1.

    Args:
      max_shard_bytes: the largest shard, in bytes.
      max_shards: the most shards, or None for no limit.
      bytes_per_string: the size assumed for each string element.

    Example:
      >>> from distrib.experimental.partitioners import MaxSizePartitioner
      >>> MaxSizePartitioner(max_shard_bytes=4)([6, 1], "float32")
      [6, 1]
      >>> MaxSizePartitioner(max_shard_bytes=4, max_shards=2)([6, 1], "float32")
      [2, 1]
      >>> MaxSizePartitioner(max_shard_bytes=1024)([6, 1], "float32")
      [1, 1]
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16):
        self._max_shard_bytes = _positive_int(max_shard_bytes, "max_shard_bytes")
        self._max_shards = None if max_shards is None else _positive_int(max_shards, "max_shards")
        self._bytes_per_string = _positive_int(bytes_per_string, "bytes_per_string")

    def __call__(self, shape, dtype, axis=0):
        dims, axis = _shape_and_axis(shape, axis)
        row_bytes = math.prod(dims[:axis] + dims[axis + 1:]) * _element_bytes(dtype, self._bytes_per_string)
        if row_bytes == 0 or dims[axis] == 0:
            return _partitions(dims, axis, 1)
        per_shard = max(1, self._max_shard_bytes // row_bytes)
        parts = -(-dims[axis] // per_shard)
        if self._max_shards is not None:
            parts = min(parts, self._max_shards)
        return _partitions(dims, axis, parts)

    def __repr__(self) -> str:
        return (f"MaxSizePartitioner(max_shard_bytes={self._max_shard_bytes}, max_shards={self._max_shards}, "
                f"bytes_per_string={self._bytes_per_string})")


def div_offsets(rows: int, parts: int) -> list[int]:
    """The first row of each shard, and `rows` last: the "div" rule, the first `rows % n` shards one row longer.

    Example:
      >>> from distrib.parameter_server.partitioners import div_offsets
      >>> div_offsets(13, 5)  # shards [0, 3), [3, 6), [6, 9), [9, 11), [11, 13)
      [0, 3, 6, 9, 11, 13]
    """
    n = max(1, min(parts, rows))
    base, extra = divmod(rows, n)
    offsets = [0]
    for i in range(n):
        offsets.append(offsets[-1] + base + (i < extra))
    return offsets


def locate_rows(ids: Any, offsets: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The shard of each row id and its index inside that shard, for shards starting at `offsets`.

    Raises:
      ValueError: an id that is negative or not below the row count (nothing is read or written then).

    Example:
      >>> from distrib.parameter_server.partitioners import div_offsets, locate_rows
      >>> shard, local = locate_rows([10, 8], div_offsets(13, 5))
      >>> shard.tolist(), local.tolist()
      ([3, 2], [1, 2])
    """
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"Row ids must be integers. Received: dtype {ids.dtype}.")
    rows = offsets[-1]
    bad = (ids < 0) | (ids >= rows)
    if bad.any():
        raise ValueError(f"Row ids must lie in [0, {rows}). Received: {ids[bad][:5].tolist()} "
                         f"(at positions {np.flatnonzero(bad)[:5].tolist()}).")
    bounds = np.asarray(offsets, dtype=np.int64)
    shard = np.searchsorted(bounds, ids, side="right") - 1
    return shard, ids - bounds[shard]
