"""GPU tests: each carries the `gpu` marker and is skipped, saying why, where the CUDA backend cannot run.

Where it can run, a GPU module that skips as a whole (say, for want of a package it imports) or collects no test
fails the run instead, so a GPU machine never reports green over tests that did not run.
"""

from __future__ import annotations

import pathlib

import pytest

from distrib.backends import cuda_problem

HERE = pathlib.Path(__file__).resolve().parent
_problem: list[str | None] = []


def gpu_problem() -> str | None:
    """Why the CUDA backend cannot run here (None when it can), asked once per test session."""
    if not _problem:
        _problem.append(cuda_problem())
    return _problem[0]


def _is_gpu_module(path) -> bool:
    path = pathlib.Path(str(path))
    return path.parent == HERE and path.name.startswith("test_") and path.suffix == ".py"


def pytest_collectreport(report):
    if not _is_gpu_module(report.fspath) or report.failed or gpu_problem() is not None:
        return
    if report.skipped:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"{report.nodeid} skipped as a whole on a machine with a GPU: {reason}"
    elif not report.result:
        report.outcome = "failed"
        report.longrepr = f"{report.nodeid} collected no test on a machine with a GPU"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and gpu_problem():
            item.add_marker(pytest.mark.skip(reason=f"needs a GPU with CuPy and NCCL: {gpu_problem()}"))
