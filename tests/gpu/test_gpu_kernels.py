"""Every kernel of kernels/*.cu against NumPy on random data (also run under compute-sanitizer)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from distrib.backends.cuda.dtypes import KERNEL_WIRES
from distrib.backends.cuda.kernels import WORD_SIZES, Kernels

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")
import ml_dtypes  # noqa: E402  (in distrib[test] and the cuda extras: a GPU run must not skip it)

KERNELS = Kernels()
DTYPES = [np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name) for name in KERNEL_WIRES]


def random(rng, shape, dtype):
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return (rng.standard_normal(shape) * 100).astype(dtype)


def host(array) -> np.ndarray:
    return array.get()


@pytest.mark.parametrize("width", WORD_SIZES)
@pytest.mark.parametrize("sizes", [[1], [5, 0, 3], [1000, 1, 257, 4096], [3] * 300, [1 << 20, 17]])
def test_pack_and_unpack_move_every_member_in_order(width, sizes):
    rng = np.random.default_rng(sum(sizes) + width)
    dtype = {1: np.uint8, 2: np.uint16, 4: np.float32, 8: np.int64, 16: np.complex128}[width]
    members = [cupy.asarray(random(rng, (n,), dtype)) for n in sizes]
    flat = cupy.empty(sum(sizes), dtype)
    KERNELS.move(flat, members, pack=True)
    expected = np.concatenate([host(m) for m in members])
    np.testing.assert_array_equal(host(flat), expected)
    outs = [cupy.full(n, 7, dtype) for n in sizes]
    KERNELS.move(flat, outs, pack=False)
    for out, member in zip(outs, members):
        np.testing.assert_array_equal(host(out), host(member))


def test_misaligned_members_move_in_narrower_words():
    rng = np.random.default_rng(0)
    base = cupy.asarray(random(rng, (4099,), np.uint8))
    members = [base[1:1000], base[1001:3001], base[3003:4099]]  # odd offsets: byte words
    flat = cupy.empty(sum(m.size for m in members), np.uint8)
    KERNELS.move(flat, members, pack=True)
    np.testing.assert_array_equal(host(flat), np.concatenate([host(m) for m in members]))


def in_order_sum(arrays: list[np.ndarray], divisor: int) -> np.ndarray:
    """The CPU emulator's arithmetic: adds in list order in the dtype, then a true division for floats."""
    total = arrays[0].copy()
    for array in arrays[1:]:
        np.add(total, array, out=total)
    if divisor != 1:
        np.true_divide(total, divisor, out=total)
    return total


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
@pytest.mark.parametrize("n_src, n_out, size", [(1, 1, 1), (2, 1, 1000), (4, 3, 4097), (3, 2, 1 << 20)])
def test_reduce_sums_in_order_like_numpy(dtype, n_src, n_out, size):
    rng = np.random.default_rng(n_src * 7 + n_out)
    inputs = [random(rng, (size,), dtype) for _ in range(n_src)]
    sources = [cupy.asarray(a) for a in inputs]
    outputs = [cupy.empty(size, dtype) for _ in range(n_out)]
    wire = KERNEL_WIRES[dtype.name]
    divisor = n_src if dtype.kind in "fcV" or dtype.name == "bfloat16" else 1
    KERNELS.reduce(wire.dtype, size * wire.factor, sources, outputs, divisor)
    expected = in_order_sum(inputs, divisor)
    for out in outputs:
        np.testing.assert_array_equal(host(out).view(np.uint8), expected.view(np.uint8))  # bit for bit


@pytest.mark.parametrize("name", ["float32", "bfloat16", "complex64"])
def test_reduce_keeps_subnormals_as_numpy_does(name):
    # CuPy compiles kernels with -ftz=true; an operation that obeyed it would flush these to zero
    tiny = np.array([1e-40, -2.5e-39, 3e-40, 7e-39, 1e-38], np.float32)  # all subnormal
    dtype = DTYPES[[d.name for d in DTYPES].index(name)]
    inputs = [(tiny + 1j * tiny[::-1] if dtype.kind == "c" else tiny).astype(dtype), tiny[::-1].astype(dtype)]
    expected = in_order_sum(inputs, 3)
    assert np.all(expected != 0)
    out = cupy.empty(tiny.size, dtype)
    wire = KERNEL_WIRES[name]
    KERNELS.reduce(wire.dtype, tiny.size * wire.factor, [cupy.asarray(a) for a in inputs], [out], divisor=3)
    np.testing.assert_array_equal(host(out).view(np.uint8), expected.view(np.uint8))  # bit for bit


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.complex64])
def test_reduce_scales_in_place(dtype):
    rng = np.random.default_rng(1)
    data = random(rng, (5000,), dtype)
    array = cupy.asarray(data)
    wire = KERNEL_WIRES[np.dtype(dtype).name]
    KERNELS.reduce(wire.dtype, array.size * wire.factor, [array], [array], divisor=3)
    np.testing.assert_array_equal(host(array), data / np.asarray(3, dtype))


@pytest.mark.timeout(1800)
@pytest.mark.skipif(os.environ.get("DISTRIB_UNDER_SANITIZER") == "1", reason="already running under compute-sanitizer")
@pytest.mark.parametrize("tool", ["memcheck", "initcheck", "racecheck"])
def test_compute_sanitizer_finds_nothing_in_the_kernels(tool):
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not on PATH (it comes with the CUDA toolkit)")
    result = subprocess.run(
        [sanitizer, f"--tool={tool}", "--error-exitcode=99", sys.executable, "-m", "pytest", "-q", "-x", "-p",
         "no:cacheprovider", "-m", "gpu", "-k", "not sanitizer and not 1048576 and not sizes4", __file__,
         str(pathlib.Path(__file__).with_name("test_gpu_optimizers.py"))],  # optimizer.cu's kernels are tested there
        capture_output=True, text=True, timeout=1800, env={**os.environ, "DISTRIB_UNDER_SANITIZER": "1"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in result.stdout + result.stderr


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_a_complex_view_off_its_pair_alignment_is_refused_before_launch(dtype):
    parts = cupy.zeros(9, np.float32 if dtype == "complex64" else np.float64)
    odd = parts[1:].view(dtype)  # starts on the second part: a misaligned pair for reduce.cu
    with pytest.raises(ValueError, match=f"reduce_{dtype} reads \\(real, imaginary\\) pairs aligned"):
        KERNELS.reduce(dtype, odd.size, [odd], [odd])


def test_a_misaligned_view_copied_by_aligned_reduces_and_the_gpu_stays_usable():
    from distrib.backends.cuda.arrays import aligned

    view = cupy.asarray(np.arange(9, dtype=np.float32))[1:].view(np.complex64)  # 4 bytes off its pairs' alignment
    assert view.data.ptr % 8 == 4
    copy = aligned(view)  # by memcpy, byte for byte: a typed copy kernel would fault on the view too
    assert copy.data.ptr % 8 == 0 and aligned(copy) is copy
    out = cupy.empty(4, np.complex64)
    KERNELS.reduce("complex64", 4, [copy, copy], [out])
    np.testing.assert_array_equal(out.get(), 2 * np.arange(1, 9, dtype=np.float32).view(np.complex64))
