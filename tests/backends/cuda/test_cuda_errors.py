"""The CUDA backend's edge: every exception CuPy, CUDA, NVRTC and NCCL define leaves as one of distrib's."""

from __future__ import annotations

import importlib
import inspect

import pytest

cupy = pytest.importorskip("cupy", reason="CuPy comes with distrib[test]")

from distrib.backends.cuda import errors as cuda_errors  # noqa: E402
from distrib.errors import (CollectiveError, DeviceError, DistribError, KernelCompileError,  # noqa: E402
                            ResourceExhaustedError)

# The modules of CuPy the backend calls into, directly or through CuPy's arrays, kernels and NCCL bindings.
FOREIGN_MODULES = ["cupy.cuda.memory", "cupy.cuda.compiler", "cupy.cuda.nccl", "cupy.cuda.stream",
                   "cupy.cuda.device", "cupy.cuda.pinned_memory", "cupy_backends.cuda.api.runtime",
                   "cupy_backends.cuda.api.driver", "cupy_backends.cuda.libs.nvrtc", "cupy_backends.cuda.libs.nccl"]


def foreign_exception_classes() -> set[type]:
    found = set()
    for name in FOREIGN_MODULES:
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__.startswith("cupy"):
                found.add(obj)
    return found


def test_every_exception_class_of_cupy_cuda_and_nccl_has_a_translation():
    table = cuda_errors.foreign_errors()
    missing = {cls.__qualname__ for cls in foreign_exception_classes()
               if not any(issubclass(cls, known) for known in table)}
    assert not missing, f"untranslated foreign exceptions: {sorted(missing)}"


def test_out_of_memory_is_resource_exhausted_and_still_a_memory_error():
    from cupy.cuda.memory import OutOfMemoryError
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    for exc in (OutOfMemoryError(1 << 30, 1 << 20, 0), CUDARuntimeError(2)):
        error = cuda_errors.translate(exc, "all_reduce")
        assert isinstance(error, ResourceExhaustedError) and isinstance(error, MemoryError)
        assert str(error).startswith("all_reduce ran out of GPU memory")


def test_other_cuda_errors_are_device_errors_with_the_status():
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    error = cuda_errors.translate(CUDARuntimeError(700), "pack")  # cudaErrorIllegalAddress
    assert isinstance(error, DeviceError) and error.status == 700
    assert str(error).startswith("pack failed: CUDA reported cudaErrorIllegalAddress")


def test_nccl_errors_are_collective_errors_naming_the_operation():
    from cupy.cuda import nccl

    error = cuda_errors.translate(nccl.NcclError(2), "broadcast")
    assert isinstance(error, CollectiveError) and error.operation == "broadcast" and error.status == 2


def test_a_kernel_that_does_not_compile_is_a_kernel_compile_error_with_nvrtcs_log():
    from cupy.cuda import nvrtc

    try:
        nvrtc.getVersion()
    except Exception as exc:
        pytest.skip(f"the NVRTC library is not loadable ({exc}); pip install nvidia-cuda-nvrtc-cu12 (in distrib[test])")
    program = nvrtc.createProgram('extern "C" __global__ void k() { undeclared_name; }', "bad.cu", (), ())
    with pytest.raises(Exception) as info:
        nvrtc.compileProgram(program, ("-arch=compute_80",))
    error = cuda_errors.translate(info.value, "reduce")
    assert isinstance(error, KernelCompileError)
    assert str(error).startswith("reduce could not compile its CUDA kernel with NVRTC")


def test_the_wrapper_chains_the_foreign_exception_and_leaves_distribs_own_alone():
    from cupy.cuda import nccl

    @cuda_errors.translating
    def all_gather():
        raise nccl.NcclError(3)

    with pytest.raises(CollectiveError) as info:
        all_gather()
    assert isinstance(info.value.__cause__, nccl.NcclError) and isinstance(info.value, DistribError)

    @cuda_errors.translating
    def check():
        raise ValueError("all_gather needs one flat array per device")

    with pytest.raises(ValueError, match="^all_gather needs"):
        check()


def test_every_method_of_the_backend_protocol_translates_foreign_errors():
    from distrib.backends.cuda import backend as cuda
    from distrib.backends.base import Backend

    public = {name for name, member in vars(Backend).items() if not name.startswith("_") and callable(member)}
    assert public == set(cuda.PROTOCOL_METHODS)
    for name in public:
        assert hasattr(getattr(cuda.CudaBackend, name), "__wrapped__"), f"CudaBackend.{name} is not translated"


def test_the_multi_process_backends_own_methods_translate_foreign_errors_too():
    from distrib.backends.cuda import backend as cuda
    from distrib.backends.cuda.multi_process import MultiProcessCudaBackend

    translation = cuda_errors.translating(lambda: None).__code__
    for cls in (cuda.CudaBackend, MultiProcessCudaBackend):
        for name in cuda.PROTOCOL_METHODS:
            outermost = getattr(cls, name)  # wrappers nest (timeline, translation): the translation must be outside
            assert outermost.__code__ is translation, f"{cls.__name__}.{name} is not translated"


def test_recording_a_timeline_keeps_the_translation_and_stopping_it_puts_every_method_back(tmp_path):
    from distrib import timeline
    from distrib.backends.cuda import backend as cuda
    from distrib.backends.cuda.multi_process import MultiProcessCudaBackend

    classes = (cuda.CudaBackend, MultiProcessCudaBackend)
    before = [{name: vars(cls).get(name) for name in cuda.PROTOCOL_METHODS} for cls in classes]
    timeline.start(str(tmp_path / "trace.json"))
    try:
        for cls in classes:  # timed while recording, each once, around the translation
            timed = cls.all_gather
            assert hasattr(timed, "timed_as") and not hasattr(timed.__wrapped__, "timed_as")
            assert timed.__wrapped__.__code__ is cuda_errors.translating(lambda: None).__code__
    finally:
        timeline.stop()
    assert [{name: vars(cls).get(name) for name in cuda.PROTOCOL_METHODS} for cls in classes] == before
