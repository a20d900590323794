"""The CUDA backend: CuPy arrays on GPUs, one stream per device, NCCL collectives issued from one thread."""

from __future__ import annotations

import os
import threading
from typing import Any, Sequence

import cupy
import numpy as np

from distrib import timeline
from distrib.backends.base import Backend
from distrib.backends.cuda import devices as cuda_devices
from distrib.backends.cuda import errors as cuda_errors
from distrib.backends.cuda import nccl as nccl_comms
from distrib.backends.cuda.arrays import (aligned, all_contiguous, all_on, as_cupy, contiguous, device_id, empty_for,
                                         in_native_order, on_gpu, upload)
from distrib.backends.cuda.collectives import NcclCollectives
from distrib.backends.cuda.results import Outputs
from distrib.backends.cpu import to_numpy
from distrib.backends.cuda.staging import Stager
from distrib.backends.cuda.watchdog import wait_for
from distrib.backends.cuda.kernels import UPDATE_DTYPES, UPDATE_SLOTS, Kernels, update_groups
from distrib.plan import Buffer, dtype_name
from distrib.devices import parse_device

def _fusable(rule: str, items: Sequence[tuple[Any, Any, tuple]]) -> bool:
    """Whether optimizer.cu has a kernel for every item, each variable is listed once, and each gradient and slot
    has the math dtype and the variable's shape and device (anything else would be read out of bounds)."""
    if rule not in UPDATE_SLOTS or len({id(var) for var, _, _ in items}) < len(items):
        return False
    for var, grad, slots in items:
        math = UPDATE_DTYPES.get(dtype_name(var.dtype))
        if (math is None or len(slots) != UPDATE_SLOTS[rule] or not isinstance(grad, cupy.ndarray)
                or grad.data.device_id != parse_device(var.device).index
                or any(x.dtype != math or x.shape != var.shape for x in (grad, *slots))):
            return False
    return True


class _OnDevice:
    """A device and its stream made current for a `with` block: a class, as it runs for each array and launch (a
    generator-based context manager cost several microseconds more per use)."""

    __slots__ = ("_device", "_stream")

    def __init__(self, ordinal: int, stream: cupy.cuda.Stream):
        self._device, self._stream = cupy.cuda.Device(ordinal), stream

    def __enter__(self) -> None:
        self._device.__enter__()
        try:
            self._stream.__enter__()
        except BaseException:
            self._device.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self._stream.__exit__(*exc)
        finally:
            self._device.__exit__(*exc)


class CudaBackend(NcclCollectives, Backend):
    """CuPy arrays on the GPUs this process sees, named 'GPU:0', 'GPU:1', ... by CUDA ordinal.

    Each device has one stream; it is current in the replica thread of that device (and inside `device_scope`)
    and the backend queues all of that device's work on it. The streams synchronise with the legacy default
    stream, so CuPy work issued outside a device scope is still ordered with them.

    Collectives over distinct GPUs are NCCL group calls issued from the calling thread, which returns as soon as
    they are queued; a watchdog thread follows their completion and, past `timeout` seconds (default
    $DISTRIB_COLLECTIVE_TIMEOUT, else 600) or on an NCCL error, aborts the communicators. The error
    (DeadlineExceededError, CollectiveError) is raised at the next synchronisation point: the next collective,
    `synchronize()` or a copy to the host. Replicas that share a GPU (NCCL refuses two ranks on one device) are
    reduced by copies and the reduce kernel instead. Results are arrays of their own, one per device: the member
    of a pack of one is a view of its flat result, the members of a pack of several are copied out of it by one
    unpack kernel (a kept result keeps only itself alive, as on the CPU emulator), and a plan executed again
    reuses the flats and arrays of its last run that nothing holds any more (backends/cuda/results.py). CuPy's,
    CUDA's, NVRTC's and NCCL's exceptions leave every method as distrib's (backends/cuda/errors.py).

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
        self._outputs = Outputs()  # all-reduce output flats and their members, reused across steps
        if cupy.cuda.nvtx.available:  # timeline spans become NVTX ranges, so Nsight shows the same names
            timeline.use_nvtx(cupy.cuda.nvtx.RangePush, cupy.cuda.nvtx.RangePop)

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

    def _on(self, ordinal: int) -> "_OnDevice":
        """`with`: GPU `ordinal` and its stream current, the previous ones restored after."""
        return _OnDevice(ordinal, self._stream(ordinal))

    def activate(self, device: str) -> None:
        ordinal = self._ordinal(device)
        cupy.cuda.Device(ordinal).use()
        self._stream(ordinal).use()

    def device_scope(self, device: str):
        return self._on(self._ordinal(device))

    # -- placement ----------------------------------------------------------------------------------------------

    def to_device(self, value: Any, device: str) -> cupy.ndarray:
        ordinal = self._ordinal(device)
        if not on_gpu(value):
            with self._on(ordinal):
                return upload(to_numpy(value))
        array = as_cupy(value)
        return array if array.data.device_id == ordinal else self._copy_between(array, ordinal)

    def to_device_all(self, values, device):
        # data.device_id throughout: `device` makes a Device object each time, 800 per step for 4 x 200 values
        ordinal = self._ordinal(device)
        return [v if type(v) is cupy.ndarray and v.data.device_id == ordinal else self.to_device(v, device)
                for v in values]

    def placed_check(self, devices):
        ordinals, native = [self._ordinal(d) for d in devices], {cupy.ndarray}
        groups = len(ordinals)
        return lambda arrays: set(map(type, arrays)) == native and \
            list(map(device_id, arrays)) == ordinals * (len(arrays) // groups)  # a partial group: lengths differ

    def prefetch_to_device(self, values, device):
        """Host batches to `device` through pooled pinned memory on a side stream, so the copy overlaps the step.

        The device buffers are allocated on the device's own stream first, and only then does the side stream wait
        for the work queued on it so far: pool memory handed out again was last used by kernels queued before the
        allocation, so the copy never overwrites what they still read, also while other threads (replicas, the
        input pipeline) queue kernels and free arrays meanwhile. The device's stream then waits on the copy's event,
        so kernels that use the batch start only after it has arrived, without the host waiting. Staging
        (backends/cuda/staging.py) fills reused pinned buffers in parallel, chunk by chunk, each chunk's copy queued
        as soon as it is staged; a buffer returns to the pool once its copy has completed.
        """
        ordinal = self._ordinal(device)
        stream, side = self._stream(ordinal), self._side_stream(ordinal)
        out: list[Any] = []
        uploads: list[tuple[np.ndarray, cupy.ndarray]] = []
        with cupy.cuda.Device(ordinal):
            for value in values:
                if on_gpu(value):
                    out.append(self.to_device(value, device))
                    continue
                host = in_native_order(to_numpy(value))  # the copy below moves bytes: native ones
                if not host.flags.c_contiguous:  # np.ascontiguousarray alone would make a 0-d array 1-d
                    host = np.ascontiguousarray(host)
                with stream:
                    array = empty_for(host)  # a dtype CuPy cannot hold: upload()'s TypeError, before any copy
                if host.nbytes:
                    uploads.append((host, array))
                out.append(array)
            if not uploads:
                return out
            with stream:  # after the allocations above: see the docstring
                side.wait_event(stream.record(cupy.cuda.Event(disable_timing=True)))
            staged = []
            try:
                for host, array in uploads:
                    staged.append(self._stager.upload(host, array, side))
            finally:  # also when a value fails part-way: the copies already queued still read their pinned
                # buffers and write device memory that `stream` may hand out again once the arrays are dropped
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

    def as_array(self, value: Any) -> Any:
        return as_cupy(value) if on_gpu(value) else to_numpy(value)  # a CUDA torch tensor stays on its GPU

    def to_host(self, array: Any) -> np.ndarray:
        if not on_gpu(array):
            return to_numpy(array)
        array = as_cupy(array)
        with self._on(array.device.id):
            wait_for([cupy.cuda.get_current_stream()])  # polled: get()'s own wait then returns at once
            host = array.get()  # every collective queued on the stream before has completed or failed
        self._comms.settle()  # so its failure is raised here, even while the watchdog is still aborting it
        return host

    def empty(self, shape, dtype, device):
        with self._on(self._ordinal(device)):
            return cupy.empty(shape, dtype)

    def copy(self, array, device):
        ordinal = self._ordinal(device)
        if not on_gpu(array):
            return self.to_device(array, device)  # an upload is a copy
        source = as_cupy(array)
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
            array = contiguous(array)
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
            if len(members) == 1:  # a view when contiguous and aligned: nothing to copy
                return aligned(members[0].ravel())  # the reduce kernel reads it (a fresh flat always is aligned)
            flat = cupy.empty(buffer.size, members[0].dtype)
            self._kernels.move(flat, all_contiguous(members), pack=True)
        return flat

    def unpack(self, flat, buffer: Buffer):
        """The member of a pack of one is a view of the flat; the members of a pack of several are arrays of their
        own filled by one unpack kernel, so that a kept member does not keep the whole pack allocated. For an
        output of `execute`, the arrays of last step that nothing holds (backends/cuda/results.py)."""
        with self._on(flat.data.device_id):
            if len(buffer.members) == 1:
                return self._outputs.members(flat, buffer, cupy.empty)
            members, launch = self._outputs.unpacking(
                flat, buffer, cupy.empty, lambda arrays: self._kernels.prepare_move(flat, arrays, pack=False))
            if launch is not None:
                launch()
        return members

    @staticmethod
    def _members(api: str, arrays: Sequence[Any], ordinal: int) -> Sequence[cupy.ndarray]:
        if all_on(arrays, ordinal):
            return arrays
        for k, array in enumerate(arrays):
            if not isinstance(array, cupy.ndarray) or array.data.device_id != ordinal:
                where = f"GPU:{array.device.id}" if isinstance(array, cupy.ndarray) else type(array).__name__
                raise ValueError(f"{api} needs CuPy arrays on the pack's device GPU:{ordinal}. Received: arrays[{k}] "
                                 f"on {where}.")
        return arrays

    def fused_optimizer_update(self, rule, items, coefficients):
        """optimizer.cu's kernels: one launch per device and parameter dtype, for SGD and Adam over float16
        (float32 slots and math), float32 and float64 variables. Anything else, or a variable listed twice, is
        left to the optimizer's array operations."""
        if not _fusable(rule, items):
            return False
        groups = update_groups([(self._ordinal(var.device), dtype_name(var.dtype)) for var, _, _ in items])
        for (ordinal, _), positions in groups.items():
            group = [items[k] for k in positions]
            with self._on(ordinal):
                self._kernels.update(rule, [var._writable() for var, _, _ in group],
                                     [contiguous(grad) for _, grad, _ in group],
                                     [[slot._writable() for slot in slots] for _, _, slots in group], coefficients)
        return True

    def synchronize(self) -> None:
        """Waits for everything queued on the backend's streams and on CuPy's legacy default stream of each of its
        GPUs (which follows every blocking stream: torch's and CuPy's default ones), by polling events."""
        self._comms.wait()  # returns (or raises) once the watchdog has seen every collective complete or fail
        events = []
        for ordinal in list(self._streams):
            with cupy.cuda.Device(ordinal):
                for stream in (self._streams[ordinal], self._side_streams.get(ordinal), cupy.cuda.Stream.null):
                    if stream is not None:
                        events.append(stream.record(cupy.cuda.Event(disable_timing=True)))
        wait_for(events)
        self._comms.check()

    def __repr__(self) -> str:
        return f"<CudaBackend devices={self.default_devices()} gpus={[g.name for g in self._gpus]}>"


# Every method of the backend protocol leaves with distrib's errors, never CuPy's, CUDA's, NVRTC's or NCCL's.
PROTOCOL_METHODS = tuple(name for name, member in vars(Backend).items()
                         if not name.startswith("_") and callable(member))
for _name in PROTOCOL_METHODS:
    setattr(CudaBackend, _name, cuda_errors.translating(getattr(CudaBackend, _name)))
