"""GPU tests: each carries the `gpu` marker and is skipped, saying why, where the CUDA backend cannot run."""

from __future__ import annotations

import pytest

from distrib.backends import cuda_problem


def pytest_collection_modifyitems(config, items):
    problem = None
    for item in items:
        if "gpu" in item.keywords:
            problem = problem or cuda_problem() or ""
            if problem:
                item.add_marker(pytest.mark.skip(reason=f"needs a GPU with CuPy and NCCL: {problem}"))
