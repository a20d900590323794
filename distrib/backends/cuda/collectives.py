"""The CUDA backend's collectives: NCCL group calls over distinct GPUs, the reduce kernel where replicas share one.

A mixin of CudaBackend (backend.py), which provides the devices, streams, placement, packing and kernels these
methods use (`_ordinal`, `_stream`, `_on`, `_copy_between`, `copy`, `to_device`, `pack`, `unpack`, `_kernels`,
`_comms`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import cupy
import numpy as np

from distrib.backends.cuda import dtypes as cuda_dtypes
from distrib.backends.cuda import nccl as nccl_comms
from distrib.backends.cuda.arrays import aligned, as_cupy, contiguous, is_c_contiguous, on_gpu
from distrib.backends.packed import FLOAT_PREFIXES, execute_pack_by_pack, unpack_into
from distrib.options import default_timeout
from distrib.plan import HIERARCHICAL, RING, dtype_name


class NcclMove(NamedTuple):
    """One flat buffer per device on its way through an NCCL all-reduce."""

    dtype: str  # the buffer's own dtype, which the outputs are cast back to
    reduction: cuda_dtypes.NcclReduction
    sources: list[cupy.ndarray]
    outputs: list[cupy.ndarray]
    calls: list[tuple[int, int]]  # (byte offset, wire count) per NCCL call


class NcclCollectives:
    """execute, all_reduce, all_gather, reduce_scatter, broadcast and add_n on CuPy arrays (see the module)."""

    def execute(self, plan, per_device, devices, *, timeout=None):
        """A whole NATIVE or NCCL plan over distinct GPUs as one NCCL group: every buffer packed (one kernel per
        buffer and device), every chunk of every buffer in one group call, one watchdog entry, members unpacked
        by one kernel per buffer and device. Ring and hierarchical plans, and replicas sharing a GPU, go pack by
        pack."""
        ordinals = [self._ordinal(d) for d in devices]
        distinct = len(set(ordinals))
        if plan.method in (RING, HIERARCHICAL) or 1 < distinct < len(ordinals):
            return execute_pack_by_pack(self, plan, per_device, devices, timeout)
        results: list[list[Any]] = [[None] * len(per_device[0]) for _ in devices]
        moves = []  # per buffer: (buffer, its NcclMove)
        for buffer in plan.packing.buffers:
            indices = [member.index for member in buffer.members]
            flats = [self.pack([values[i] for i in indices], buffer, device)
                     for values, device in zip(per_device, devices)]
            float_mean = plan.mean and buffer.dtype.startswith(FLOAT_PREFIXES)
            outputs = functools.partial(self._reused_outputs, buffer, ordinals)  # of a dtype
            if distinct < len(ordinals):  # every replica on one GPU: one reduce kernel writes every output
                sums = outputs(flats[0].dtype)
                self._sum_into(ordinals[0], "all_reduce", flats, ordinals, len(flats) if float_mean else 1, sums)
                unpack_into(results, self, plan, buffer, sums, devices)
            else:
                moves.append((buffer, self._nccl_move(flats, buffer.chunks, ordinals, float_mean, outputs)))
        self._launch_all_reduces([move for _, move in moves], ordinals, timeout)
        for buffer, move in moves:
            unpack_into(results, self, plan, buffer, self._finish(move, ordinals), devices)
        return results

    def _reused_outputs(self, buffer, ordinals: Sequence[int], dtype) -> list[cupy.ndarray]:
        """Each device's output flat for `buffer`: last step's where nothing holds it any more (cuda/results.py)."""
        def allocate(ordinal: int) -> Callable[[], cupy.ndarray]:
            def empty() -> cupy.ndarray:
                with self._on(ordinal):
                    return cupy.empty(buffer.size, dtype)
            return empty

        return [self._outputs.take(buffer, k, ordinal, allocate(ordinal)) for k, ordinal in enumerate(ordinals)]

    def all_reduce(self, flats, chunks, devices, mean, *, timeout=None):
        ordinals = self._flats_on("all_reduce", flats, devices)
        if len(set(ordinals)) < len(ordinals):
            return self._reduce_by_copies("all_reduce", flats, ordinals, mean)
        move = self._nccl_move(flats, chunks, ordinals, mean)
        self._launch_all_reduces([move], ordinals, timeout)
        return self._finish(move, ordinals)

    def _nccl_move(self, flats: Sequence[cupy.ndarray], chunks: Sequence[tuple[int, int]], ordinals: Sequence[int],
                   mean: bool, outputs_of: Callable[[Any], list] | None = None) -> NcclMove:
        """How one flat buffer per device is all-reduced through NCCL: cast if its dtype needs it, into new outputs
        (or `outputs_of(dtype)`'s, when no cast is needed)."""
        reduction = cuda_dtypes.nccl_reduction(dtype_name(flats[0].dtype), mean, self._nccl(), "all_reduce")
        sources = self._cast(flats, ordinals, reduction.cast)
        if outputs_of is None or reduction.cast:
            outputs = self._like(sources, ordinals, sources[0].size)
        else:
            outputs = outputs_of(sources[0].dtype)
        calls = cuda_dtypes.chunk_calls(chunks, sources[0].itemsize, reduction.factor)
        return NcclMove(dtype_name(flats[0].dtype), reduction, sources, outputs, calls)

    def _launch_all_reduces(self, moves: Sequence[NcclMove], ordinals: Sequence[int], timeout: float | None) -> None:
        """Every call of every move in one NCCL group (nothing is launched when no move has a call)."""

        def launch(rank, comm, stream):
            for move in moves:
                send, receive = move.sources[rank].data.ptr, move.outputs[rank].data.ptr
                for offset, count in move.calls:
                    comm.allReduce(send + offset, receive + offset, count, move.reduction.nccl_type,
                                   move.reduction.op, stream)

        if any(move.calls for move in moves):
            self._group("all_reduce", ordinals, launch, timeout)

    def _finish(self, move: NcclMove, ordinals: Sequence[int]) -> list[cupy.ndarray]:
        """A launched move's outputs, divided where NCCL could not average (before 2.10.3) and cast back."""
        if move.reduction.divide:
            self._divide_in_place(move.outputs, ordinals, len(ordinals))
        return self._cast(move.outputs, ordinals, move.dtype) if move.reduction.cast else move.outputs

    def _gathered_count(self, local: int) -> int:
        """How many devices' arrays an all-gather collects: the `local` ones (across processes: every one)."""
        return local

    def _divide_in_place(self, outputs: Sequence[cupy.ndarray], ordinals: Sequence[int], divisor: int) -> None:
        """Divides each device's output in place by `divisor`, as NumPy rounds (the reduce kernel)."""
        wire = cuda_dtypes.kernel_wire(dtype_name(outputs[0].dtype), "all_reduce")
        for out, ordinal in zip(outputs, ordinals):
            with self._on(ordinal):
                self._kernels.reduce(wire.dtype, out.size * wire.factor, [out], [out], divisor=divisor)

    def all_gather(self, flats, devices, *, timeout=None):
        ordinals = self._flats_on("all_gather", flats, devices)
        size = flats[0].size * self._gathered_count(len(flats))
        if len(set(ordinals)) < len(ordinals):
            gathered = {}
            for ordinal in dict.fromkeys(ordinals):
                local = [self.to_device(f, f"GPU:{ordinal}") for f in flats]
                with self._on(ordinal):
                    gathered[ordinal] = cupy.empty(size, flats[0].dtype)
                    self._kernels.move(gathered[ordinal], local, pack=True)
            return [gathered[o] if k == ordinals.index(o) else self.copy(gathered[o], f"GPU:{o}")
                    for k, o in enumerate(ordinals)]
        outputs = self._like(flats, ordinals, size)
        nbytes = flats[0].nbytes

        def launch(rank, comm, stream):
            comm.allGather(flats[rank].data.ptr, outputs[rank].data.ptr, nbytes, cuda_dtypes.BYTES, stream)

        if nbytes:
            self._group("all_gather", ordinals, launch, timeout)
        return outputs

    def reduce_scatter(self, flats, devices, *, timeout=None):
        ordinals = self._flats_on("reduce_scatter", flats, devices)
        n = len(ordinals)
        if flats[0].size % n:
            raise ValueError(f"reduce_scatter needs a length divisible by {n} devices. Received: {flats[0].size}.")
        part = flats[0].size // n
        if len(set(ordinals)) < n:
            total = self._sum_on(ordinals[0], "reduce_scatter", flats, ordinals, 1, outputs=1)[0]
            return [self.copy(total[k * part:(k + 1) * part], f"GPU:{o}") for k, o in enumerate(ordinals)]
        plan = cuda_dtypes.nccl_reduction(dtype_name(flats[0].dtype), False, self._nccl(), "reduce_scatter")
        sources = self._cast(flats, ordinals, plan.cast)
        outputs = self._like(sources, ordinals, part)

        def launch(rank, comm, stream):
            comm.reduceScatter(sources[rank].data.ptr, outputs[rank].data.ptr, part * plan.factor, plan.nccl_type,
                               plan.op, stream)

        if part:
            self._group("reduce_scatter", ordinals, launch, timeout)
        return self._cast(outputs, ordinals, dtype_name(flats[0].dtype)) if plan.cast else outputs

    def broadcast(self, array, devices, *, timeout=None):
        ordinals = [self._ordinal(d) for d in devices]
        if not on_gpu(array) or as_cupy(array).device.id not in ordinals:
            array = self.to_device(array, devices[0])
        source = as_cupy(array)
        if len(set(ordinals)) < len(ordinals):
            return [self.copy(source, d) for d in devices]
        root = ordinals.index(source.device.id)
        with self._on(source.device.id):
            source = contiguous(source)
        outputs = []
        for ordinal in ordinals:
            with self._on(ordinal):
                outputs.append(cupy.empty(source.shape, source.dtype))

        def launch(rank, comm, stream):
            send = source.data.ptr if rank == root else outputs[rank].data.ptr
            comm.broadcast(send, outputs[rank].data.ptr, source.nbytes, cuda_dtypes.BYTES, root, stream)

        if source.nbytes:
            self._group("broadcast", ordinals, launch, timeout)
        return outputs

    def add_n(self, arrays, device):
        ordinal = self._ordinal(device)
        placed = [self.to_device(a, device) for a in arrays]
        shape = placed[0].shape
        if any(a.shape != shape for a in placed):
            raise ValueError(f"add_n needs arrays of one shape. Received: shapes {[a.shape for a in placed]}.")
        dtype = np.result_type(*(a.dtype for a in placed))
        wire = cuda_dtypes.kernel_wire(dtype_name(dtype), "add_n")
        with self._on(ordinal):
            sources = [aligned(contiguous(a.astype(dtype, copy=False))) for a in placed]
            out = cupy.empty(shape, dtype)
            self._kernels.reduce(wire.dtype, out.size * wire.factor, sources, [out])
        return out

    def _flats_on(self, api: str, flats: Sequence[Any], devices: Sequence[str]) -> list[int]:
        """The devices' ordinals, once every flats[i] is checked to be a contiguous 1-D array on devices[i]."""
        ordinals = [self._ordinal(d) for d in devices]
        if not flats or len(flats) != len(ordinals):
            raise ValueError(f"{api} needs one flat array per device. Received: {len(flats)} arrays for "
                             f"{len(ordinals)} devices.")
        first = flats[0]
        for k, (flat, ordinal) in enumerate(zip(flats, ordinals)):
            if not isinstance(flat, cupy.ndarray) or flat.ndim != 1 or not is_c_contiguous(flat):
                raise ValueError(f"{api} needs contiguous 1-D CuPy arrays. Received: flats[{k}], a "
                                 f"{type(flat).__name__} of shape {getattr(flat, 'shape', None)}.")
            if flat.data.device_id != ordinal:
                raise ValueError(f"{api} needs each flat array on its device. Received: flats[{k}] on "
                                 f"GPU:{flat.device.id} for device {devices[k]}.")
            if flat.size != first.size or flat.dtype != first.dtype:
                raise ValueError(f"{api} needs the same length and dtype on every device. Received: flats[{k}] "
                                 f"{flat.size} x {flat.dtype} vs flats[0] {first.size} x {first.dtype}.")
        return ordinals

    def _nccl(self) -> int:
        if self._nccl_version is None:
            self._nccl_version = nccl_comms.version()
        return self._nccl_version

    def _group(self, api: str, ordinals: Sequence[int], launch: Callable, timeout: float | None) -> None:
        streams = [self._stream(o) for o in ordinals]
        self._comms.run(api, ordinals, streams, launch, default_timeout() if timeout is None else timeout)

    def _like(self, arrays: Sequence[cupy.ndarray], ordinals: Sequence[int], size: int) -> list[cupy.ndarray]:
        outputs = []
        for array, ordinal in zip(arrays, ordinals):
            with self._on(ordinal):
                outputs.append(cupy.empty(size, array.dtype))
        return outputs

    def _cast(self, arrays: Sequence[cupy.ndarray], ordinals: Sequence[int], dtype: str | None) -> list[cupy.ndarray]:
        if dtype is None:
            return list(arrays)
        cast = []
        for array, ordinal in zip(arrays, ordinals):
            with self._on(ordinal):
                cast.append(array.astype(dtype))
        return cast

    def _sum_on(self, home: int, api: str, flats: Sequence[cupy.ndarray], ordinals: Sequence[int], divisor: int,
                outputs: int) -> list[cupy.ndarray]:
        """`outputs` arrays on GPU `home`, each the in-order sum of `flats` divided by `divisor`: one launch."""
        with self._on(home):
            results = [cupy.empty(flats[0].size, flats[0].dtype) for _ in range(outputs)]
        self._sum_into(home, api, flats, ordinals, divisor, results)
        return results

    def _sum_into(self, home: int, api: str, flats: Sequence[cupy.ndarray], ordinals: Sequence[int], divisor: int,
                  outputs: Sequence[cupy.ndarray]) -> None:
        """Writes the in-order sum of `flats` divided by `divisor` into every one of `outputs` (on GPU `home`)."""
        wire = cuda_dtypes.kernel_wire(dtype_name(flats[0].dtype), api)
        sources = [f if o == home else self._copy_between(f, home) for f, o in zip(flats, ordinals)]
        with self._on(home):
            self._kernels.reduce(wire.dtype, flats[0].size * wire.factor, sources, outputs, divisor)

    def _reduce_by_copies(self, api: str, flats, ordinals: list[int], mean: bool) -> list[cupy.ndarray]:
        """All-reduce when replicas share a GPU: a sum on the first device per replica there; copies elsewhere."""
        home = ordinals[0]
        sums = self._sum_on(home, api, flats, ordinals, len(flats) if mean else 1, ordinals.count(home))
        local = iter(sums)
        return [next(local) if o == home else self._copy_between(sums[0], o) for o in ordinals]
