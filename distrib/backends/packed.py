"""The reference execution of an AllReducePlan, pack by pack, through a backend's per-pack primitives.

Both backends execute plans with it today; a backend may replace it with fewer, larger calls (one NCCL group
over every chunk of every buffer) as long as the results are the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from distrib.plan import FLOAT_PREFIXES, HIERARCHICAL, RING, AllReducePlan, Buffer, integer_mean

if TYPE_CHECKING:  # pragma: no cover
    from distrib.backends.base import Backend


def member_views(flat: Any, buffer: Buffer) -> list:
    """Views of `flat`, one per member of `buffer`, in the members' shapes (no copy)."""
    return [flat[span] if shape is None else flat[span].reshape(shape) for span, shape in buffer.views]


PackAll = Callable[[Sequence[Sequence[Any]], Buffer, Sequence[str]], list]  # every device's members -> flats


def execute_pack_by_pack(backend: "Backend", plan: AllReducePlan, per_device: Sequence[Sequence[Any]],
                         devices: Sequence[str], timeout: float | None,
                         pack_all: PackAll | None = None) -> list[list[Any]]:
    """`Backend.execute`, one buffer at a time: pack, move each chunk as `plan.method` says, unpack.

    `pack_all(members_per_device, buffer, devices)` packs every device's members at once (default: one
    `backend.pack` per device in turn).
    """
    devices = list(devices)
    results: list[list[Any]] = [[None] * len(per_device[0]) for _ in devices]
    first_chunk = 0
    for buffer in plan.packing.buffers:
        indices = [m.index for m in buffer.members]
        # integer MEAN is SUM then true division, so 1..4 averages to 2.5 as in TensorFlow
        float_mean = plan.mean and buffer.dtype.startswith(FLOAT_PREFIXES)
        members = [[values[i] for i in indices] for values in per_device]
        if pack_all is None:
            flats = [backend.pack(arrays, buffer, device) for arrays, device in zip(members, devices)]
        else:
            flats = pack_all(members, buffer, devices)
        if plan.method == HIERARCHICAL:
            roots = plan.roots[first_chunk:first_chunk + len(buffer.chunks)]
            reduced = _hierarchical(backend, flats, buffer, devices, float_mean, roots)
        elif plan.method == RING:
            reduced = _ring(backend, flats, buffer, devices, float_mean, timeout)
        else:
            reduced = backend.all_reduce(flats, buffer.chunks, devices, float_mean, timeout=timeout)
        first_chunk += len(buffer.chunks)
        unpack_into(results, backend, plan, buffer, reduced, devices)
    return results


def unpack_into(results: list[list[Any]], backend: "Backend", plan: AllReducePlan, buffer: Buffer,
                reduced: Sequence[Any], devices: Sequence[str], replicas: int | None = None) -> None:
    """Writes the members of each device's reduced flat buffer into `results[device][value index]`; an integer
    MEAN is divided here, after the sum (true division, as TensorFlow does), by `replicas` (default: one per
    device; across processes, every process's)."""
    integers_to_divide = plan.mean and not buffer.dtype.startswith(FLOAT_PREFIXES)
    for out, arrays, device in zip(results, backend.unpack_all(reduced, buffer), devices):
        if integers_to_divide:
            with backend.device_scope(device):
                arrays = [integer_mean(a, replicas or len(devices)) for a in arrays]
        for member, array in zip(buffer.members, arrays):
            out[member.index] = array


def _ring(backend: "Backend", flats: list, buffer: Buffer, devices: list[str], mean: bool,
          timeout: float | None) -> list:
    """Each chunk reduce-scattered (device i sums the i-th slice), then all-gathered; padded to divide evenly."""
    n = len(devices)
    outs = [backend.empty(flats[0].shape, flats[0].dtype, d) for d in devices]
    for start, stop in buffer.chunks:
        size = stop - start
        padded = -(-size // n) * n
        parts = []
        for flat, device in zip(flats, devices):
            if padded == size:
                parts.append(flat[start:stop])
                continue
            part = backend.empty((padded,), flat.dtype, device)
            with backend.device_scope(device):
                part[:size] = flat[start:stop]
                part[size:] = 0
            parts.append(part)
        slices = backend.reduce_scatter(parts, devices, timeout=timeout)
        if mean:
            for piece, device in zip(slices, devices):
                with backend.device_scope(device):
                    piece /= n
        for out, gathered, device in zip(outs, backend.all_gather(slices, devices, timeout=timeout), devices):
            with backend.device_scope(device):
                out[start:stop] = gathered[:size]
    return outs


def _hierarchical(backend: "Backend", flats: list, buffer: Buffer, devices: list[str], mean: bool,
                  roots: Sequence[tuple[int, int]]) -> list:
    """TensorFlow's DGX-1 scheme per chunk: each half sums on its root, the halves swap sums, then copy out."""
    n = len(devices)
    outs = [backend.empty(flats[0].shape, flats[0].dtype, d) for d in devices]
    halves = (list(range(n // 2)), list(range(n // 2, n)))
    for (start, stop), (m0, m1) in zip(buffer.chunks, roots):
        parts = [f[start:stop] for f in flats]
        if n == 1:
            with backend.device_scope(devices[0]):
                outs[0][start:stop] = parts[0]
            continue
        near, far = halves if m0 in halves[0] else halves[::-1]
        total = backend.add_n([backend.add_n([parts[i] for i in near], devices[m0]),
                               backend.copy(backend.add_n([parts[i] for i in far], devices[m1]), devices[m0])],
                              devices[m0])
        if mean:
            with backend.device_scope(devices[m0]):
                total /= n
        total_far = backend.copy(total, devices[m1])
        for group, source in ((near, total), (far, total_far)):
            for i in group:
                local = source if i in (m0, m1) else backend.copy(source, devices[i])
                with backend.device_scope(devices[i]):
                    outs[i][start:stop] = local
    return outs
