"""The CUDA backend without a GPU: the module imports, detection explains itself, device names hold."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from distrib import backends
from distrib.backends.cuda import devices as cuda_devices
from distrib.backends.cuda.devices import Gpu
from distrib.errors import BackendUnavailableError
from distrib.install_hint import pip_install
from distrib.variables import Variable

cupy = pytest.importorskip("cupy", reason="CuPy comes with distrib[test]")
cuda = pytest.importorskip("distrib.backends.cuda.backend")



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
    assert backends.cuda_problem() == f"CuPy is not installed ({pip_install('cuda12')}, or the cuda13 extra)"
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
    with pytest.raises(BackendUnavailableError, match=message) as raised:
        backends.detect()
    assert str(raised.value).endswith("Unset DISTRIB_BACKEND (a GPU is then used where one works) or set it to cpu.")


def test_asking_for_the_cuda_backend_without_a_gpu_is_backend_unavailable(machine):
    machine(False, True)
    with pytest.raises(BackendUnavailableError, match=r"^GPU devices need the CUDA backend, but CuPy sees no CUDA GPU"):
        backends.get_backend("cuda")


GPUS = [Gpu("NVIDIA H100", f"GPU-{c}{c}{c}{c}0000-1111-2222-3333-444444444444", 80 << 30, f"00000000:{bus}:00.0")
        for c, bus in zip("abcd", ("1B", "3B", "88", "AF"))]
UUIDS = [g.uuid for g in GPUS]


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


def test_the_placement_test_accepts_only_cupy_arrays_each_on_its_own_gpu(two_gpus):
    def on(device_id):  # a CuPy array whose memory (host memory here) says it is on GPU `device_id`
        host = np.zeros(4, np.float32)
        memory = cupy.cuda.memory.UnownedMemory(host.ctypes.data, host.nbytes, host, device_id=device_id)
        return cupy.ndarray((4,), np.float32, memptr=cupy.cuda.memory.MemoryPointer(memory, 0))

    placed = two_gpus.placed_check(("GPU:0", "GPU:1"))
    assert placed([on(0), on(1)])
    assert not placed([on(1), on(0)]) and not placed([on(0), on(0)])  # the general route copies them over
    assert not placed([on(0), np.zeros(4, np.float32)])  # a host array is uploaded by the general route


@pytest.mark.parametrize("device, message", [
    ("GPU:2", r"^Unknown device 'GPU:2': this process sees 2 GPU\(s\), GPU:0 to GPU:1 \(CUDA_VISIBLE_DEVICES=0,1\)\."),
    ("CPU:0", r"^The CUDA backend runs on GPU devices such as 'GPU:0'\. Received: 'CPU:0'"),
])
def test_devices_the_backend_lacks_are_value_errors(two_gpus, device, message):
    with pytest.raises(ValueError, match=message):
        two_gpus.check_device(device)
