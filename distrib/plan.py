"""Pure planning of batched collectives: which values share a flat buffer, at which offsets, cut into which calls.

A plan never upcasts: values are grouped by dtype first (stable, in order of first appearance), then packed
within each group. Two packing rules exist, both TensorFlow's:

- `plan_by_size` (CollectiveAllReduce's `group_by_size`): values are taken in *reverse* order (gradients arrive
  last layer first) and a pack is closed once its byte count *exceeds* `bytes_per_pack`; 0 means one pack.
- `plan_concat_split` (NcclAllReduce's `num_packs`): values in their own order are concatenated and the flat
  buffer is cut into `num_packs` nearly equal chunks, ignoring value boundaries, the remainder in the last
  chunk; 0 means one call per value.

Every replica computes the identical plan from the same (shape, dtype) list, so plans need no exchange. An
`AllReducePlan` adds what a backend needs to execute a whole batched all-reduce: how each chunk moves (the
backend's all-reduce, ring, NCCL only, or hierarchical copy with its summing devices) and whether it averages.
This module imports nothing from distrib: backends import its data types, never the reverse.
"""

from __future__ import annotations

import functools
import math
import zlib
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
FLOAT_PREFIXES = ("float", "complex", "bfloat")  # dtype names of inexact numbers, ml_dtypes' included


def dtype_name(dtype: object) -> str:
    """np.dtype(dtype).name, memoized (the property is slow and plans ask it for every value)."""
    try:
        name = _DTYPE_NAMES.get(dtype)
    except TypeError:  # an unhashable dtype spec, e.g. a list describing a structured dtype
        return np.dtype(dtype).name
    if name is None:
        name = _DTYPE_NAMES[dtype] = np.dtype(dtype).name
    return name


def is_inexact(dtype: object) -> bool:
    """Whether `dtype` holds floating-point or complex numbers, ml_dtypes' bfloat16 (NumPy kind 'V') included."""
    return dtype_name(dtype).startswith(FLOAT_PREFIXES)


def integer_mean(total, count: int):
    """An integer sum's MEAN over `count` replicas as TensorFlow's true division gives it: float32 for 8- and
    16-bit integers, float64 for wider ones (NumPy's `/` gives float64 for all), computed in that dtype; a
    NumPy or CuPy array, 0-d included."""
    dtype = np.float32 if np.dtype(total.dtype).itemsize <= 2 else np.float64
    out = total.astype(dtype)  # a copy: the sum may be a read-only view shared between replicas
    out /= count
    return out


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


@functools.lru_cache(maxsize=256)
def one_buffer_per_dtype(specs: tuple[tuple[tuple[int, ...], object], ...]) -> Plan:
    """`plan_concat_split(specs, 1)`, memoized (a training step asks for the same packing at every step)."""
    return plan_concat_split(specs, 1)


# -- how a batched all-reduce moves its packs ------------------------------------------------------------------

NATIVE = "native"  # the backend's own all-reduce: NCCL on GPUs, in-order sums on the CPU emulator
RING = "ring"  # reduce-scatter then all-gather, the two phases of the ring algorithm
NCCL = "nccl"  # NATIVE where the backend's collectives are NCCL; any other backend refuses the plan
HIERARCHICAL = "hierarchical"  # TensorFlow's hierarchical copy: each half sums on one device, the halves swap
METHODS = (NATIVE, RING, NCCL, HIERARCHICAL)


@dataclass(frozen=True)
class AllReducePlan:
    """A whole batched all-reduce as data: the packing, how every chunk moves, and whether it averages.

    `roots[k]` (HIERARCHICAL only) are the devices `(m0, m1)`, by position, that sum the k-th chunk of the
    plan (chunks counted across buffers in order): m0 sums its half and m1 the other half.
    """

    packing: Plan
    method: str
    mean: bool
    num_devices: int
    roots: tuple[tuple[int, int], ...] = ()

    @functools.cached_property
    def single(self) -> tuple[str, tuple[int, ...] | None, bool] | None:
        """For a plan that moves one value in one call (a step's usual all-reduce): its dtype name, the shape to
        give the flat result (None: 1-D already) and whether MEAN divides it in place (a float); else None.
        Worked out once per plan, for backends' shortcuts, rather than at every step."""
        buffers = self.packing.buffers
        if len(buffers) != 1 or len(buffers[0].members) != 1 or len(buffers[0].chunks) != 1:
            return None
        dtype = buffers[0].dtype
        return dtype, buffers[0].views[0][1], self.mean and dtype.startswith(FLOAT_PREFIXES)

    @functools.cached_property
    def identity(self) -> int:
        """What the plan reduces and how, as an integer every process computes alike for the same values: each
        value's position, shape and dtype, and whether it averages (a crc32 of them as text: a str's hash differs
        from process to process). Processes compare it before a collective across them."""
        values = [(m.index, m.shape, b.dtype) for b in self.packing.buffers for m in b.members]
        return zlib.crc32(repr((self.mean, values)).encode())


def hierarchical_roots(num_chunks: int, num_devices: int) -> tuple[tuple[int, int], ...]:
    """TensorFlow's choice of summing devices for hierarchical copy: chunk k sums on m0 = k % n, in its half,
    and on m1 in the other half, so consecutive chunks spread the work over the devices.

    Example:
      >>> hierarchical_roots(3, 4)
      ((0, 2), (1, 3), (2, 0))
    """
    if num_devices < 2:
        return ((0, 0),) * num_chunks
    halves = (range(num_devices // 2), range(num_devices // 2, num_devices))
    roots = []
    for k in range(num_chunks):
        m0 = k % num_devices
        far = halves[1] if m0 in halves[0] else halves[0]
        roots.append((m0, far[k % len(far)]))
    return tuple(roots)


def all_reduce_plan(packing: Plan, method: str, mean: bool, num_devices: int) -> AllReducePlan:
    """The AllReducePlan of `packing` moved by `method` over `num_devices` devices (MEAN when `mean`)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}. Received: {method!r}.")
    if num_devices < 1:
        raise ValueError(f"num_devices must be at least 1. Received: {num_devices}.")
    roots = hierarchical_roots(packing.num_calls, num_devices) if method == HIERARCHICAL else ()
    return AllReducePlan(packing, method, mean, num_devices, roots)
