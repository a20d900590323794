"""CuPy's, CUDA's, NVRTC's and NCCL's exceptions, translated into distrib's at the CUDA backend's edge."""

from __future__ import annotations

import functools
from typing import Any, Callable

from distrib.errors import CollectiveError, DeviceError, KernelCompileError, ResourceExhaustedError
from distrib.install_hint import pip_install

OUT_OF_MEMORY = 2  # cudaErrorMemoryAllocation and CUDA_ERROR_OUT_OF_MEMORY share the code

NCCL_HINT = ("Run with NCCL_DEBUG=WARN for NCCL's own account. A hang between GPUs of one machine is often broken "
             "peer-to-peer transfers: try NCCL_P2P_DISABLE=1, and check that IOMMU and PCI ACS are off.")


def foreign_errors() -> dict[type, Callable[[BaseException, str], Exception]]:
    """Each exception class the CUDA backend can meet, mapped to the function that translates it.

    Subclasses are matched through their base (CuPy's NVCC, HIPCC and Jitify errors are CompileExceptions'
    siblings, listed one by one).
    """
    from cupy.cuda import compiler, memory, nccl
    from cupy_backends.cuda.api.driver import CUDADriverError
    from cupy_backends.cuda.api.runtime import CUDARuntimeError
    from cupy_backends.cuda.libs.nvrtc import NVRTCError

    return {
        memory.OutOfMemoryError: _out_of_memory,
        CUDARuntimeError: _cuda,
        CUDADriverError: _cuda,
        NVRTCError: _compile,
        compiler.CompileException: _compile,
        compiler.NVCCException: _compile,
        compiler.JitifyException: _compile,
        compiler.HIPCCException: _compile,
        nccl.NcclError: _nccl,
    }


def _out_of_memory(exc: BaseException, operation: str) -> Exception:
    return ResourceExhaustedError(
        f"{operation} ran out of GPU memory: {exc}. Free arrays you no longer need (and "
        f"cupy.get_default_memory_pool().free_all_blocks()), use a smaller batch, or spread the work over more GPUs.")


def _cuda(exc: BaseException, operation: str) -> Exception:
    status = getattr(exc, "status", None)
    if status == OUT_OF_MEMORY:
        return _out_of_memory(exc, operation)
    return DeviceError(f"{operation} failed: CUDA reported {exc}. Run with CUDA_LAUNCH_BLOCKING=1 to find the "
                       f"call that caused it.", status=status)


def _compile(exc: BaseException, operation: str) -> Exception:
    log = getattr(exc, "get_message", lambda: str(exc))()
    return KernelCompileError(f"{operation} could not compile its CUDA kernel with NVRTC: {log}. Check that the "
                              f"NVRTC library matches the CUDA driver ({pip_install('cuda12')}, or the cuda13 "
                              f"extra).")


def _nccl(exc: BaseException, operation: str) -> Exception:
    return CollectiveError(f"{operation} failed: NCCL reported {exc}. {NCCL_HINT}", operation=operation,
                           status=getattr(exc, "status", None))


_TABLE: dict[type, Callable[[BaseException, str], Exception]] | None = None


def translate(exc: BaseException, operation: str) -> Exception | None:
    """distrib's error for a foreign `exc` raised during `operation`, or None if `exc` is not a foreign one."""
    global _TABLE
    if _TABLE is None:
        _TABLE = foreign_errors()
    for kind in type(exc).__mro__:
        translator = _TABLE.get(kind)
        if translator is not None:
            return translator(exc, operation)
    return None


def translating(method: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a backend method so that foreign exceptions leave it as distrib's, chained with `raise ... from`."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except Exception as exc:
            error = translate(exc, method.__name__)
            if error is None:
                raise
            raise error from exc

    return wrapper
