"""The CPU emulator: N virtual devices 'CPU:0'..'CPU:N-1' backed by NumPy, executing the same plans as CUDA."""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import mmap
import operator
import os
import sys
import threading
from typing import Any, Sequence

import numpy as np

from distrib import timeline
from distrib.backends.base import Backend
from distrib.backends.member_copies import MemberCopies
from distrib.backends.packed import execute_pack_by_pack, member_views
from distrib.backends.parallel import MIN_SHARE_BYTES, run_shares, run_split
from distrib.backends.device_memory import device_memory_error, gpu_location
from distrib.backends.torch_tensors import exportable, is_torch_tensor
from distrib.devices import parse_device
from distrib.errors import BackendUnavailableError
from distrib.install_hint import pip_install
from distrib.plan import NATIVE, NCCL, Buffer, dtype_name, integer_mean

DEFAULT_REPLICAS = 2
# Every replica is a thread of this process (in cooperative runs too, which share the merges' work on them): past a
# few thousand, the OS's thread limit or the time to start them is reached long before the emulator helps anyone,
# and a count such as 10**9 would first build a billion device names.
MAX_REPLICAS = 4096
# Copies of members smaller than this on average hold the GIL between members for too long to overlap on threads.
SMALL_COPY_BYTES = MIN_SHARE_BYTES // 4


def _copies_overlap(nbytes: int, members: int) -> bool:
    """Whether copying `members` arrays of `nbytes` in all is worth spreading over threads (see SMALL_COPY_BYTES)."""
    return nbytes >= members * SMALL_COPY_BYTES


def _idle_refcount() -> int:
    """The refcount a pooled buffer has inside `BufferPool.empty`'s scan loop when nobody else holds it."""
    pool = [np.empty(1, np.uint8)]
    for base in pool:
        return sys.getrefcount(base)
    raise AssertionError  # pragma: no cover


def _mapped(nbytes: int) -> np.ndarray:
    """A buffer in an anonymous private mapping of its own: page-aligned, on transparent huge pages where allowed.

    Once glibc has freed one large block it serves later large requests from its heap, unaligned and on 4 KB
    pages; MPI moved 1 to 16 MB into such buffers 1.2 to 1.5 times slower than into fresh mappings.
    """
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mapping, np.uint8)


class BufferPool:
    """Reuses large host buffers across steps without ever handing out memory a caller still references.

    Fresh multi-megabyte allocations page-fault on first touch, which costs more than the sums themselves.
    Arrays handed out are views of a pooled base buffer, and every view (or view of a view) keeps a
    reference to that base, so a base whose refcount is back to the pool's own is provably unused.
    """

    MIN_BYTES = 1 << 16  # below this malloc is cheap and faults nothing new
    MAX_PER_SIZE = 32
    MAX_TOTAL_BYTES = 4 << 30

    _IDLE = _idle_refcount()

    def __init__(self):
        self._bases: dict[int, list[np.ndarray]] = {}
        self._total = 0
        self._lock = threading.Lock()

    def empty(self, shape: Sequence[int], dtype: Any) -> np.ndarray:
        dtype = np.dtype(dtype)
        shape = tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.MIN_BYTES:
            return np.empty(shape, dtype)
        typed = self.take(nbytes).view(dtype)
        return typed if len(shape) == 1 else typed.reshape(shape)  # 1-D: reshaping costs microseconds more right
        # after a transfer has evicted the interpreter's working set from the caches

    def take(self, nbytes: int) -> np.ndarray:
        """`nbytes` bytes (uint8) to view as any dtype: an idle pooled base (a new one if none is idle), or a fresh
        array below MIN_BYTES; the caller's reference (or its view's) keeps it taken."""
        if nbytes < self.MIN_BYTES:
            return np.empty(nbytes, np.uint8)
        with self._lock:
            bases = self._bases.setdefault(nbytes, [])
            for base in bases:
                if sys.getrefcount(base) == self._IDLE:
                    return base
            if len(bases) < self.MAX_PER_SIZE and self._total + nbytes <= self.MAX_TOTAL_BYTES:
                base = _mapped(nbytes)
                bases.append(base)
                self._total += nbytes
                return base
            return np.empty(nbytes, np.uint8)

    def clear(self) -> None:
        with self._lock:
            self._bases.clear()
            self._total = 0


def replicas_from_environment() -> int:
    """$DISTRIB_CPU_REPLICAS (default 2): how many emulated devices a strategy that names none gets.

    Raises:
      ValueError: it is set to anything but an integer from 1 to MAX_REPLICAS.
    """
    raw = os.environ.get("DISTRIB_CPU_REPLICAS", str(DEFAULT_REPLICAS))
    if not raw.strip().isdigit() or not 1 <= int(raw) <= MAX_REPLICAS:
        raise ValueError(f"DISTRIB_CPU_REPLICAS must be a positive integer of at most {MAX_REPLICAS} (each emulated "
                         f"replica is a thread of this process). Received: {raw!r}.")
    return int(raw)


def native_order(dtype: np.dtype) -> np.dtype:
    """`dtype` in this machine's byte order: itself where it is already (results, MPI's datatypes and CuPy all
    take values in native order, as TensorFlow's tensors are)."""
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def to_numpy(value: Any) -> np.ndarray:
    """Any array-like in host memory (NumPy, a NumPy scalar, a Python number, a torch tensor, DLPack) as NumPy.

    Raises:
      TypeError: `value` is an array in GPU memory (a CUDA torch tensor, CuPy, any CUDA DLPack producer): copying
        it to the host at every step would hide that GPU devices were meant; or `value` holds no numbers.
    """
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (np.number, np.bool_, int, float, complex, bool)):
        return np.asarray(value)
    if value is None:  # e.g. the component of a replica that returned None where the others returned arrays
        raise TypeError("Expected an array of numbers. Received: None.")
    if is_torch_tensor(value):
        return _torch_to_numpy(value)
    location = gpu_location(value)
    if location is not None:
        raise device_memory_error(value, location)
    if hasattr(value, "__dlpack__"):
        try:
            return np.from_dlpack(value)
        except (TypeError, RuntimeError, BufferError):
            pass
    try:
        array = np.asarray(value)
    except Exception as exc:
        raise TypeError(f"Expected an array, a NumPy scalar or a Python number. Received: {type(value).__name__}.") \
            from exc
    if array.dtype.kind in "OSU":  # objects, bytes, strings
        raise TypeError(f"Expected an array of numbers. Received: {type(value).__name__} that NumPy holds "
                        f"as dtype={array.dtype}.")
    return array


def _torch_to_numpy(tensor: Any) -> np.ndarray:
    """A PyTorch tensor in host memory as NumPy over the same memory, through DLPack (torch_tensors.exportable)."""
    exported, dtype = exportable(tensor)
    location = gpu_location(tensor)
    if location is not None:
        raise device_memory_error(tensor, location)
    array = np.from_dlpack(exported)
    return array if dtype is None else array.view(dtype)


def _shared(array: np.ndarray, count: int) -> list[np.ndarray]:
    """`count` distinct read-only views of one result, one per emulated device; for one device, the read-only
    result itself (a view costs microseconds right after a large transfer has left the caches cold).

    Emulated devices share host memory, so copying a reduced buffer to each of them would only cost time
    (3 copies of a 4 MB result cost nearly as much as the sums). The views are read-only, as TensorFlow's
    tensors are immutable: writing into one raises instead of silently changing the other replicas' results.
    """
    array.setflags(write=False)  # half the cost of `flags.writeable = False`
    if count == 1:
        return [array]
    return [array.view() for _ in range(count)]


def _sum_shared(flats: Sequence[np.ndarray], out: np.ndarray, divisor: int | None) -> None:
    """out = ((flats[0] + flats[1]) + flats[2]) + ..., divided by `divisor` if given, in shares across threads.

    Every element is summed in device order whichever thread computes it, as TensorFlow's add_n does, so
    results are bit for bit those of one thread.
    """
    def sum_range(lo: int, hi: int) -> None:
        part = out[lo:hi]
        if len(flats) == 1:
            np.copyto(part, flats[0][lo:hi])
        else:
            np.add(flats[0][lo:hi], flats[1][lo:hi], out=part)
            for flat in flats[2:]:
                np.add(part, flat[lo:hi], out=part)
        if divisor is not None:
            np.true_divide(part, divisor, out=part)

    run_shares(out.size, out.itemsize, sum_range)


_NO_SCOPE = contextlib.nullcontext()
_NDARRAY = {np.ndarray}
_DTYPE = operator.attrgetter("dtype")


def all_ndarrays(arrays: Sequence[Any]) -> bool:
    """Whether every one of `arrays` is exactly a NumPy ndarray (one pass in C)."""
    return set(map(type, arrays)) == _NDARRAY


def _one_buffer(first: np.ndarray, others: Sequence[np.ndarray]) -> bool:
    """Whether every array of `others` starts where `first` does (views of one result)."""
    address = first.__array_interface__["data"][0]
    return all(flat.__array_interface__["data"][0] == address for flat in others)


class CpuBackend(Backend):
    """NumPy arrays on N emulated devices. Collectives sum in device order, as TensorFlow's add_n does.

    Results of collectives are read-only views of one buffer shared by the emulated devices; copy one
    (`np.array(x)`) to modify it in place.

    Args:
      num_default_replicas: devices used when a strategy names none (default: $DISTRIB_CPU_REPLICAS, else 2).
    """

    name = "cpu"

    def __init__(self, num_default_replicas: int | None = None):
        if num_default_replicas is None:
            num_default_replicas = replicas_from_environment()
        if not 1 <= num_default_replicas <= MAX_REPLICAS:
            raise ValueError(f"The CPU emulator runs 1 to {MAX_REPLICAS} replicas (each a thread of this process). "
                             f"Received: {num_default_replicas}.")
        self._num_default = num_default_replicas
        self._pool = BufferPool()
        self._member_copies = MemberCopies()

    @property
    def xp(self):
        return np

    def default_devices(self) -> tuple[str, ...]:
        return tuple(f"CPU:{i}" for i in range(self._num_default))

    def check_device(self, device: str) -> None:
        if parse_device(device).kind != "CPU":
            raise ValueError(f"The CPU emulator backend has no device {device!r}: it emulates CPU:0, CPU:1, ... "
                             f"Install distrib[cuda12] on a machine with NVIDIA GPUs to use GPU devices.")

    def activate(self, device: str) -> None:
        pass  # emulated devices have no current-device state

    def device_scope(self, device: str):
        return _NO_SCOPE  # emulated devices have no current-device state: one shared do-nothing block

    def to_device(self, value: Any, device: str) -> np.ndarray:
        return to_numpy(value)

    def to_device_all(self, values, device):
        if set(map(type, values)) == _NDARRAY:  # arrays already (the usual values of a step): nothing to convert
            return list(values)
        return [v if type(v) is np.ndarray else to_numpy(v) for v in values]

    prefetch_to_device = to_device_all  # emulated devices share host memory: nothing to copy ahead

    def placed_check(self, devices):
        return all_ndarrays  # every emulated device holds host memory: any NumPy array is on each already

    def to_host(self, array: Any) -> np.ndarray:
        return to_numpy(array)

    def empty(self, shape, dtype, device):
        return self._pool.empty(shape, dtype)

    def copy(self, array, device):
        out = self._pool.empty(np.shape(array), native_order(np.asarray(array).dtype))
        np.copyto(out, array)
        return out

    def pack(self, arrays, buffer: Buffer, device):
        dtype = np.dtype(buffer.dtype)
        if len(arrays) == 1:
            flat = np.ravel(arrays[0])  # a view when contiguous: nothing to copy
            return flat if flat.dtype == dtype else flat.astype(dtype)
        flat = self._pool.empty((buffer.size,), dtype)
        np.concatenate(arrays, axis=None, out=flat)
        return flat

    def unpack(self, flat, buffer: Buffer):
        """The members of `flat`: a view of it for a pack of one, else copies of their own.

        A view keeps its whole pack alive, and a pooled pack out of the pool: 3,000 kept losses would hold
        3,000 packs. A copy keeps only itself; it comes from the pool when large and stays read-only when the
        pack is, so that results are as immutable as TensorFlow's tensors.
        """
        views = member_views(flat, buffer)
        if len(views) == 1:
            return views  # the member is the whole pack: it keeps only itself alive
        if not _copies_overlap(flat.nbytes, len(views)):
            copies = [view.copy() for view in views]
        else:
            copies = [self._pool.empty(view.shape, view.dtype) for view in views]
            run_split([functools.partial(np.copyto, copy, view) for copy, view in zip(copies, views)], flat.nbytes)
        if not flat.flags.writeable:
            for copy in copies:
                copy.flags.writeable = False
        return copies

    def unpack_all(self, flats, buffer: Buffer):
        """Read-only flats that are one buffer (a collective's result, shared by the emulated devices) are
        unpacked once, into copies reused while nobody holds them (backends/member_copies.py); each device gets
        its own read-only views of those copies."""
        first = flats[0]
        if len(buffer.members) == 1 or first.flags.writeable or not _one_buffer(first, flats[1:]):
            return [self.unpack(flat, buffer) for flat in flats]
        with timeline.span("unpack", "pack"):
            return self._member_copies.unpack(first, buffer, len(flats), run_split,
                                              on_threads=_copies_overlap(first.nbytes, len(buffer.members)))

    def execute(self, plan, per_device, devices, *, timeout=None):
        if plan.method == NCCL:  # as TensorFlow fails at collective time on a machine without GPUs
            raise BackendUnavailableError(
                f"CommunicationImplementation.NCCL needs NCCL between GPUs, but this strategy runs on the CPU "
                f"emulator. Received: devices {list(devices)}. Use implementation AUTO or RING, or GPU devices "
                f"({pip_install('cuda12')} on a machine with NVIDIA GPUs).")
        single = plan.single
        if single is not None and plan.method == NATIVE:
            reduced = self._one_value(single, [values[0] for values in per_device], plan, devices, timeout)
            if reduced is not None:
                return [[value] for value in reduced]
        return execute_pack_by_pack(self, plan, per_device, devices, timeout, self._pack_all)

    def _one_value(self, single: tuple, arrays: list[Any], plan: Any, devices: Sequence[str],
                   timeout: float | None, replicas: int | None = None) -> list[np.ndarray] | None:
        """A plan of one value, whose packing is only views, straight through the all-reduce: each device's
        result (a reduce_to of one value made 101 Python calls through the packing's route, 53 this way). None
        where the arrays are not all NumPy arrays of the plan's dtype (the general route converts them). An
        integer MEAN divides by `replicas` (default: one per array)."""
        dtype, shape, float_mean = single
        first = arrays[0]
        if not all_ndarrays(arrays) or len(set(map(_DTYPE, arrays))) != 1 or dtype_name(first.dtype) != dtype or \
                not first.dtype.isnative:  # byte-swapped: the packed route gives native results, as TensorFlow
            return None
        reduced = self._plan_all_reduce(plan, [array.reshape(-1) for array in arrays], plan.packing.buffers[0].chunks,
                                        devices, float_mean, timeout)
        if plan.mean and not float_mean:  # integer MEAN: the sum, then true division, as TensorFlow does
            reduced = _shared(integer_mean(reduced[0], replicas or len(arrays)), len(devices))
        return reduced if shape is None else [value.reshape(shape) for value in reduced]

    def _pack_all(self, members, buffer, devices):
        """Every device's pack at once, devices spread over the threads the strategy lends (replica r packs
        its own values where there are enough threads)."""
        # One member is a view of it, nothing to copy; small members are packed on the merge thread.
        if len(buffer.members) == 1 or not _copies_overlap(buffer.nbytes, len(buffer.members)):
            return [self.pack(arrays, buffer, device) for arrays, device in zip(members, devices)]
        flats = [self._pool.empty((buffer.size,), buffer.dtype) for _ in devices]

        def job(r):
            return lambda: np.concatenate(members[r], axis=None, out=flats[r])

        run_split([job(r) for r in range(len(devices))], buffer.nbytes * len(devices))
        return flats

    def _plan_all_reduce(self, plan: Any, flats: list[Any], chunks: Sequence[tuple[int, int]], devices: Sequence[str],
                         mean: bool, timeout: float | None) -> list[Any]:
        """`all_reduce` of `plan`'s one value (a backend across processes tells its peers which plan it runs)."""
        return self.all_reduce(flats, chunks, devices, mean, timeout=timeout)

    def all_reduce(self, flats, chunks, devices, mean, *, timeout=None):
        # Chunks only bound the calls of a real collective; every element's sum is the same without them.
        total = self._pool.empty(flats[0].shape, flats[0].dtype)
        _sum_shared(flats, total, len(flats) if mean else None)
        return _shared(total, len(devices))

    def all_gather(self, flats, devices, *, timeout=None):
        gathered = self._pool.empty((sum(f.size for f in flats),), flats[0].dtype)
        starts = list(itertools.accumulate((f.size for f in flats), initial=0))

        def copy_range(lo: int, hi: int) -> None:
            if hi - lo == gathered.size:  # one share (no threads, or a small result): one call for the whole
                np.concatenate(flats, out=gathered)
                return
            for flat, start, stop in zip(flats, starts, starts[1:]):
                if start < hi and stop > lo:
                    gathered[max(lo, start):min(hi, stop)] = flat[max(lo, start) - start:min(hi, stop) - start]

        run_shares(gathered.size, gathered.itemsize, copy_range)
        return _shared(gathered, len(devices))

    def reduce_scatter(self, flats, devices, *, timeout=None):
        n = len(devices)
        if flats[0].size % n:
            raise ValueError(f"reduce_scatter needs a length divisible by {n} devices. Received: {flats[0].size}.")
        part = flats[0].size // n
        if flats[0].nbytes < MIN_SHARE_BYTES:  # small: one sum, then its slices copied out
            total = self.add_n(flats, devices[0])
            return [self.copy(total[i * part:(i + 1) * part], d) for i, d in enumerate(devices)]
        dtype, outs = np.result_type(*flats), []
        for i in range(n):  # each device's slice summed in device order straight into its own result: the copies
            out = self._pool.empty((part,), dtype)  # out of a whole sum took one pass more (1.3-1.5x raw from 2 MiB)
            _sum_shared([flat[i * part:(i + 1) * part] for flat in flats], out, None)
            outs.append(out)
        return outs

    def broadcast(self, array, devices, *, timeout=None):
        return _shared(self.copy(array, devices[0]), len(devices))

    def add_n(self, arrays, device):
        if len(arrays) == 1:
            return self.copy(arrays[0], device)
        out = self._pool.empty(np.shape(arrays[0]), np.result_type(*arrays))
        if out.ndim and all(isinstance(a, np.ndarray) and a.shape == out.shape and a.flags.c_contiguous
                            for a in arrays):  # flat views, summed in shares
            _sum_shared([a.reshape(-1) for a in arrays], out.reshape(-1), None)
            return out
        np.add(arrays[0], arrays[1], out=out)
        for array in arrays[2:]:
            np.add(out, array, out=out)
        return out

    def fused_optimizer_update(self, rule, items, coefficients) -> bool:
        return False  # NumPy has no fused kernels: optimizers apply their reference update

    def synchronize(self) -> None:
        pass  # NumPy work is done when the call returns
