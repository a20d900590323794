"""`distrib info`: the backend distrib picks here and why, its devices, and the versions that matter."""

from __future__ import annotations

import platform

import numpy as np

from distrib._version import __version__
from distrib.backends import cuda_problem, detect, get_backend


def main() -> int:
    """Prints the backend, the reason CUDA is unavailable when it is, and the default devices."""
    kind = detect()
    backend = get_backend(kind)
    print(f"distrib {__version__} on Python {platform.python_version()}, NumPy {np.__version__}")
    print(f"backend: {kind}" + (f" (CUDA unavailable: {cuda_problem()})" if kind == "cpu" else ""))
    print(f"default devices: {', '.join(backend.default_devices())}")
    return 0
