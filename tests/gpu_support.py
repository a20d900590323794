"""Helpers of the GPU tests: random arrays of every dtype, the CPU emulator's answers, bit-for-bit comparisons."""

from __future__ import annotations

import numpy as np

import distrib
from distrib.backends.cpu import CpuBackend

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
          "uint64", "complex64", "complex128", "bool"]
FLOATS = {"float16", "bfloat16", "float32", "float64", "complex64", "complex128"}


def dtype_of(name: str) -> np.dtype:
    import ml_dtypes  # in distrib[test] and the cuda extras

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def random(rng, size: int, name: str) -> np.ndarray:
    dtype = dtype_of(name)
    if dtype.kind == "b":
        return rng.integers(0, 2, size).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(0, 100, size).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(size) + 1j * rng.standard_normal(size)).astype(dtype)
    return rng.standard_normal(size).astype(dtype)


def host(arrays) -> list[np.ndarray]:
    return [a.get() for a in arrays]


def emulated(method: str, n: int, *args, **kwargs) -> list[np.ndarray]:
    """The CPU emulator's answer for n devices."""
    cpu = CpuBackend()
    return [np.array(a) for a in getattr(cpu, method)(*args, [f"CPU:{i}" for i in range(n)], **kwargs)]


def assert_same(actual: list[np.ndarray], expected: list[np.ndarray], exact: bool) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        if exact:
            np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), e.reshape(-1).view(np.uint8))  # bit for bit
        else:
            np.testing.assert_allclose(a.astype(np.complex128), e.astype(np.complex128), rtol=1e-2, atol=1e-2)


def shared_gpu_and_emulator(replicas: int, **kwargs) -> dict[str, distrib.MirroredStrategy]:
    """One strategy twice: `replicas` replicas sharing GPU:0 ("GPU"), and as many emulated devices ("CPU")."""
    return {"GPU": distrib.MirroredStrategy(["GPU:0"] * replicas, **kwargs),
            "CPU": distrib.MirroredStrategy([f"CPU:{i}" for i in range(replicas)], **kwargs)}
