"""Per-GPU details and the GPU-to-GPU link matrix from NVML, laid out as `nvidia-smi topo -m` lays it out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

# NVML's nvmlGpuTopologyLevel_t, with nvidia-smi's names for them
LEVELS = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
LEGEND = """Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
  P2P  = peer-to-peer reads between the two GPUs: OK, or NS (not supported)"""


@dataclass
class GpuInfo:
    """What `distrib info` shows per GPU."""

    index: int
    name: str
    memory_bytes: int
    compute_capability: str
    pcie: str  # "Gen5 x16 (max Gen5 x16)"
    bus_id: str
    cpu_affinity: str = "N/A"
    links: list[str] = field(default_factory=list)  # one cell per GPU: X, NV18, PIX, ... SYS
    p2p: list[str] = field(default_factory=list)  # one cell per GPU: X, OK, NS


def matrix(gpus: Sequence[GpuInfo]) -> str:
    """The link matrix and the P2P matrix, in `nvidia-smi topo -m`'s layout, with its legend.

    Example:
      >>> a = GpuInfo(0, "H100", 80 << 30, "9.0", "Gen5 x16", "0:1", "0-31", ["X", "NV18"], ["X", "OK"])
      >>> b = GpuInfo(1, "H100", 80 << 30, "9.0", "Gen5 x16", "0:2", "0-31", ["NV18", "X"], ["OK", "X"])
      >>> print(matrix([a, b]).split("Legend")[0])
              GPU0    GPU1    CPU Affinity
      GPU0     X      NV18    0-31
      GPU1    NV18     X      0-31
      <BLANKLINE>
      P2P     GPU0    GPU1
      GPU0     X      OK
      GPU1    OK       X
      <BLANKLINE>
      <BLANKLINE>
    """
    names = [f"GPU{g.index}" for g in gpus]
    lines = ["\t" + "\t".join(names) + "\tCPU Affinity"]
    lines += [f"{n}\t" + "\t".join(_cell(c) for c in g.links) + f"\t{g.cpu_affinity}" for n, g in zip(names, gpus)]
    lines += ["", "P2P\t" + "\t".join(names)]
    lines += [f"{n}\t" + "\t".join(_cell(c) for c in g.p2p) for n, g in zip(names, gpus)]
    return "\n".join(lines) + "\n\n" + LEGEND


def _cell(value: str) -> str:
    return " X " if value == "X" else value  # nvidia-smi pads only the diagonal


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _affinity(pynvml, handle) -> str:
    """The CPUs close to the GPU as ranges ("0-31,64-95"), from NVML's bitmask."""
    words = pynvml.nvmlDeviceGetCpuAffinity(handle, 16)
    cpus = [64 * w + b for w, word in enumerate(words) for b in range(64) if int(word) >> b & 1]
    ranges, start = [], None
    for k, cpu in enumerate(cpus):
        start = cpu if start is None else start
        if k + 1 == len(cpus) or cpus[k + 1] != cpu + 1:
            ranges.append(f"{start}-{cpu}" if cpu != start else f"{cpu}")
            start = None
    return ",".join(ranges) or "N/A"


def _nvlinks(pynvml, handle) -> list[str]:
    """The PCI bus ids at the far end of each active NVLink (a GPU's, or an NVSwitch's)."""
    remotes = []
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                remotes.append(_text(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId).lower())
        except pynvml.NVMLError:
            break  # no such link on this GPU (or no NVLink at all)
    return remotes


def read_gpus() -> list[GpuInfo]:
    """Every GPU NVML sees, in NVML's order, with its link to every other GPU.

    Raises:
      ImportError: pynvml (nvidia-ml-py) is not installed.
      pynvml.NVMLError: NVML's library or the driver is missing.
    """
    import pynvml

    pynvml.nvmlInit()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        buses = [_text(pynvml.nvmlDeviceGetPciInfo(h).busId).lower() for h in handles]
        links = [_nvlinks(pynvml, h) for h in handles]
        gpus = []
        for i, handle in enumerate(handles):
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            pcie = (f"Gen{pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)} "
                    f"x{pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)} (max "
                    f"Gen{pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)} "
                    f"x{pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle)})")
            try:
                affinity = _affinity(pynvml, handle)
            except pynvml.NVMLError:
                affinity = "N/A"
            info = GpuInfo(i, _text(pynvml.nvmlDeviceGetName(handle)),
                           int(pynvml.nvmlDeviceGetMemoryInfo(handle).total), f"{major}.{minor}", pcie, buses[i],
                           affinity)
            for j, other in enumerate(handles):
                info.links.append(_link(pynvml, handle, other, links[i], links[j], buses, i, j))
                info.p2p.append("X" if i == j else _p2p(pynvml, handle, other))
            gpus.append(info)
        return gpus
    finally:
        pynvml.nvmlShutdown()


def _link(pynvml, a, b, links_a: list[str], links_b: list[str], buses: list[str], i: int, j: int) -> str:
    if i == j:
        return "X"
    direct = sum(remote == buses[j] for remote in links_a)
    if direct:
        return f"NV{direct}"
    switched_a = [r for r in links_a if r not in buses]  # links into NVSwitches
    switched_b = [r for r in links_b if r not in buses]
    if switched_a and switched_b:
        return f"NV{min(len(switched_a), len(switched_b))}"
    try:
        return LEVELS.get(pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b), "SYS")
    except pynvml.NVMLError:
        return "N/A"


def _p2p(pynvml, a, b) -> str:
    try:
        status = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_READ)
    except pynvml.NVMLError:
        return "N/A"
    return "OK" if status == pynvml.NVML_P2P_STATUS_OK else "NS"
