"""The versions `distrib info` and `distrib bench` report, and which pip extra brings what is missing."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import shutil
import subprocess
import sys

import numpy as np

from distrib._version import __version__

# module -> (what it is for, the extra that installs it)
OPTIONAL = {
    "cupy": ("GPU arrays and NCCL (the cuda backend)", "distrib[cuda12] or distrib[cuda13]"),
    "pynvml": ("GPU discovery and the link matrix without a CUDA context", "distrib[cuda12] or distrib[cuda13]"),
    "ml_dtypes": ("bfloat16 arrays", "distrib[train], distrib[bench] or distrib[cuda12]"),
    "mpi4py": ("multi-worker runs over MPI", "distrib[mpi]"),
    "ray": ("ParameterServerStrategy", "distrib[ps]"),
    "rich": ("tables and progress bars on a terminal", "distrib[bench] or distrib[train]"),
    "matplotlib": ("plots (distrib bench --plot, the main job's loss curve)", "distrib[bench] or distrib[train]"),
}
DISTRIBUTIONS = {"pynvml": "nvidia-ml-py", "mpi4py": "mpi4py", "ray": "ray", "rich": "rich",
                 "matplotlib": "matplotlib", "ml_dtypes": "ml_dtypes"}


def missing() -> dict[str, tuple[str, str]]:
    """The optional modules not installed here: module -> (what it is for, the extra that brings it)."""
    return {name: why for name, why in OPTIONAL.items() if importlib.util.find_spec(name) is None}


def _distribution_version(module: str) -> str | None:
    try:
        return importlib.metadata.version(DISTRIBUTIONS.get(module, module))
    except importlib.metadata.PackageNotFoundError:
        return None


def _code(version: int) -> str:
    """CUDA's and NCCL's integer versions as dotted text (12040 -> 12.4; NCCL 22105 -> 2.21.5)."""
    if version >= 20000 and version < 100000 and version // 10000 == 2:  # NCCL 2.9+: X*10000 + Y*100 + Z
        return f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    return f"{version // 1000}.{version % 1000 // 10}"


def versions() -> dict[str, str | None]:
    """distrib, Python, NumPy, CuPy, the CUDA runtime and driver, NCCL, mpi4py and the MPI library, Ray (None: not
    installed or not loadable here; nothing here creates a CUDA context or initialises MPI)."""
    found: dict[str, str | None] = {"distrib": __version__, "python": platform.python_version(),
                                    "numpy": np.__version__}
    found.update({"cupy": None, "cuda_runtime": None, "cuda_driver": None, "nccl": None})
    if importlib.util.find_spec("cupy") is not None:
        try:
            import cupy

            found["cupy"] = cupy.__version__
            found["cuda_runtime"] = _code(cupy.cuda.runtime.runtimeGetVersion())
            driver = cupy.cuda.runtime.driverGetVersion()
            found["cuda_driver"] = _code(driver) if driver else None  # 0: no driver installed
        except Exception:  # noqa: BLE001 - no driver: the versions it could not read stay None
            pass
        try:
            from cupy.cuda import nccl

            found["nccl"] = _code(nccl.get_version()) if getattr(nccl, "available", False) else None
        except Exception:  # noqa: BLE001 - libnccl missing
            pass
    for module in ("mpi4py", "ray", "pynvml", "rich", "matplotlib"):
        found[DISTRIBUTIONS[module]] = _distribution_version(module)
        if module == "mpi4py":
            found["mpi"] = mpi_library()
    return found


def mpi_library() -> str | None:
    """The MPI library, e.g. 'Open MPI v4.1.4': mpi4py's, once this process has imported mpi4py.MPI, else what
    `mpirun --version` says (None: neither is here). A mismatch between the two is a common cause of jobs that
    start as N copies of rank 0."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        return mpi.Get_library_version().splitlines()[0].split(",")[0].strip() or None
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return None
    try:
        said = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = said.stdout.strip().splitlines()[:1]
    return first[0].strip() if said.returncode == 0 and first else None
