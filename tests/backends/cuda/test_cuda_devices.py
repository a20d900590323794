"""GPU discovery without CUDA: CUDA_VISIBLE_DEVICES, PCI bus order, MIG, UUIDs, NVML's absence."""

from __future__ import annotations


import pytest

from distrib.backends.cuda import devices as cuda_devices
from distrib.backends.cuda.devices import Gpu, format_uuid, visible_gpus

cupy = pytest.importorskip("cupy", reason="CuPy comes with distrib[test]")



# -- devices -----------------------------------------------------------------------------------------------------------

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
