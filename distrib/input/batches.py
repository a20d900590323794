"""Batch splitting: a dataset element's leaves as arrays, TensorFlow's row split, empty batches, placement."""

from __future__ import annotations

import functools
import math
import sys
from typing import Any, NamedTuple, Sequence

import numpy as np

from distrib.backends.base import Backend
from distrib.input.contexts import InputWorkers
from distrib.options import InputOptions
from distrib.values import PerReplica, flatten, format_path, unflatten


class ArraySpec(NamedTuple):
    """Shape and dtype of one leaf of a per-replica batch; the batch dimension is None (it varies)."""

    shape: tuple
    dtype: np.dtype



def _array_protocol(value: Any) -> bool:
    """Whether `value` presents itself as an array (NumPy's, DLPack's or CUDA's protocol)."""
    return any(hasattr(value, name) for name in ("__array__", "__dlpack__")) or \
        hasattr(type(value), "__cuda_array_interface__")


def batch_leaves(element: Any, backend: Backend, what: str) -> tuple[list, Any]:
    """Leaves of one dataset element as arrays with a batch dimension, and the structure's spec."""
    leaves, spec = flatten(element)
    if not leaves:
        raise ValueError(f"A {what} must hold at least one array. Received: {element!r}.")
    native = (np.ndarray, backend.xp.ndarray)
    arrays = []
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, native) and leaf.ndim and leaf.dtype.kind not in "OSU" and leaf.dtype.isnative:
            arrays.append(leaf)  # the common case, checked in one line
            continue
        try:
            array = leaf if isinstance(leaf, native) else backend.as_array(leaf)
        except TypeError as exc:
            if _array_protocol(leaf):  # an array the backend cannot read (GPU memory on the emulator): its reason
                raise TypeError(f"{exc} At path {format_path(spec.paths()[k])} of a {what}.") from None
            raise TypeError(f"Every leaf of a {what} must be an array. Received: {type(leaf).__name__} at path "
                            f"{format_path(spec.paths()[k])}.") from exc
        if array.ndim == 0:
            hint = " (a Python list is a structure, not an array: use np.asarray)" if spec.paths()[k] and \
                isinstance(spec.paths()[k][-1], int) else ""
            raise ValueError(f"Every leaf of a {what} needs a leading batch dimension to split across replicas. "
                             f"Received: a scalar at path {format_path(spec.paths()[k])}{hint}.")
        if array.dtype.kind in "OSU":
            raise TypeError(f"Every leaf of a {what} must be a numeric array. Received: dtype {array.dtype} at "
                            f"path {format_path(spec.paths()[k])}.")
        if not array.dtype.isnative:  # a batch holds its values in this machine's byte order, as a tensor does
            array = array.astype(array.dtype.newbyteorder("="))
        arrays.append(array)
    return arrays, spec


# references to a leaf that nobody else holds, inside `captured`: its container (the element, or for a bare array
# the caller's local and `element`), the list of leaves, the comprehension's variable and getrefcount's argument
_OWN_REFERENCES = 4
# references to an element container that nobody else holds: the caller's local, `element`, getrefcount's argument
_OWN_CONTAINER_REFERENCES = 3


def captured(element: Any, arrays: list, spec: Any, backend: Backend) -> list:
    """`arrays` (the leaves of `element`), copied on the emulator where someone else may still write them.

    On emulated devices a replica's batch is a view of the element's own array, and the consumer may keep it
    past the next read: a loader that refills one buffer would overwrite the rows of every batch kept (or, read
    ahead by the prefetch thread, of batches not used yet), where TensorFlow copies every element into a tensor.
    So an element is copied, read inline or ahead alike, unless nothing else can write it: an array that owns its
    memory and that only the element references, in an element that only the caller references (a fresh
    gather, np.stack..., yielded in a fresh dict), is kept as is. Elements nested deeper than one container are
    copied whole: their inner containers could be the loader's.
    """
    if backend.xp is not np:  # GPUs copy each batch to the device as produced
        return arrays
    if type(element) is np.ndarray:
        own = _OWN_REFERENCES + 1
    elif spec.num_nodes == len(arrays) + 1 and sys.getrefcount(element) <= _OWN_CONTAINER_REFERENCES:
        own = _OWN_REFERENCES
    else:  # the loader keeps the container (and may refill the arrays it holds), or containers are nested
        return [a.copy() for a in arrays]
    return [a if type(a) is np.ndarray and a.base is None and sys.getrefcount(a) <= own else a.copy()
            for a in arrays]


def batch_rows(arrays: Sequence[Any], spec: Any, what: str) -> int:
    """The batch size shared by every leaf; ValueError naming the paths when they disagree."""
    rows = arrays[0].shape[0]
    for k, array in enumerate(arrays[1:], start=1):
        if array.shape[0] != rows:
            paths = spec.paths()
            raise ValueError(f"Every leaf of a {what} must have the same batch size. Received: path "
                             f"{format_path(paths[k])} has {array.shape[0]} rows, path {format_path(paths[0])} has "
                             f"{rows}.")
    return rows


@functools.lru_cache(maxsize=256)
def split_bounds(rows: int, num_slices: int) -> tuple[tuple[int, int], ...]:
    """Row ranges of TensorFlow's split of a batch of unknown size: slices of ceil(rows / n), the last short.

    Example:
      >>> split_bounds(7, 4), split_bounds(5, 4)
      (((0, 2), (2, 4), (4, 6), (6, 7)), ((0, 2), (2, 4), (4, 5), (5, 5)))
    """
    size = math.ceil(rows / num_slices) if rows else 0
    return tuple((min(i * size, rows), min((i + 1) * size, rows)) for i in range(num_slices))


def place(workers: InputWorkers, options: InputOptions, per_replica: list[list[Any]]) -> list[list[Any]]:
    if not options.experimental_fetch_to_device:
        return [[workers.backend.to_host(a) for a in arrays] for arrays in per_replica]
    return [workers.backend.prefetch_to_device(arrays, device) for arrays, device in zip(per_replica, workers.devices)]


class EmptyBatches:
    """Empty batches shaped like the latest real one, for replicas that get no rows in a step.

    Only the structure, trailing shapes and dtypes are kept: holding arrays (even empty views) would pin the
    whole batch they came from.
    """

    def __init__(self):
        self._spec: Any = None
        self._leaves: list[tuple[tuple, np.dtype]] = []

    def remember(self, spec: Any, arrays: Sequence[Any]) -> None:
        self._spec, self._leaves = spec, [(a.shape[1:], a.dtype) for a in arrays]

    @property
    def known(self) -> bool:
        """Whether a batch has been seen to take the structure from."""
        return self._spec is not None

    def make(self, count: int, no_data: str) -> tuple[Any, list[list[np.ndarray]]]:
        """`count` empty batches (host arrays, placed later) and their structure; ValueError(no_data) if no
        batch has been seen yet to take the shapes from."""
        if self._spec is None:
            raise ValueError(no_data)
        return self._spec, [[np.empty((0,) + shape, dtype) for shape, dtype in self._leaves] for _ in range(count)]


def assemble(spec: Any, per_replica: list[list[Any]], wrap: bool = True) -> Any:
    """One structure whose leaves are PerReplica values, from each replica's list of leaves; unless `wrap` is
    False (one replica in one process), the replica's own structure of arrays, as TensorFlow gives it."""
    if not wrap:
        (leaves,) = per_replica
        return unflatten(spec, leaves)
    return unflatten(spec, [PerReplica._wrap(tuple(column)) for column in zip(*per_replica)])
