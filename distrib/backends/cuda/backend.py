"""The CUDA backend: CuPy arrays on GPUs, one stream per device, NCCL collectives issued from one thread."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Callable, Iterator, Sequence

import cupy
import numpy as np

from distrib.backends.base import Backend
from distrib.backends.packed import execute_pack_by_pack
from distrib.backends.cuda import devices as cuda_devices
from distrib.backends.cuda import dtypes as cuda_dtypes
from distrib.backends.cuda import errors as cuda_errors
from distrib.backends.cuda import nccl as nccl_comms
from distrib.backends.cpu import to_numpy
from distrib.backends.cuda.staging import Stager
from distrib.backends.cuda.kernels import UPDATE_DTYPES, UPDATE_SLOTS, Kernels, update_groups
from distrib.plan import Buffer
from distrib.devices import parse_device
from distrib.options import default_timeout

_CUDA_DLPACK_DEVICES = (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


def _on_gpu(value: Any) -> bool:
    """Whether `value` is an array in GPU memory (CuPy, or another library's through its protocols)."""
    if isinstance(value, cupy.ndarray) or hasattr(value, "__cuda_array_interface__"):
        return True
    device = getattr(value, "__dlpack_device__", None)
    return device is not None and device()[0] in _CUDA_DLPACK_DEVICES


def _as_cupy(value: Any) -> cupy.ndarray:
    """A GPU array as a CuPy array over the same memory (no copy)."""
    if isinstance(value, cupy.ndarray):
        return value
    if hasattr(value, "__cuda_array_interface__"):
        return cupy.asarray(value)
    return cupy.from_dlpack(value)


def _upload(host: np.ndarray) -> cupy.ndarray:
    try:
        return cupy.asarray(host)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"CuPy {cupy.__version__} cannot hold dtype {host.dtype} on a GPU. Received: an array of "
                        f"dtype {host.dtype} and shape {host.shape}.") from exc


def _fusable(rule: str, items: Sequence[tuple[Any, Any, tuple]]) -> bool:
    """Whether optimizer.cu has a kernel for every item, each variable is listed once, and each gradient and slot
    has the math dtype and the variable's shape and device (anything else would be read out of bounds)."""
    if rule not in UPDATE_SLOTS or len({id(var) for var, _, _ in items}) < len(items):
        return False
    for var, grad, slots in items:
        math = UPDATE_DTYPES.get(var.dtype.name)
        if (math is None or len(slots) != UPDATE_SLOTS[rule] or not isinstance(grad, cupy.ndarray)
                or grad.device.id != parse_device(var.device).index
                or any(x.dtype != math or x.shape != var.shape for x in (grad, *slots))):
            return False
    return True


class CudaBackend(Backend):
    """CuPy arrays on the GPUs this process sees, named 'GPU:0', 'GPU:1', ... by CUDA ordinal.

    Each device has one stream; it is current in the replica thread of that device (and inside `device_scope`)
    and the backend queues all of that device's work on it. The streams synchronise with the legacy default
    stream, so CuPy work issued outside a device scope is still ordered with them.

    Collectives over distinct GPUs are NCCL group calls issued from the calling thread, which returns as soon as
    they are queued; a watchdog thread follows their completion and, past `timeout` seconds (default
    $DISTRIB_COLLECTIVE_TIMEOUT, else 600) or on an NCCL error, aborts the communicators. The error
    (DeadlineExceededError, CollectiveError) is raised at the next synchronisation point: the next collective,
    `synchronize()` or a copy to the host. Replicas that share a GPU (NCCL refuses two ranks on one device) are
    reduced by copies and the reduce kernel instead. Results are new arrays, one per device; unpacked members are
    views of their flat result, as on the CPU emulator. CuPy's, CUDA's, NVRTC's and NCCL's exceptions leave every
    method as distrib's (backends/cuda_errors.py).

    Example:
      >>> import distrib, cupy
      >>> strategy = distrib.MirroredStrategy(["GPU:0", "GPU:0"])  # two replicas sharing one GPU
      >>> out = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", cupy.ones(3)))
      >>> strategy.reduce("MEAN", out, axis=None)
      array([2., 2., 2.])
    """

    name = "cuda"

    def __init__(self):
        self._gpus = cuda_devices.discover()
        self._ordinals: dict[str, int] = {}
        self._streams: dict[int, cupy.cuda.Stream] = {}
        self._lock = threading.Lock()
        self._kernels = Kernels()
        self._comms = nccl_comms.Communicators()
        self._nccl_version: int | None = None
        self._side_streams: dict[int, cupy.cuda.Stream] = {}  # host-to-device input copies
        self._stager = Stager()  # pinned buffers and threads for input copies

    @property
    def xp(self):
        return cupy

    @property
    def gpus(self) -> tuple[cuda_devices.Gpu, ...]:
        """The GPUs by CUDA ordinal: name, memory, UUID and PCI bus id, as NVML reports them."""
        return self._gpus

    def default_devices(self) -> tuple[str, ...]:
        return tuple(f"GPU:{k}" for k in range(len(self._gpus)))

    def check_device(self, device: str) -> None:
        parsed = parse_device(device)
        if parsed.kind != "GPU":
            raise ValueError(f"The CUDA backend runs on GPU devices such as 'GPU:0'. Received: {device!r}; emulated "
                             f"CPU devices run on the cpu backend.")
        if parsed.index >= len(self._gpus):
            raise ValueError(f"Unknown device {device!r}: this process sees {len(self._gpus)} GPU(s), GPU:0 to "
                             f"GPU:{len(self._gpus) - 1} (CUDA_VISIBLE_DEVICES="
                             f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}).")

    def _ordinal(self, device: str) -> int:
        ordinal = self._ordinals.get(device)
        if ordinal is None:
            self.check_device(device)
            ordinal = self._ordinals[device] = parse_device(device).index
        return ordinal

    def _stream(self, ordinal: int) -> cupy.cuda.Stream:
        stream = self._streams.get(ordinal)
        if stream is None:
            with self._lock:
                if ordinal not in self._streams:
                    with cupy.cuda.Device(ordinal):
                        self._streams[ordinal] = cupy.cuda.Stream()  # blocking: ordered with the legacy stream
                stream = self._streams[ordinal]
        return stream

    @contextlib.contextmanager
    def _on(self, ordinal: int) -> Iterator[None]:
        with cupy.cuda.Device(ordinal), self._stream(ordinal):
            yield

    def activate(self, device: str) -> None:
        ordinal = self._ordinal(device)
        cupy.cuda.Device(ordinal).use()
        self._stream(ordinal).use()

    def device_scope(self, device: str):
        return self._on(self._ordinal(device))

    # -- placement ----------------------------------------------------------------------------------------------

    def to_device(self, value: Any, device: str) -> cupy.ndarray:
        ordinal = self._ordinal(device)
        if not _on_gpu(value):
            with self._on(ordinal):
                return _upload(to_numpy(value))
        array = _as_cupy(value)
        return array if array.device.id == ordinal else self._copy_between(array, ordinal)

    def to_device_all(self, values, device):
        ordinal = self._ordinal(device)
        return [v if type(v) is cupy.ndarray and v.device.id == ordinal else self.to_device(v, device)
                for v in values]

    def prefetch_to_device(self, values, device):
        """Host batches to `device` through pooled pinned memory on a side stream, so the copy overlaps the step.

        The device buffers come from the device's own stream (allocated after the work queued so far, which
        the side stream waits for, so reused pool memory is never overwritten early); the device's stream then
        waits on the copy's event, so kernels that use the batch start only after it has arrived, without the
        host waiting. Staging (backends/cuda/staging.py) fills reused pinned buffers in parallel, chunk by chunk,
        each chunk's copy queued as soon as it is staged; a buffer returns to the pool once its copy has completed.
        """
        ordinal = self._ordinal(device)
        stream, side = self._stream(ordinal), self._side_stream(ordinal)
        out, staged = [], []
        with cupy.cuda.Device(ordinal):
            with stream:
                side.wait_event(stream.record(cupy.cuda.Event(disable_timing=True)))
            for value in values:
                if _on_gpu(value):
                    out.append(self.to_device(value, device))
                    continue
                host = np.ascontiguousarray(to_numpy(value))
                with stream:
                    array = cupy.empty(host.shape, host.dtype)
                if host.nbytes:
                    staged.append(self._stager.upload(host, array, side))
                out.append(array)
            done = side.record(cupy.cuda.Event(disable_timing=True))
            stream.wait_event(done)
        self._stager.pool.release_after(done, staged)
        return out

    def _side_stream(self, ordinal: int) -> cupy.cuda.Stream:
        with self._lock:
            if ordinal not in self._side_streams:
                with cupy.cuda.Device(ordinal):
                    self._side_streams[ordinal] = cupy.cuda.Stream(non_blocking=True)
            return self._side_streams[ordinal]

    def to_host(self, array: Any) -> np.ndarray:
        if not _on_gpu(array):
            return to_numpy(array)
        array = _as_cupy(array)
        with self._on(array.device.id):
            host = array.get()  # waits for the stream, so a collective that failed before it has been seen
        self._comms.check()
        return host

    def empty(self, shape, dtype, device):
        with self._on(self._ordinal(device)):
            return cupy.empty(shape, dtype)

    def copy(self, array, device):
        ordinal = self._ordinal(device)
        if not _on_gpu(array):
            return self.to_device(array, device)  # an upload is a copy
        source = _as_cupy(array)
        if source.device.id != ordinal:
            return self._copy_between(source, ordinal)
        with self._on(ordinal):
            return source.copy()

    def _copy_between(self, array: cupy.ndarray, ordinal: int) -> cupy.ndarray:
        """A copy of `array` (on another GPU) on GPU `ordinal`.

        The copy runs on the source's stream after the destination's stream has released the new buffer's
        memory, and the destination's stream waits for it, so both sides stay ordered.
        """
        source = array.device.id
        source_stream, stream = self._stream(source), self._stream(ordinal)
        with self._on(source):
            array = cupy.ascontiguousarray(array)
        with self._on(ordinal):
            out = cupy.empty(array.shape, array.dtype)
            free = stream.record(cupy.cuda.Event(disable_timing=True))
        with self._on(source):
            source_stream.wait_event(free)
            out.data.copy_from_device_async(array.data, array.nbytes, source_stream)
            done = source_stream.record(cupy.cuda.Event(disable_timing=True))
        stream.wait_event(done)
        return out

    # -- packing ------------------------------------------------------------------------------------------------

    def pack(self, arrays, buffer: Buffer, device):
        ordinal = self._ordinal(device)
        members = self._members("pack", arrays, ordinal)
        with self._on(ordinal):
            if len(members) == 1:
                return members[0].ravel()  # a view when contiguous: nothing to copy
            flat = cupy.empty(buffer.size, members[0].dtype)
            self._kernels.move(flat, [cupy.ascontiguousarray(m) for m in members], pack=True)
        return flat

    def unpack(self, flat, buffer: Buffer):
        """Views of the flat buffer, no copy: a collective's flat result is new and each member owns its slice."""
        return [flat[span] if shape is None else flat[span].reshape(shape) for span, shape in buffer.views]

    @staticmethod
    def _members(api: str, arrays: Sequence[Any], ordinal: int) -> Sequence[cupy.ndarray]:
        for k, array in enumerate(arrays):
            if not isinstance(array, cupy.ndarray) or array.device.id != ordinal:
                where = f"GPU:{array.device.id}" if isinstance(array, cupy.ndarray) else type(array).__name__
                raise ValueError(f"{api} needs CuPy arrays on the pack's device GPU:{ordinal}. Received: arrays[{k}] "
                                 f"on {where}.")
        return arrays

    # -- collectives --------------------------------------------------------------------------------------------

    def execute(self, plan, per_device, devices, *, timeout=None):
        # NATIVE and NCCL plans are the same here: every collective of this backend is NCCL.
        return execute_pack_by_pack(self, plan, per_device, devices, timeout)

    def all_reduce(self, flats, chunks, devices, mean, *, timeout=None):
        ordinals = self._flats_on("all_reduce", flats, devices)
        if len(set(ordinals)) < len(ordinals):
            return self._reduce_by_copies("all_reduce", flats, ordinals, mean)
        plan = cuda_dtypes.nccl_reduction(flats[0].dtype.name, mean, self._nccl(), "all_reduce")
        sources = self._cast(flats, ordinals, plan.cast)
        outputs = self._like(sources, ordinals, sources[0].size)
        calls = cuda_dtypes.chunk_calls(chunks, sources[0].itemsize, plan.factor)

        def launch(rank, comm, stream):
            send, receive = sources[rank].data.ptr, outputs[rank].data.ptr
            for offset, count in calls:
                comm.allReduce(send + offset, receive + offset, count, plan.nccl_type, plan.op, stream)

        if calls:
            self._group("all_reduce", ordinals, launch, timeout)
        if plan.divide:
            wire = cuda_dtypes.kernel_wire(flats[0].dtype.name, "all_reduce")
            for out, ordinal in zip(outputs, ordinals):
                with self._on(ordinal):
                    self._kernels.reduce(wire.dtype, out.size * wire.factor, [out], [out], divisor=len(flats))
        return self._cast(outputs, ordinals, flats[0].dtype.name) if plan.cast else outputs

    def all_gather(self, flats, devices, *, timeout=None):
        ordinals = self._flats_on("all_gather", flats, devices)
        size = flats[0].size * len(flats)
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
        plan = cuda_dtypes.nccl_reduction(flats[0].dtype.name, False, self._nccl(), "reduce_scatter")
        sources = self._cast(flats, ordinals, plan.cast)
        outputs = self._like(sources, ordinals, part)

        def launch(rank, comm, stream):
            comm.reduceScatter(sources[rank].data.ptr, outputs[rank].data.ptr, part * plan.factor, plan.nccl_type,
                               plan.op, stream)

        if part:
            self._group("reduce_scatter", ordinals, launch, timeout)
        return self._cast(outputs, ordinals, flats[0].dtype.name) if plan.cast else outputs

    def broadcast(self, array, devices, *, timeout=None):
        ordinals = [self._ordinal(d) for d in devices]
        if not _on_gpu(array) or _as_cupy(array).device.id not in ordinals:
            array = self.to_device(array, devices[0])
        source = _as_cupy(array)
        if len(set(ordinals)) < len(ordinals):
            return [self.copy(source, d) for d in devices]
        root = ordinals.index(source.device.id)
        with self._on(source.device.id):
            source = cupy.ascontiguousarray(source)
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
        wire = cuda_dtypes.kernel_wire(dtype.name, "add_n")
        with self._on(ordinal):
            sources = [cupy.ascontiguousarray(a.astype(dtype, copy=False)) for a in placed]
            out = cupy.empty(shape, dtype)
            self._kernels.reduce(wire.dtype, out.size * wire.factor, sources, [out])
        return out

    def fused_optimizer_update(self, rule, items, coefficients):
        """optimizer.cu's kernels: one launch per device and parameter dtype, for SGD and Adam over float16
        (float32 slots and math), float32 and float64 variables. Anything else, or a variable listed twice, is
        left to the optimizer's array operations."""
        if not _fusable(rule, items):
            return False
        groups = update_groups([(self._ordinal(var.device), var.dtype.name) for var, _, _ in items])
        for (ordinal, _), positions in groups.items():
            group = [items[k] for k in positions]
            with self._on(ordinal):
                self._kernels.update(rule, [var._writable() for var, _, _ in group],
                                     [cupy.ascontiguousarray(grad) for _, grad, _ in group],
                                     [[slot._writable() for slot in slots] for _, _, slots in group], coefficients)
        return True

    def synchronize(self) -> None:
        self._comms.wait()  # returns (or raises) once the watchdog has seen every collective complete or fail
        for ordinal in list(self._streams):
            cupy.cuda.Device(ordinal).synchronize()
        self._comms.check()

    # -- helpers ------------------------------------------------------------------------------------------------

    def _flats_on(self, api: str, flats: Sequence[Any], devices: Sequence[str]) -> list[int]:
        """The devices' ordinals, once every flats[i] is checked to be a contiguous 1-D array on devices[i]."""
        ordinals = [self._ordinal(d) for d in devices]
        if not flats or len(flats) != len(ordinals):
            raise ValueError(f"{api} needs one flat array per device. Received: {len(flats)} arrays for "
                             f"{len(ordinals)} devices.")
        first = flats[0]
        for k, (flat, ordinal) in enumerate(zip(flats, ordinals)):
            if not isinstance(flat, cupy.ndarray) or flat.ndim != 1 or not flat.flags.c_contiguous:
                raise ValueError(f"{api} needs contiguous 1-D CuPy arrays. Received: flats[{k}], a "
                                 f"{type(flat).__name__} of shape {getattr(flat, 'shape', None)}.")
            if flat.device.id != ordinal:
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
        wire = cuda_dtypes.kernel_wire(flats[0].dtype.name, api)
        sources = [f if o == home else self._copy_between(f, home) for f, o in zip(flats, ordinals)]
        with self._on(home):
            results = [cupy.empty(flats[0].size, flats[0].dtype) for _ in range(outputs)]
            self._kernels.reduce(wire.dtype, flats[0].size * wire.factor, sources, results, divisor)
        return results

    def _reduce_by_copies(self, api: str, flats, ordinals: list[int], mean: bool) -> list[cupy.ndarray]:
        """All-reduce when replicas share a GPU: a sum on the first device per replica there; copies elsewhere."""
        home = ordinals[0]
        sums = self._sum_on(home, api, flats, ordinals, len(flats) if mean else 1, ordinals.count(home))
        local = iter(sums)
        return [next(local) if o == home else self._copy_between(sums[0], o) for o in ordinals]

    def __repr__(self) -> str:
        return f"<CudaBackend devices={self.default_devices()} gpus={[g.name for g in self._gpus]}>"


# Every method of the backend protocol leaves with distrib's errors, never CuPy's, CUDA's, NVRTC's or NCCL's.
PROTOCOL_METHODS = tuple(name for name, member in vars(Backend).items()
                         if not name.startswith("_") and callable(member))
for _name in PROTOCOL_METHODS:
    setattr(CudaBackend, _name, cuda_errors.translating(getattr(CudaBackend, _name)))
