"""GPU discovery through NVML, without a CUDA context, numbered as CUDA numbers them under CUDA_VISIBLE_DEVICES.

NVML sees every GPU of the machine whatever CUDA_VISIBLE_DEVICES says, so the CUDA ordinals are derived here:
CUDA numbers GPUs in PCI bus order when they are all of one model (its default order, fastest first, only
differs between models), then keeps and reorders those CUDA_VISIBLE_DEVICES lists. On a machine with mixed
models, set CUDA_DEVICE_ORDER=PCI_BUS_ID so that CUDA's numbers agree with these.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Sequence

logger = logging.getLogger("distrib")


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML describes it."""

    name: str
    uuid: str  # "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
    memory_bytes: int
    pci_bus_id: str  # "00000000:3B:00.0"

    def __str__(self) -> str:
        return f"{self.name} ({self.memory_bytes / 2**30:.0f} GiB, {self.uuid}, PCI {self.pci_bus_id})"


def visible_gpus(gpus: Sequence[Gpu], visible: str | None) -> tuple[Gpu, ...]:
    """The GPUs that CUDA numbers 0, 1, ... when CUDA_VISIBLE_DEVICES is `visible` (None: unset).

    Follows CUDA's rules: entries are indices into the machine's GPUs in PCI bus order, or UUIDs ("GPU-..."),
    possibly shortened to a unique prefix; the list is read up to the first entry that names no GPU, names
    one twice or is ambiguous; an empty value hides every GPU.

    Example:
      >>> gpus = [Gpu("A100", f"GPU-{i}aaa", 0, f"0000:0{i}:00.0") for i in range(3)]
      >>> [g.uuid for g in visible_gpus(gpus, "2,GPU-0,-1,1")]
      ['GPU-2aaa', 'GPU-0aaa']

    Raises:
      ValueError: an entry names a MIG instance, which distrib does not map.
    """
    ordered = sorted(gpus, key=lambda g: g.pci_bus_id.lower())
    if visible is None:
        return tuple(ordered)
    chosen: list[Gpu] = []
    for entry in (e.strip() for e in visible.split(",")) if visible.strip() else ():
        if entry.upper().startswith("MIG-"):
            raise ValueError(f"CUDA_VISIBLE_DEVICES names a MIG instance, which distrib does not support: list "
                             f"whole GPUs by index or UUID. Received: {visible!r}.")
        if entry.isdigit():
            gpu = ordered[int(entry)] if int(entry) < len(ordered) else None
        elif entry.upper().startswith("GPU-"):
            matches = [g for g in ordered if g.uuid.lower().startswith(entry.lower())]
            gpu = matches[0] if len(matches) == 1 else None
        else:
            gpu = None
        if gpu is None or gpu in chosen:
            break
        chosen.append(gpu)
    return tuple(chosen)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def nvml_gpus() -> list[Gpu]:
    """Every GPU of the machine, from NVML (no CUDA context is created).

    Raises:
      ImportError: pynvml (the nvidia-ml-py package) is not installed.
      pynvml.NVMLError: NVML's library or the driver is missing.
    """
    import pynvml

    pynvml.nvmlInit()
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append(Gpu(_text(pynvml.nvmlDeviceGetName(handle)), _text(pynvml.nvmlDeviceGetUUID(handle)),
                            int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                            _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)))
        return gpus
    finally:
        pynvml.nvmlShutdown()


def format_uuid(raw: bytes) -> str:
    """CUDA's 16-byte device UUID in NVML's notation.

    Example:
      >>> format_uuid(bytes(range(16)))
      'GPU-00010203-0405-0607-0809-0a0b0c0d0e0f'
    """
    text = raw.hex()
    return f"GPU-{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def cuda_gpus() -> tuple[Gpu, ...]:
    """The GPUs as the CUDA runtime numbers them; this initialises CUDA, so it only stands in when NVML can't load."""
    import cupy

    gpus = []
    for ordinal in range(cupy.cuda.runtime.getDeviceCount()):
        props = cupy.cuda.runtime.getDeviceProperties(ordinal)
        raw = props["uuid"] if isinstance(props["uuid"], bytes) else bytes(b & 0xFF for b in props["uuid"])
        uuid = format_uuid(raw) if len(raw) == 16 else "GPU-unknown"  # a char[16] holding a zero byte may arrive short
        gpus.append(Gpu(_text(props["name"]), uuid, int(props["totalGlobalMem"]),
                        f"{props['pciDomainID']:08X}:{props['pciBusID']:02X}:{props['pciDeviceID']:02X}.0"))
    return tuple(gpus)


def discover() -> tuple[Gpu, ...]:
    """The GPUs this process can use, indexed by CUDA ordinal ('GPU:k' is `discover()[k]`).

    NVML answers without creating a CUDA context; without NVML (no nvidia-ml-py, or no NVML library), the
    CUDA runtime answers instead, and a warning says so.
    """
    try:
        import pynvml
    except ImportError as exc:
        return _without_nvml(f"pynvml is not installed ({exc}); pip install nvidia-ml-py")
    try:
        gpus = visible_gpus(nvml_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    except pynvml.NVMLError as exc:
        return _without_nvml(f"NVML failed: {exc}")
    if len({g.name for g in gpus}) > 1 and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        models = ", ".join(sorted({g.name for g in gpus}))
        logger.warning("distrib: this machine mixes GPU models (%s); set CUDA_DEVICE_ORDER=PCI_BUS_ID so that "
                       "CUDA numbers them in the order distrib reports them.", models)
    return gpus


def _without_nvml(reason: str) -> tuple[Gpu, ...]:
    logger.warning("distrib: counting GPUs through CUDA instead of NVML: %s.", reason)
    return cuda_gpus()
