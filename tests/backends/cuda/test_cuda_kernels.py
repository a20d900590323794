"""kernels/*.cu without a GPU: they compile with NVRTC, ship in the wheel, and their launch tables and member search hold."""

from __future__ import annotations

import functools
import pathlib
import re
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from distrib import optimizers
from distrib.backends.cuda import dtypes as cuda_dtypes, kernels as cuda_kernels
from support import copy_source_tree

cupy = pytest.importorskip("cupy", reason="CuPy comes with distrib[test]")
cuda = pytest.importorskip("distrib.backends.cuda.backend")

KERNEL_FILES = sorted(cuda_kernels.SOURCES.glob("*.cu"))
# cupy.cuda.compiler appends these to every RawModule's options, after the loader's, so they win
CUPY_APPENDS = ("-ftz=true",)


# -- kernels ----------------------------------------------------------------------------------------------------------


def nvrtc_or_skip():
    from cupy.cuda import nvrtc

    try:
        nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001 - any failure to load the library means: no NVRTC here
        pytest.skip(f"the NVRTC library is not loadable ({exc}); pip install nvidia-cuda-nvrtc-cu12 (in distrib[test])")
    return nvrtc


@functools.cache
def compile_to_ptx(path: pathlib.Path, arch: str) -> str:
    """PTX for `arch` from NVRTC alone (no GPU, no driver), with the options CuPy compiles the kernels with."""
    nvrtc = nvrtc_or_skip()
    program = nvrtc.createProgram(cuda_kernels.source(path.name), path.name, (), ())
    try:
        try:
            nvrtc.compileProgram(program, (f"-arch={arch}", *cuda_kernels.OPTIONS, *CUPY_APPENDS))
        except nvrtc.NVRTCError as exc:
            pytest.fail(f"{path.name} does not compile for {arch}: {exc}\n{nvrtc.getProgramLog(program)}")
        return nvrtc.getPTX(program).decode()
    finally:
        nvrtc.destroyProgram(program)


def entry_points(source: str) -> set[str]:
    """The kernels a source defines through its DISTRIB_*_KERNEL(S) macros."""
    moves = re.findall(r"^DISTRIB_MOVE_KERNELS\([^,]+, (\w+)\)", source, re.M)
    reduces = re.findall(r"^DISTRIB_REDUCE_KERNEL\((\w+),", source, re.M)
    updates = re.findall(r"^DISTRIB_OPTIMIZER_KERNELS\([^,]+, (\w+),", source, re.M)
    return ({f"{kind}_{w}" for w in moves for kind in ("pack", "unpack")} | {f"reduce_{t}" for t in reduces}
            | {cuda_kernels.update_kernel(rule, d) for d in updates for rule in cuda_kernels.UPDATE_SLOTS})


def test_there_are_kernel_sources():
    assert [p.name for p in KERNEL_FILES] == ["optimizer.cu", "pack.cu", "reduce.cu"]


@pytest.mark.parametrize("arch", ["compute_75", "compute_90"])
@pytest.mark.parametrize("path", KERNEL_FILES, ids=[p.name for p in KERNEL_FILES])
def test_every_kernel_source_compiles_to_ptx_with_nvrtc(path, arch):
    ptx = compile_to_ptx(path, arch)
    entries = set(re.findall(r"\.visible \.entry (\w+)\(", ptx))
    assert entries == entry_points(path.read_text())


def test_the_move_kernels_cover_every_word_size():
    assert entry_points(cuda_kernels.source("pack.cu")) == {
        f"{kind}_w{w}" for kind in ("pack", "unpack") for w in cuda_kernels.WORD_SIZES}


@pytest.mark.parametrize("arch", ["compute_75", "compute_90"])
def test_the_widest_move_kernels_copy_each_word_with_one_128_bit_load_and_store(arch):
    ptx = compile_to_ptx(cuda_kernels.SOURCES / "pack.cu", arch)
    for kernel in ("pack_w16", "unpack_w16"):
        body = ptx.split(f".entry {kernel}(")[1].split(".entry")[0]
        assert re.search(r"ld\.global\.v(2\.u64|4\.u32)", body), f"{kernel} loads 16-byte words in pieces"
        assert re.search(r"st\.global\.v(2\.u64|4\.u32)", body), f"{kernel} stores 16-byte words in pieces"


def test_the_reduce_kernels_are_exactly_the_kernel_wire_types():
    kernels = {name.removeprefix("reduce_") for name in entry_points(cuda_kernels.source("reduce.cu"))}
    assert kernels == {wire.dtype for wire in cuda_dtypes.KERNEL_WIRES.values()}


def test_the_optimizer_kernels_are_exactly_the_launchers_rules_and_dtypes():
    assert entry_points(cuda_kernels.source("optimizer.cu")) == {
        cuda_kernels.update_kernel(rule, dtype) for rule in cuda_kernels.UPDATE_SLOTS
        for dtype in cuda_kernels.UPDATE_DTYPES}


OPTIMIZERS = {"sgd": optimizers.SGD(), "momentum": optimizers.SGD(momentum=0.9),
              "nesterov": optimizers.SGD(momentum=0.9, nesterov=True), "adam": optimizers.Adam()}


@pytest.mark.parametrize("arch", ["compute_75", "compute_90"])
@pytest.mark.parametrize("dtype", cuda_kernels.UPDATE_DTYPES)
@pytest.mark.parametrize("rule", OPTIMIZERS)
def test_each_optimizer_kernel_takes_the_table_then_the_optimizers_coefficients(rule, dtype, arch):
    opt, math = OPTIMIZERS[rule], np.dtype(cuda_kernels.UPDATE_DTYPES[dtype])
    assert opt._rule == rule and len(opt.slot_names) == cuda_kernels.UPDATE_SLOTS[rule]
    ptx = compile_to_ptx(cuda_kernels.SOURCES / "optimizer.cu", arch)
    name = cuda_kernels.update_kernel(rule, dtype)
    (parameters,) = re.findall(rf"\.visible \.entry {name}\(([^)]*)\)", ptx)
    coefficients = opt._coefficients(math, 1)
    assert re.findall(r"\.param \.(\w+)", parameters) == ["u64", "u32"] + [f"f{math.itemsize * 8}"] * len(
        coefficients)


@pytest.mark.parametrize("arch", ["compute_75", "compute_90"])
def test_the_optimizer_kernels_round_every_operation_as_numpy_does(arch):
    ptx = compile_to_ptx(cuda_kernels.SOURCES / "optimizer.cu", arch)
    ops = re.findall(r"\b(add|sub|mul|div|sqrt|fma|mad|rcp|rsqrt)\.((?:\w+\.)*)f(?:32|64)\b", ptx)
    assert {op for op, _ in ops} == {"add", "sub", "mul", "div", "sqrt"}  # nothing fused, nothing approximate
    assert {modifiers for _, modifiers in ops} == {"rn."}  # IEEE round to nearest, subnormals kept


@pytest.mark.parametrize("arch", ["compute_75", "compute_90"])
@pytest.mark.parametrize("path", KERNEL_FILES, ids=[p.name for p in KERNEL_FILES])
def test_no_kernel_flushes_subnormals_to_zero_as_cupy_compiles_it(path, arch):
    # NumPy keeps subnormals: 1e-40 + 1e-40 is 2e-40 on the emulator, so a .ftz operation would make it 0 here
    ptx = compile_to_ptx(path, arch)
    assert ".ftz" not in ptx
    assert not re.findall(r"\b(fma|mad)\.\w*\.?f(32|64)\b", ptx)  # nothing fused either


def test_the_kernels_ship_in_the_wheel(tmp_path):
    source = copy_source_tree(tmp_path / "src")
    # no build isolation: the installed setuptools builds it, so the test needs no index (GPU machines have none)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                             str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "dist").glob("distrib-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    headers = {f"distrib/kernels/{name}" for name in ("half.cuh", "ieee.cuh", "segments.cuh")}
    assert {f"distrib/kernels/{p.name}" for p in KERNEL_FILES} | headers <= names
    assert not any(name.startswith("kernels/") for name in names)  # inside the package, not a top-level package


# -- kernel launch arguments ------------------------------------------------------------------------------------------


def emulate_pack(memory: bytearray, pointers: list[int], nbytes: list[int], flat: int) -> None:
    """Runs pack_w<W> over a byte array standing for device memory, one word at a time."""
    width, table = cuda_kernels.move_table(pointers, nbytes, flat)
    count = len(pointers)
    members, offsets = table[:count].tolist(), table[count:].tolist()
    for word in range(offsets[-1]):
        m = segment_between(offsets, 0, count, word, 0)
        src = members[m] + (word - offsets[m]) * width
        memory[flat + word * width: flat + (word + 1) * width] = memory[src: src + width]


@pytest.mark.parametrize("sizes, align", [([12, 4, 400], 256), ([3, 0, 5, 1], 256), ([16, 16], 8), ([7], 2),
                                          ([0, 0, 9], 256), ([1] * 40, 1)])
def test_the_pack_table_gathers_every_member_in_order(sizes, align):
    rng = np.random.default_rng(len(sizes))
    memory = bytearray(rng.integers(0, 256, 8192, dtype=np.uint8).tobytes())
    pointers, cursor = [], 0
    for size in sizes:
        pointers.append(cursor + align)
        cursor += size + align
    flat = 4096 + align
    emulate_pack(memory, pointers, sizes, flat)
    expected = b"".join(bytes(memory[p:p + n]) for p, n in zip(pointers, sizes))
    assert bytes(memory[flat:flat + sum(sizes)]) == expected


def test_the_move_table_uses_the_widest_word_every_address_allows():
    assert cuda_kernels.move_table([512, 2048], [4000, 96], 8192)[0] == 16
    assert cuda_kernels.move_table([512, 2052], [4000, 96], 8192)[0] == 4  # a member 4 bytes past alignment
    assert cuda_kernels.move_table([512, 2048], [4002, 96], 8192)[0] == 2  # a member of 4002 bytes
    width, table = cuda_kernels.move_table([512, 2048], [4000, 96], 8192)
    assert table.dtype == np.int64 and table.tolist() == [512, 2048, 0, 250, 256]


@pytest.mark.parametrize("sizes, slots", [([3, 5], 2), ([1], 0), ([4, 0, 2, 7], 1), ([0, 0, 1], 2), ([2] * 30, 1)])
def test_the_update_table_gives_each_element_its_tensors_pointers(sizes, slots):
    count = len(sizes)
    params = [0x10000 * (t + 1) for t in range(count)]
    grads = [p + 0x1000 for p in params]
    slot_pointers = [[p + 0x2000 * (j + 1) for j in range(slots)] for p in params]
    table = cuda_kernels.update_table(params, grads, slot_pointers, sizes).tolist()
    offsets = table[(2 + slots) * count:]
    seen = []
    for i in range(offsets[count]):  # the kernel's indexing, element by element
        t = segment_between(offsets, 0, count, i, 0)
        seen.append((table[t], table[count + t], [table[(2 + j) * count + t] for j in range(slots)], i - offsets[t]))
    assert seen == [(params[t], grads[t], slot_pointers[t], k) for t, size in enumerate(sizes) for k in range(size)]


def test_optimizer_launches_group_tensors_by_device_and_dtype_in_order():
    keys = [(0, "float32"), (1, "float32"), (0, "float16"), (0, "float32"), (1, "float32")]
    assert cuda_kernels.update_groups(keys) == {(0, "float32"): [0, 3], (1, "float32"): [1, 4], (0, "float16"): [2]}


class Placed:
    """Stands for a CuPy array at an address: what the launchers read before they launch."""

    def __init__(self, ptr: int, dtype: str, size: int = 4):
        self.data = type("MemoryPointer", (), {"ptr": ptr})()
        self.dtype, self.size = np.dtype(dtype), size


def test_the_reduce_launcher_refuses_a_complex64_view_at_an_odd_float32_offset():
    # reduce.cu reads complex64 as 8-byte pairs: a misaligned read would end the CUDA context, so it never launches
    sources = [Placed(0x7F0000001000, "complex64"), Placed(0x7F0000002004, "complex64")]
    with pytest.raises(ValueError, match=r"^reduce_complex64 reads \(real, imaginary\) pairs aligned to 8 bytes\. "
                                         r"Received: an array at 0x7f0000002004"):
        cuda_kernels.Kernels().reduce("complex64", 4, sources, [Placed(0x7F0000003000, "complex64")])
    with pytest.raises(ValueError, match="^reduce_complex128 reads .* aligned to 16 bytes"):
        cuda_kernels.Kernels().reduce("complex128", 4, [Placed(0x7F0000001008, "complex128")],
                                      [Placed(0x7F0000003000, "complex128")])


def test_the_optimizer_launcher_refuses_a_misaligned_gradient():
    params, slots = [Placed(0x7F0000001000, "float16")], [[Placed(0x7F0000003000, "float32")]]
    with pytest.raises(ValueError, match=r"^momentum_float16 reads elements aligned to 4 bytes"):
        cuda_kernels.Kernels().update("momentum", params, [Placed(0x7F0000002002, "float32")], slots,
                                      (np.float32(0.1), np.float32(0.9)))


def test_grids_are_bounded_and_never_empty():
    assert cuda_kernels.blocks(0) == 1
    assert cuda_kernels.blocks(cuda_kernels.BLOCK + 1) == 2
    assert cuda_kernels.blocks(10**12) == cuda_kernels.MAX_BLOCKS


# -- pack.cu's tiled member search, emulated in Python -------------------------------------------------------------------


def segment_between(offsets, lo, hi, i, guess):
    """segments.cuh's search: offsets[lo] <= i < offsets[hi] is known; the guess is checked first."""
    if lo <= guess < hi and offsets[guess] <= i < offsets[guess + 1]:
        return guess
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if offsets[mid] <= i:
            lo = mid
        else:
            hi = mid
    return lo


def emulate_tiles(offsets: list[int], block: int, blocks: int, per_thread: int) -> dict[int, int]:
    """The member move_words picks for every word, running its loops thread by thread."""
    count, total = len(offsets) - 1, offsets[-1]
    tile = block * per_thread
    picked = {}
    for b in range(blocks):
        last_seen = [0] * block  # each thread's `m`, kept across its tiles
        for base in range(b * tile, total, blocks * tile):
            first = segment_between(offsets, 0, count, base, last_seen[0])
            last = segment_between(offsets, first, count, min(base + tile, total) - 1, first)
            for t in range(block):
                for k in range(per_thread):
                    i = base + t + k * block
                    if i >= total:
                        break
                    last_seen[t] = segment_between(offsets, first, last + 1, i, last_seen[t])
                    picked[i] = last_seen[t]
    return picked


@pytest.mark.parametrize("sizes", [[1], [5, 0, 3], [1000, 1, 257, 4096], [3] * 300, [0, 0, 70, 0], [2048] * 5])
@pytest.mark.parametrize("blocks", [1, 3])
def test_every_word_finds_the_member_that_owns_it(sizes, blocks):
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    picked = emulate_tiles(offsets, block=32, blocks=blocks, per_thread=4)
    assert sorted(picked) == list(range(offsets[-1]))  # every word moved exactly once
    for word, member in picked.items():
        assert offsets[member] <= word < offsets[member + 1]


def test_the_launcher_sizes_the_grid_with_the_kernels_tile():
    source = cuda_kernels.source("pack.cu")
    (per_thread,) = re.findall(r"constexpr int kWordsPerThread = (\d+);", source)
    assert int(per_thread) == cuda_kernels.WORDS_PER_THREAD
