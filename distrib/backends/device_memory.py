"""Which arrays lie in GPU memory, told from their protocols without importing their library or waking a driver."""

from __future__ import annotations

from typing import Any

from distrib.backends.torch_tensors import is_torch_tensor

# DLPack device types whose memory the host cannot read in place: kDLCUDA, kDLROCM
_GPU_DLPACK_DEVICES = {2: "cuda", 10: "rocm"}


def gpu_location(value: Any) -> str | None:
    """Where `value` lies if it is an array in GPU memory ('cuda:0', or 'a CUDA device' where it does not say
    which); None for host memory and for values that are not arrays.

    GPU arrays are torch tensors off the CPU, objects whose type has `__cuda_array_interface__` (CuPy, Numba),
    and DLPack producers on a CUDA or ROCm device. The type is asked, not the array: CuPy computes the
    interface on each read, syncing with its stream, and fails where no driver is loaded.

    Example:
      >>> import numpy as np
      >>> gpu_location(np.ones(3)) is None
      True
    """
    if is_torch_tensor(value):
        device = value.device
        return None if device.type == "cpu" else str(device)
    kind, index = _dlpack_device(value)
    if kind in _GPU_DLPACK_DEVICES:
        return f"{_GPU_DLPACK_DEVICES[kind]}:{index}"
    if hasattr(type(value), "__cuda_array_interface__"):
        return f"cuda:{index}" if kind is not None else "a CUDA device"
    return None


def _dlpack_device(value: Any) -> tuple[int | None, int | None]:
    """`value.__dlpack_device__()` as plain ints; (None, None) where it has none or cannot say."""
    method = getattr(value, "__dlpack_device__", None)
    if method is None:
        return None, None
    try:
        kind, index = method()
    except Exception:  # noqa: BLE001 - CuPy without a driver raises its runtime's error: the type still tells
        return None, None
    return int(kind), int(index)


def device_memory_error(value: Any, location: str) -> TypeError:
    """The TypeError for a GPU array given to the CPU emulator: how to copy it to the host, or to use GPU devices."""
    library = type(value).__module__.split(".")[0]
    copy = "tensor.cpu()" if is_torch_tensor(value) else "array.get()" if callable(getattr(value, "get", None)) \
        else "a copy in host memory"
    return TypeError(f"The CPU emulator reads arrays in host memory; it does not copy device memory to the host at "
                     f"every step. Received: a {library}.{type(value).__qualname__} on {location}; pass {copy}, or "
                     f"name GPU devices (distrib[cuda12], on a machine with NVIDIA GPUs) to use it where it lies.")
