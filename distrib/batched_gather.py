"""All-gather of many values in one backend all_gather per dtype: pad, pack, gather, cut each value out."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from distrib import plan as planner
from distrib.backends.base import Backend
from distrib.backends.cpu import native_order
from distrib.errors import CollectiveMismatchError

# Each value's layout on one replica: (length along the gather axis, elements per row, rank, dtype kind, itemsize,
# the gather axis, a hash of the shape off it). The axis and the shape travel too: another process gathering a
# (2, 2) value along the other axis, or a (3, 4) row against a (4, 3) one, has the same elements per row
Layout = tuple[int, int, int, int, int, int, int]
# (this process's per-replica layouts of every value) -> every replica's, of every process, in replica order
GatherLayouts = Callable[[list[list[Layout]]], list[list[Layout]]]


def batch_all_gather(backend: Backend, per_replica: Sequence[Sequence[Any]], devices: Sequence[str], axis: int,
                     gather_layouts: GatherLayouts, timeout: float | None = None) -> list[list[Any]]:
    """Each value `per_replica[r][v]` concatenated along `axis` over every replica, on every device.

    Lengths along `axis` may differ between replicas, shapes elsewhere and dtypes may not (callers check their
    own replicas; other processes' are checked here). Every value's layout travels in one exchange; then each
    replica packs its values, each padded to the longest length, into one flat buffer per dtype, so that every
    replica's buffer has the same size, as a backend's all_gather needs.

    Raises:
      CollectiveMismatchError: another process's replica has a value of another dtype or off-axis shape.
    """
    xp = backend.xp
    devices = list(devices)
    for value in per_replica[0]:  # callers checked that every replica's ranks are replica 0's
        if not -value.ndim <= axis < value.ndim:
            raise ValueError(f"all_gather needs an axis within every value's rank. Received: axis {axis} for a "
                             f"value of shape {value.shape}.")
    axes = [axis % value.ndim for value in per_replica[0]]
    fronts = [[value if a == 0 else xp.moveaxis(value, a, 0) for value, a in zip(values, axes)]  # views
              for values in per_replica]
    layouts = gather_layouts([[_layout(front, a) for front, a in zip(values, axes)] for values in fronts])
    _check_layouts(layouts)
    if len(fronts[0]) == 1 and len({values[0][0] for values in layouts}) == 1:
        return _gathered_alone(backend, fronts, len(layouts), axes[0], devices, timeout)
    lengths = [[layout[0] for layout in values] for values in layouts]
    longest = [max(column) for column in zip(*lengths)]
    blocks = [(n,) + front.shape[1:] for n, front in zip(longest, fronts[0])]  # each value's padded block
    packing = planner.one_buffer_per_dtype(tuple((block, front.dtype) for block, front in zip(blocks, fronts[0])))
    results: list[list[Any]] = [[None] * len(blocks) for _ in devices]
    for buffer in packing.buffers:
        flats = [_pack_padded(backend, values, buffer, longest, device) for values, device in zip(fronts, devices)]
        gathered = backend.all_gather(flats, devices, timeout=timeout)
        shared = _one_host_buffer(backend, gathered)
        for member in buffer.members:
            joined = _joined(backend, gathered, shared, buffer, member, [n[member.index] for n in lengths], devices)
            a = axes[member.index]
            for out, array in zip(results, joined):
                out[member.index] = array if a == 0 else xp.moveaxis(array, 0, a)
    return results


def _gathered_alone(backend: Backend, fronts: list[list[Any]], replicas: int, axis: int, devices: list[str],
                    timeout: float | None) -> list[list[Any]]:
    """One value, equally long on every replica (of `replicas`, every process's): each replica's flat is the value
    itself, and each device's result the gathered buffer reshaped, with none of the padding's bookkeeping."""
    front = fronts[0][0]
    buffer = planner.one_buffer_per_dtype(((front.shape, front.dtype),)).buffers[0]
    flats = [backend.pack(values, buffer, device) for values, device in zip(fronts, devices)]
    shape = (replicas * front.shape[0],) + front.shape[1:]
    gathered = [flat.reshape(shape) for flat in backend.all_gather(flats, devices, timeout=timeout)]
    return [[array if axis == 0 else backend.xp.moveaxis(array, 0, axis)] for array in gathered]


def _layout(front: Any, axis: int) -> Layout:
    off_axis = tuple(int(n) for n in front.shape[1:])  # a tuple of ints hashes alike in every process
    return (front.shape[0], math.prod(off_axis), front.ndim, ord(front.dtype.kind), front.dtype.itemsize, axis,
            hash(off_axis))


def _check_layouts(layouts: list[list[Layout]]) -> None:
    """Every replica's values must match replica 0's but for their lengths along the gather axis."""
    first = [layout[1:] for layout in layouts[0]]
    for replica_id, values in enumerate(layouts[1:], start=1):
        mine = [layout[1:] for layout in values]
        if mine == first:
            continue  # the common case, checked in bulk
        k = next(k for k, (a, b) in enumerate(zip(mine, first)) if a != b)
        raise CollectiveMismatchError(f"all_gather needs the same dtype, axis and shape off the gather axis on "
                                      f"every replica. Received: replica {replica_id}, value {k}, "
                                      f"{_described(mine[k])} vs {_described(first[k])}"
                                      f"{' (another shape off the axis)' if mine[k][:-1] == first[k][:-1] else ''}.")


def _described(layout: tuple) -> str:
    size, rank, kind, itemsize, axis, _ = layout
    return f"rank {rank} gathered along axis {axis}, with {size} elements per row of dtype {chr(kind)}{itemsize}"


def _pack_padded(backend: Backend, fronts: Sequence[Any], buffer: planner.Buffer, longest: list[int],
                 device: str) -> Any:
    """One replica's values of `buffer` packed, each with zero rows appended up to the longest replica's length."""
    members = buffer.members
    if backend.xp is np and any(fronts[m.index].shape[0] != longest[m.index] for m in members):
        # host memory: written into place, without a padded copy of each value that packing then copies again
        flat = backend.empty((buffer.size,), fronts[members[0].index].dtype, device)
        for m in members:
            front = fronts[m.index]
            flat[m.offset:m.offset + front.size].reshape(front.shape)[...] = front
            flat[m.offset + front.size:m.offset + m.size] = 0
        return flat
    return backend.pack([_padded(backend, fronts[m.index], longest[m.index], device) for m in members], buffer, device)


def _padded(backend: Backend, front: Any, longest: int, device: str) -> Any:
    """`front` (the value, gather axis first) with zero rows appended up to `longest` rows."""
    if front.shape[0] == longest:
        return front
    pad = backend.empty((longest,) + front.shape[1:], front.dtype, device)
    with backend.device_scope(device):
        pad[:front.shape[0]] = front
        pad[front.shape[0]:] = 0
    return pad


def _joined(backend: Backend, gathered: Sequence[Any], shared: bool, buffer: planner.Buffer,
            member: planner.Member, lengths: list[int], devices: list[str]) -> list[Any]:
    """One value's concatenation over the replicas (gather axis first), on every device, out of the gathered packs.

    A value gathered alone and equally long everywhere is the gathered buffer itself, reshaped (no copy). Else its
    rows are copied out of each replica's pack, so that a kept result keeps only itself alive; when the devices
    share one read-only gathered buffer (`shared`: the emulator), once for all devices, which get read-only views.
    """
    block = member.shape
    ragged = any(n != block[0] for n in lengths)
    if len(buffer.members) == 1 and not ragged:
        return [flat.reshape((len(lengths) * block[0],) + block[1:]) for flat in gathered]
    if shared:
        joined = _cut_out(backend, gathered[0], buffer.size, member, lengths, ragged, devices[0])
        joined.flags.writeable = False
        return [joined] + [joined.view() for _ in devices[1:]]
    return [_cut_out(backend, flat, buffer.size, member, lengths, ragged, device)
            for flat, device in zip(gathered, devices)]


def _cut_out(backend: Backend, flat: Any, pack_size: int, member: planner.Member, lengths: list[int],
             ragged: bool, device: str) -> Any:
    """Replica r's first `lengths[r]` rows of `member` in each replica's pack of `flat`, concatenated (`ragged`:
    some replica's value is shorter than the member's padded block)."""
    block = member.shape
    packs = flat.reshape(len(lengths), pack_size)
    columns = packs[:, member.offset:member.offset + member.size]  # replica r's padded block: row r
    # in native byte order, as every other result (a byte-swapped member gathered alone keeps its order until here)
    joined = backend.empty((sum(lengths),) + block[1:], native_order(flat.dtype), device)
    with backend.device_scope(device):
        if not ragged:  # no padding anywhere: one strided copy of every replica's block
            backend.xp.copyto(joined.reshape(len(lengths), member.size), columns)
        else:
            backend.xp.concatenate([column.reshape(block)[:n] for column, n in zip(columns, lengths)], axis=0,
                                   out=joined)
    return joined


def _one_host_buffer(backend: Backend, gathered: Sequence[Any]) -> bool:
    """Whether every device's gathered array is the same read-only host memory (the emulator's shared result)."""
    first = gathered[0]
    if backend.xp is not np or first.flags.writeable:
        return False
    address = first.__array_interface__["data"][0]
    return all(flat.__array_interface__["data"][0] == address for flat in gathered[1:])
