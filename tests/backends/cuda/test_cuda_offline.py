"""The CUDA backend without a GPU: it imports, detection explains itself, kernels compile, and its pure parts hold."""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from distrib import backends, optimizers
from distrib.backends.cuda import devices as cuda_devices, dtypes as cuda_dtypes, kernels as cuda_kernels
from distrib.backends.cuda.devices import Gpu, format_uuid, visible_gpus
from distrib.plan import plan_by_size, plan_concat_split
from distrib.errors import BackendUnavailableError
from distrib.variables import Variable

cupy = pytest.importorskip("cupy", reason="CuPy comes with distrib[test]")
cuda = pytest.importorskip("distrib.backends.cuda.backend")

ROOT = pathlib.Path(__file__).resolve().parents[3]
KERNEL_FILES = sorted(cuda_kernels.SOURCES.glob("*.cu"))


# -- the module and detection ---------------------------------------------------------------------------------------


def test_the_cuda_module_imports_and_implements_every_backend_method():
    from distrib.backends.base import Backend

    assert issubclass(cuda.CudaBackend, Backend)
    assert not cuda.CudaBackend.__abstractmethods__


@pytest.fixture
def fresh_detection(monkeypatch):
    """detect() and get_backend() as in a new process, with no DISTRIB_BACKEND."""
    monkeypatch.setattr(backends, "_DETECTED", [])
    monkeypatch.setattr(backends, "_LOGGED", set())
    monkeypatch.setattr(backends, "_INSTANCES", {})
    monkeypatch.delenv("DISTRIB_BACKEND", raising=False)


@pytest.fixture
def machine(monkeypatch, fresh_detection):
    """Sets what CuPy reports: machine(gpu=..., nccl=...)."""
    from cupy.cuda import nccl

    def set_machine(gpu: bool, nccl_loadable: bool):
        monkeypatch.setattr(cupy, "is_available", lambda: gpu)
        monkeypatch.setattr(nccl, "available", nccl_loadable)

    return set_machine


@pytest.mark.parametrize("gpu, nccl_loadable, reasons", [
    (False, True, ["CuPy sees no CUDA GPU"]),
    (True, False, ["NCCL is not loadable; pip install nvidia-nccl-cu12 (in distrib[cuda12])"]),
    (False, False, ["CuPy sees no CUDA GPU", "NCCL is not loadable"]),
])
def test_detection_falls_back_to_the_cpu_naming_what_is_missing(machine, caplog, gpu, nccl_loadable, reasons):
    machine(gpu, nccl_loadable)
    with caplog.at_level("INFO", logger="distrib"):
        assert backends.detect() == "cpu"
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("using the cpu backend (emulated devices: ")
    assert "\n" not in line
    for reason in reasons:
        assert reason in line


def test_detection_names_the_extra_when_cupy_is_missing(monkeypatch, fresh_detection):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cupy" else real(name, *a))
    assert backends.cuda_problem() == "CuPy is not installed (pip install 'distrib[cuda12]' or 'distrib[cuda13]')"
    assert backends.detect() == "cpu"


@pytest.mark.parametrize("gpu, nccl_loadable, message", [
    (False, True, r"^DISTRIB_BACKEND=cuda, but CuPy sees no CUDA GPU"),
    (True, False, r"^DISTRIB_BACKEND=cuda, but NCCL is not loadable; pip install nvidia-nccl-cu12 \(in "
                  r"distrib\[cuda12\]\)"),
    (False, False, r"^DISTRIB_BACKEND=cuda, but CuPy sees no CUDA GPU .*; and NCCL is not loadable"),
])
def test_forcing_cuda_without_a_gpu_or_nccl_says_which_is_missing(machine, monkeypatch, gpu, nccl_loadable, message):
    machine(gpu, nccl_loadable)
    monkeypatch.setenv("DISTRIB_BACKEND", "cuda")
    with pytest.raises(BackendUnavailableError, match=message):
        backends.detect()


def test_asking_for_the_cuda_backend_without_a_gpu_is_backend_unavailable(machine):
    machine(False, True)
    with pytest.raises(BackendUnavailableError, match=r"^GPU devices need the CUDA backend, but CuPy sees no CUDA GPU"):
        backends.get_backend("cuda")


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
    """PTX for `arch` from NVRTC alone: no GPU, no driver."""
    nvrtc = nvrtc_or_skip()
    program = nvrtc.createProgram(cuda_kernels.source(path.name), path.name, (), ())
    try:
        try:
            nvrtc.compileProgram(program, (f"-arch={arch}", *cuda_kernels.OPTIONS))
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


def test_the_kernels_ship_in_the_wheel(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("distrib", "kernels"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    # no build isolation: the installed setuptools builds it, so the test needs no index (GPU machines have none)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                             str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "dist").glob("distrib-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"distrib/kernels/{p.name}" for p in KERNEL_FILES} | {"distrib/kernels/half.cuh", "distrib/kernels/segments.cuh"} <= names
    assert not any(name.startswith("kernels/") for name in names)  # inside the package, not a top-level package


# -- kernel launch arguments ------------------------------------------------------------------------------------------


def member_of(offsets: list[int], word: int) -> int:
    """The kernel's search, in Python: the last member whose first word is at or before `word`."""
    lo, hi = 0, len(offsets) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if offsets[mid] <= word:
            lo = mid
        else:
            hi = mid
    return lo


def emulate_pack(memory: bytearray, pointers: list[int], nbytes: list[int], flat: int) -> None:
    """Runs pack_w<W> over a byte array standing for device memory, one word at a time."""
    width, table = cuda_kernels.move_table(pointers, nbytes, flat)
    count = len(pointers)
    members, offsets = table[:count].tolist(), table[count:].tolist()
    for word in range(offsets[-1]):
        m = member_of(offsets, word)
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
        t = member_of(offsets, i)
        seen.append((table[t], table[count + t], [table[(2 + j) * count + t] for j in range(slots)], i - offsets[t]))
    assert seen == [(params[t], grads[t], slot_pointers[t], k) for t, size in enumerate(sizes) for k in range(size)]


def test_optimizer_launches_group_tensors_by_device_and_dtype_in_order():
    keys = [(0, "float32"), (1, "float32"), (0, "float16"), (0, "float32"), (1, "float32")]
    assert cuda_kernels.update_groups(keys) == {(0, "float32"): [0, 3], (1, "float32"): [1, 4], (0, "float16"): [2]}


def test_grids_are_bounded_and_never_empty():
    assert cuda_kernels.blocks(0) == 1
    assert cuda_kernels.blocks(cuda_kernels.BLOCK + 1) == 2
    assert cuda_kernels.blocks(10**12) == cuda_kernels.MAX_BLOCKS


# -- dtypes on the wire -----------------------------------------------------------------------------------------------


def test_the_nccl_codes_are_the_ones_nccl_uses():
    from cupy.cuda import nccl

    if not nccl.available:
        pytest.skip("libnccl is not installed here; the codes are checked where it is")
    for name, code in cuda_dtypes.NCCL_TYPES.items():
        assert getattr(nccl, f"NCCL_{name.upper()}") == code, name
    for name, code in cuda_dtypes.NCCL_OPS.items():
        assert getattr(nccl, f"NCCL_{name}") == code, name


NEW, OLD = 22501, 2804  # NCCL 2.25.1 and 2.8.4


@pytest.mark.parametrize("dtype, nccl_type, factor", [
    ("float16", 6, 1), ("bfloat16", 9, 1), ("float32", 7, 1), ("float64", 8, 1), ("int8", 0, 1), ("uint8", 1, 1),
    ("int32", 2, 1), ("uint32", 3, 1), ("int64", 4, 1), ("uint64", 5, 1), ("complex64", 7, 2), ("complex128", 8, 2)])
def test_numeric_dtypes_sum_as_their_nccl_type(dtype, nccl_type, factor):
    assert cuda_dtypes.nccl_reduction(dtype, False, NEW, "all_reduce") == (None, nccl_type, factor, 0, False)


def test_booleans_reduce_as_bytes_with_max_which_is_numpys_logical_or():
    assert cuda_dtypes.nccl_reduction("bool", False, NEW, "all_reduce") == (None, 1, 1, 2, False)
    assert cuda_dtypes.kernel_wire("bool", "add_n") == ("bool", 1, "MAX")


@pytest.mark.parametrize("dtype, wider, code", [("int16", "int32", 2), ("uint16", "uint32", 3)])
def test_16_bit_integers_are_summed_wider_and_cast_back(dtype, wider, code):
    assert cuda_dtypes.nccl_reduction(dtype, False, NEW, "all_reduce") == (wider, code, 1, 0, False)
    wide = np.array([30000, 30000, 30000], dtype).astype(wider).sum().astype(dtype)
    assert wide == np.add(np.add(np.array(30000, dtype), np.array(30000, dtype)), np.array(30000, dtype))


def test_a_mean_uses_nccl_avg_when_the_loaded_nccl_has_it():
    assert cuda_dtypes.nccl_reduction("float32", True, NEW, "all_reduce") == (None, 7, 1, 4, False)
    assert cuda_dtypes.nccl_reduction("float32", True, cuda_dtypes.AVG_MIN_VERSION, "all_reduce").op == 4
    assert cuda_dtypes.nccl_reduction("float32", True, OLD, "all_reduce") == (None, 7, 1, 0, True)
    assert cuda_dtypes.nccl_reduction("complex64", True, OLD, "all_reduce") == (None, 7, 2, 0, True)


def test_bfloat16_needs_nccl_2_10_3():
    with pytest.raises(TypeError, match=r"^all_reduce of bfloat16 needs NCCL 2\.10\.3 or later. Received: NCCL "
                                        r"version code 2804"):
        cuda_dtypes.nccl_reduction("bfloat16", False, OLD, "all_reduce")


def test_a_mean_of_integers_is_not_the_backends_job():
    with pytest.raises(ValueError, match=r"^all_reduce takes a mean of float and complex values only"):
        cuda_dtypes.nccl_reduction("int32", True, NEW, "all_reduce")


@pytest.mark.parametrize("dtype", ["datetime64", "object", "float128" if hasattr(np, "float128") else "str"])
def test_dtypes_without_a_reduction_are_type_errors(dtype):
    name = np.dtype(dtype).name
    with pytest.raises(TypeError, match=rf"^all_reduce on the CUDA backend reduces bfloat16, bool, .* Received: "
                                        rf"dtype {name}\.$"):
        cuda_dtypes.nccl_reduction(name, False, NEW, "all_reduce")
    with pytest.raises(TypeError, match=r"^add_n on the CUDA backend reduces "):
        cuda_dtypes.kernel_wire(name, "add_n")


@pytest.mark.parametrize("num_packs", [1, 2, 3, 7])
def test_the_nccl_calls_of_a_plan_cover_its_buffer_once(num_packs):
    specs = [((3, 5), "complex64"), ((7,), "complex64"), ((), "complex64")]
    (buffer,) = plan_concat_split(specs, num_packs).buffers
    calls = cuda_dtypes.chunk_calls(buffer.chunks, itemsize=8, factor=2)
    assert len(calls) == min(num_packs, buffer.size)
    assert [offset for offset, _ in calls] == [start * 8 for start, _ in buffer.chunks]
    assert sum(count for _, count in calls) == 2 * buffer.size  # float32 pairs
    assert all(count > 0 for _, count in calls)


def test_plans_by_size_give_one_call_per_pack_and_never_mix_dtypes():
    specs = [((100,), "float16"), ((300,), "float32"), ((50,), "float16"), ((10,), "bool")]
    plan = plan_by_size(specs, 256)
    for buffer in plan.buffers:
        wire = cuda_dtypes.nccl_reduction(buffer.dtype, False, NEW, "all_reduce")
        assert cuda_dtypes.chunk_calls(buffer.chunks, np.dtype(buffer.dtype).itemsize, wire.factor) == [
            (0, buffer.size)]
    assert {b.dtype for b in plan.buffers} == {"float16", "float32", "bool"}


# -- devices ----------------------------------------------------------------------------------------------------------

GPUS = [Gpu("NVIDIA H100", f"GPU-{c}{c}{c}{c}0000-1111-2222-3333-444444444444", 80 << 30, f"00000000:{bus}:00.0")
        for c, bus in zip("abcd", ("1B", "3B", "88", "AF"))]
UUIDS = [g.uuid for g in GPUS]


@pytest.mark.parametrize("visible, expected", [
    (None, [0, 1, 2, 3]),
    ("", []),
    ("  ", []),
    ("2", [2]),
    ("2,0", [2, 0]),
    (" 1 , 3 ", [1, 3]),
    ("0,2,-1,1", [0, 2]),  # CUDA stops at the first invalid entry
    ("0,7,1", [0]),
    ("0,0,1", [0]),  # a repeated GPU is invalid too
    ("0,,1", [0]),
    ("GPU-cccc0000-1111-2222-3333-444444444444", [2]),
    ("GPU-dddd,0", [3, 0]),  # a unique UUID prefix
    ("gpu-BBBB", [1]),
    ("GPU-,1", []),  # a prefix every GPU shares is ambiguous
    ("3,GPU-aaaa", [3, 0]),
    ("nvidia0", []),
])
def test_cuda_visible_devices_selects_and_orders_gpus_as_cuda_does(visible, expected):
    assert [UUIDS.index(g.uuid) for g in visible_gpus(GPUS, visible)] == expected


def test_gpus_are_numbered_in_pci_bus_order_whatever_order_nvml_lists_them():
    shuffled = [GPUS[2], GPUS[0], GPUS[3], GPUS[1]]
    assert visible_gpus(shuffled, None) == tuple(GPUS)
    assert visible_gpus(shuffled, "1") == (GPUS[1],)


def test_mig_instances_are_refused_with_the_rule():
    with pytest.raises(ValueError, match=r"^CUDA_VISIBLE_DEVICES names a MIG instance, which distrib does not "
                                         r"support: .* Received: 'MIG-GPU-aaaa/1/0'\."):
        visible_gpus(GPUS, "MIG-GPU-aaaa/1/0")


def test_cuda_uuids_are_written_as_nvml_writes_them():
    assert format_uuid(bytes.fromhex("8932f937d72c4106c12f20bd9faed9f6")) == "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"


def test_without_nvml_or_a_driver_discovery_says_why(monkeypatch, caplog):
    pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py comes with distrib[test]")

    def no_library():
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    monkeypatch.setattr(cuda_devices, "cuda_gpus", lambda: ())
    with caplog.at_level("WARNING", logger="distrib"):
        assert cuda_devices.discover() == ()
    assert "counting GPUs through CUDA instead of NVML: NVML failed" in caplog.text


def test_mixed_gpu_models_warn_unless_cuda_orders_by_pci_bus(monkeypatch, caplog):
    mixed = [GPUS[0], Gpu("NVIDIA A100", "GPU-eeee", 40 << 30, "00000000:DA:00.0")]
    monkeypatch.setattr(cuda_devices, "nvml_gpus", lambda: mixed)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    with caplog.at_level("WARNING", logger="distrib"):
        assert cuda_devices.discover() == tuple(mixed)
    assert "set CUDA_DEVICE_ORDER=PCI_BUS_ID" in caplog.text
    caplog.clear()
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    cuda_devices.discover()
    assert not caplog.text


# -- the backend's device names, without touching CUDA ----------------------------------------------------------------


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(cuda_devices, "discover", lambda: tuple(GPUS[:2]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    return cuda.CudaBackend()


def test_the_backend_names_every_visible_gpu(two_gpus):
    assert two_gpus.default_devices() == ("GPU:0", "GPU:1")
    assert two_gpus.gpus == tuple(GPUS[:2])
    assert repr(two_gpus) == "<CudaBackend devices=('GPU:0', 'GPU:1') gpus=['NVIDIA H100', 'NVIDIA H100']>"


def test_gpus_may_repeat_for_replicas_that_share_one(two_gpus):
    for device in ("GPU:0", "/gpu:1", "/job:localhost/replica:0/task:0/device:GPU:1"):
        two_gpus.check_device(device)


@pytest.mark.parametrize("rule, dtype, slots", [
    ("rmsprop", np.float32, 1),  # no kernel for the rule
    ("adam", np.int32, 2),  # nor for the dtype
    ("momentum", np.float32, 2),  # a slot too many
    ("sgd", np.float32, 0),  # a gradient that is not on a GPU
])
def test_what_optimizer_cu_cannot_take_is_left_to_the_optimizer(two_gpus, rule, dtype, slots):
    var = Variable(np.zeros(3, dtype), name="w")
    items = [(var, np.ones(3, dtype), tuple(Variable(np.zeros(3, dtype)) for _ in range(slots)))]
    assert two_gpus.fused_optimizer_update(rule, items, (np.float32(0.1), np.float32(0.9))) is False
    np.testing.assert_array_equal(var.numpy(), np.zeros(3, dtype))


@pytest.mark.parametrize("device, message", [
    ("GPU:2", r"^Unknown device 'GPU:2': this process sees 2 GPU\(s\), GPU:0 to GPU:1 \(CUDA_VISIBLE_DEVICES=0,1\)\."),
    ("CPU:0", r"^The CUDA backend runs on GPU devices such as 'GPU:0'\. Received: 'CPU:0'"),
])
def test_devices_the_backend_lacks_are_value_errors(two_gpus, device, message):
    with pytest.raises(ValueError, match=message):
        two_gpus.check_device(device)
