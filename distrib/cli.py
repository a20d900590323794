"""The `distrib` command: `distrib train` (the main job) and `distrib info` (backend, devices, versions)."""

from __future__ import annotations

import argparse
import platform
import sys


def info() -> int:
    """Prints the backend distrib picks here and why, its devices, and the versions that matter."""
    import numpy as np

    import distrib
    from distrib.backends import cuda_problem, detect, get_backend

    kind = detect()
    backend = get_backend(kind)
    print(f"distrib {distrib.__version__} on Python {platform.python_version()}, NumPy {np.__version__}")
    print(f"backend: {kind}" + (f" (CUDA unavailable: {cuda_problem()})" if kind == "cpu" else ""))
    print(f"default devices: {', '.join(backend.default_devices())}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Dispatches `distrib train ...` and `distrib info`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="distrib", description="tf.distribute's programming model on CuPy/NCCL "
                                                                 "and a NumPy CPU emulator.")
    parser.add_argument("command", choices=("train", "info"), help="train: the digits MLP job; info: the backend")
    if not argv or argv[0] not in ("train", "info"):
        parser.parse_args(argv)  # prints usage and exits
    if argv[0] == "train":
        from distrib.train import main as train_main

        return train_main(argv[1:])
    parser.parse_args(argv)
    return info()


if __name__ == "__main__":
    sys.exit(main())
