"""Pure planning of batched collectives: which values share a flat buffer, at which offsets, cut into which calls.

A plan never upcasts: values are grouped by dtype first (stable, in order of first appearance), then packed
within each group. Two packing rules exist, both TensorFlow's:

- `plan_by_size` (CollectiveAllReduce's `group_by_size`): values are taken in *reverse* order (gradients arrive
  last layer first) and a pack is closed once its byte count *exceeds* `bytes_per_pack`; 0 means one pack.
- `plan_concat_split` (NcclAllReduce's `num_packs`): values in their own order are concatenated and the flat
  buffer is cut into `num_packs` nearly equal chunks, ignoring value boundaries, the remainder in the last
  chunk; 0 means one call per value.

Every replica computes the identical plan from the same (shape, dtype) list, so plans need no exchange.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Member:
    """One value's place in a buffer."""

    index: int  # position in the caller's list of values
    shape: tuple[int, ...]
    offset: int  # first element within the buffer
    size: int  # number of elements

    @property
    def span(self) -> slice:
        """The member's elements within the flat buffer."""
        return slice(self.offset, self.offset + self.size)


@dataclass(frozen=True)
class Buffer:
    """A flat buffer of one dtype holding several values, moved by one collective call per chunk."""

    dtype: str
    members: tuple[Member, ...]
    chunks: tuple[tuple[int, int], ...]  # non-empty [start, stop) element ranges covering the buffer

    @functools.cached_property
    def size(self) -> int:
        return sum(m.size for m in self.members)

    @functools.cached_property
    def views(self) -> tuple[tuple[slice, tuple[int, ...] | None], ...]:
        """Per member: its slice of the flat buffer, and the shape to reshape to (None when 1-D already)."""
        return tuple((m.span, None if len(m.shape) == 1 else m.shape) for m in self.members)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Plan:
    """Buffers in execution order; every value of the input appears in exactly one buffer."""

    buffers: tuple[Buffer, ...]

    @property
    def num_calls(self) -> int:
        """Collective calls the plan makes (one per chunk)."""
        return sum(len(b.chunks) for b in self.buffers)


Spec = tuple[Sequence[int], object]  # (shape, dtype) of one value


def _check_non_negative(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be non-negative. Received: {value}.")


def group_by_dtype(dtypes: Sequence[object]) -> list[list[int]]:
    """Indices grouped by dtype, groups in order of first appearance, indices in input order."""
    groups: dict[str, list[int]] = {}
    for index, dtype in enumerate(dtypes):
        groups.setdefault(dtype_name(dtype), []).append(index)
    return list(groups.values())


def group_by_size(nbytes: Sequence[int], bytes_per_pack: int) -> list[list[int]]:
    """TensorFlow's `group_by_size`: positions packed in order; a pack closes only after *exceeding* the limit.

    Example:
      >>> group_by_size([128, 32, 800, 4], 200)
      [[0, 1, 2], [3]]
    """
    _check_non_negative("bytes_per_pack", bytes_per_pack)
    if bytes_per_pack == 0 or not nbytes:
        return [list(range(len(nbytes)))] if nbytes else []
    packs: list[list[int]] = []
    current = 0
    for position, size in enumerate(nbytes):
        if not packs or current > bytes_per_pack:
            packs.append([])
            current = 0
        packs[-1].append(position)
        current += size
    return packs


def concat_split_bounds(total: int, num_packs: int) -> list[tuple[int, int]]:
    """TensorFlow's concat-and-split cut of `total` elements into `num_packs` ranges, remainder in the last.

    Example:
      >>> concat_split_bounds(10, 3)
      [(0, 3), (3, 6), (6, 10)]
    """
    if num_packs < 1:
        raise ValueError(f"num_packs must be >= 1 to cut a buffer. Received: {num_packs}.")
    step = total // num_packs
    starts = [k * step for k in range(num_packs)]
    stops = starts[1:] + [total]
    return list(zip(starts, stops))


_DTYPE_NAMES: dict[object, str] = {}


def dtype_name(dtype: object) -> str:
    """np.dtype(dtype).name, memoized (the property is slow and plans ask it for every value)."""
    try:
        name = _DTYPE_NAMES.get(dtype)
    except TypeError:  # an unhashable dtype spec, e.g. a list describing a structured dtype
        return np.dtype(dtype).name
    if name is None:
        name = _DTYPE_NAMES[dtype] = np.dtype(dtype).name
    return name


def _normalize(specs: Sequence[Spec]) -> list[tuple[tuple[int, ...], str, int]]:
    out = []
    for shape, dtype in specs:
        shape = tuple(int(d) for d in shape)
        out.append((shape, dtype_name(dtype), math.prod(shape)))
    return out


def _buffer(indices: Sequence[int], specs: list, chunks: tuple[tuple[int, int], ...] | None = None) -> Buffer:
    members, offset = [], 0
    for index in indices:
        shape, _, size = specs[index]
        members.append(Member(index, shape, offset, size))
        offset += size
    if chunks is None:
        chunks = ((0, offset),)
    return Buffer(specs[indices[0]][1], tuple(members), tuple(c for c in chunks if c[1] > c[0]))


def plan_by_size(specs: Sequence[Spec], bytes_per_pack: int) -> Plan:
    """Plan of the collective path: reverse order, group by dtype, pack by `bytes_per_pack` (0 = one pack).

    Example:
      >>> plan = plan_by_size([((32,), "float32"), ((8,), "float32"), ((200,), "float32"), ((1,), "float32")], 200)
      >>> [[m.index for m in b.members] for b in plan.buffers]
      [[3, 2], [1, 0]]
    """
    _check_non_negative("bytes_per_pack", bytes_per_pack)
    specs = _normalize(specs)
    order = list(range(len(specs)))[::-1]
    buffers = []
    for group in group_by_dtype([specs[i][1] for i in order]):
        indices = [order[p] for p in group]
        for pack in group_by_size([specs[i][2] * np.dtype(specs[i][1]).itemsize for i in indices], bytes_per_pack):
            buffers.append(_buffer([indices[p] for p in pack], specs))
    return Plan(tuple(buffers))


def plan_concat_split(specs: Sequence[Spec], num_packs: int) -> Plan:
    """Plan of NcclAllReduce(num_packs): per dtype, concatenate in order and cut into `num_packs` calls.

    With `num_packs == 0` every value is its own buffer and call.

    Example:
      >>> plan = plan_concat_split([((4,), "float32"), ((6,), "float32")], 3)
      >>> plan.buffers[0].chunks
      ((0, 3), (3, 6), (6, 10))
    """
    _check_non_negative("num_packs", num_packs)
    specs = _normalize(specs)
    if num_packs == 0:
        return Plan(tuple(_buffer([i], specs) for i in range(len(specs))))
    buffers = []
    for group in group_by_dtype([s[1] for s in specs]):
        total = sum(specs[i][2] for i in group)
        buffers.append(_buffer(group, specs, tuple(concat_split_bounds(total, num_packs))))
    return Plan(tuple(buffers))
