"""Which values are GPU arrays, and how they become CuPy arrays: views of other libraries' memory, or uploads."""

from __future__ import annotations

import operator
from typing import Any, Sequence

import cupy
import numpy as np

from distrib.backends.cpu import native_order
from distrib.backends.torch_tensors import exportable, is_torch_tensor, torch_device

_CUDA_DLPACK_DEVICES = (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


def on_gpu(value: Any) -> bool:
    """Whether `value` is an array in GPU memory (CuPy, or another library's through its protocols)."""
    if is_torch_tensor(value):  # before the protocols: a tensor that requires grad raises from both
        return torch_device(value) == "cuda"
    if isinstance(value, cupy.ndarray) or hasattr(value, "__cuda_array_interface__"):
        return True
    device = getattr(value, "__dlpack_device__", None)
    return device is not None and device()[0] in _CUDA_DLPACK_DEVICES


def as_cupy(value: Any) -> cupy.ndarray:
    """A GPU array as a CuPy array over the same memory (no copy)."""
    if isinstance(value, cupy.ndarray):
        return value
    if is_torch_tensor(value):
        return _torch_as_cupy(value)
    if hasattr(value, "__cuda_array_interface__"):
        return cupy.asarray(value)
    return cupy.from_dlpack(value)


def _torch_as_cupy(tensor: Any) -> cupy.ndarray:
    """A CUDA torch tensor as CuPy over the same memory, through DLPack (torch_tensors.exportable).

    DLPack rather than `__cuda_array_interface__`: the import hands torch CuPy's current stream on the tensor's
    device, and torch makes that stream wait for the work queued on the tensor, so no synchronisation is lost.
    """
    exported, dtype = exportable(tensor)
    with cupy.cuda.Device(tensor.device.index):
        array = cupy.from_dlpack(exported)
    return array if dtype is None else array.view(dtype)


def in_native_order(host: np.ndarray) -> np.ndarray:
    """`host` with its values in this machine's byte order (a copy only where they are not): CuPy copies a
    byte-swapped array's bytes as if they were native (cupy/cupy#9014), so a `>f4` batch arrived as garbage."""
    native = native_order(host.dtype)
    return host if native is host.dtype else host.astype(native)


def upload(host: np.ndarray) -> cupy.ndarray:
    """A host array copied to the current device; a dtype CuPy cannot hold is a TypeError naming it."""
    try:
        return cupy.asarray(in_native_order(host))
    except (TypeError, ValueError) as exc:
        raise unsupported_dtype(host) from exc


def empty_for(host: np.ndarray) -> cupy.ndarray:
    """An uninitialised array of `host`'s shape and dtype on the current device and stream, for a copy of it; a dtype
    CuPy cannot hold is upload()'s TypeError (CuPy's own is a ValueError, "Unsupported dtype <U12")."""
    try:
        return cupy.empty(host.shape, host.dtype)
    except (TypeError, ValueError) as exc:
        raise unsupported_dtype(host) from exc


def unsupported_dtype(host: np.ndarray) -> TypeError:
    """The error for a host array whose dtype CuPy cannot hold on a GPU (strings, objects, datetimes)."""
    return TypeError(f"CuPy {cupy.__version__} cannot hold dtype {host.dtype} on a GPU. Received: an array of "
                     f"dtype {host.dtype} and shape {host.shape}.")


# Whether a CuPy array is C-contiguous: its own attribute (since CuPy 7) is read in C, while `.flags` builds an
# object per call, which packing 1,000 members pays 1,000 times per step.
is_c_contiguous = operator.attrgetter("_c_contiguous") if hasattr(cupy.ndarray, "_c_contiguous") else \
    (lambda array: array.flags.c_contiguous)
device_id = operator.attrgetter("data.device_id")  # the GPU of a CuPy array, without making a Device object


def contiguous(array: cupy.ndarray) -> cupy.ndarray:
    """`array` if C-contiguous, else a C-contiguous copy, in its own shape: `cupy.ascontiguousarray` (as NumPy's)
    makes a 0-d array 1-d, which a count or a loss reduced across replicas must not become."""
    return array if is_c_contiguous(array) else cupy.ascontiguousarray(array)


def all_contiguous(arrays: Sequence[cupy.ndarray]) -> Sequence[cupy.ndarray]:
    """`arrays` if every one is C-contiguous (one C-level pass), else a list with each made contiguous."""
    return arrays if all(map(is_c_contiguous, arrays)) else [contiguous(a) for a in arrays]


def all_on(arrays: Sequence[Any], ordinal: int) -> bool:
    """Whether every one of `arrays` is a CuPy array on GPU `ordinal` (a pass in C for the usual case)."""
    return all(issubclass(kind, cupy.ndarray) for kind in set(map(type, arrays))) and \
        set(map(device_id, arrays)) == {ordinal}


def aligned(array: cupy.ndarray) -> cupy.ndarray:
    """Contiguous `array`, or a copy of it on the current stream if its address is not a multiple of its itemsize.

    CUDA reads an element of N bytes from an address that is a multiple of N, and a misaligned read is a sticky
    error that ends the process's CUDA context. CuPy's allocations are aligned, but `.view()` can misalign (a
    complex64 view of float32 memory at an odd offset): such an array is copied by memcpy, byte for byte (a typed
    copy kernel would fault on it too).
    """
    if array.data.ptr % array.dtype.itemsize == 0:
        return array
    copy = cupy.empty(array.shape, array.dtype)
    copy.data.copy_from_device_async(array.data, array.nbytes)
    return copy
