"""Every `Example:` in the package's docstrings and the README's first program run as written."""

from __future__ import annotations

import doctest
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The CUDA backend's examples need a GPU; tests/gpu runs that path.
CUDA_ONLY = ("distrib/backends/cuda/backend.py", "distrib/backends/cuda/nccl.py")
MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "distrib").rglob("*.py")
                 if p.name != "__main__.py" and p.relative_to(ROOT).as_posix() not in CUDA_ONLY)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"


def test_the_readmes_first_program_runs(capsys):
    readme = (ROOT / "README.md").read_text()
    program = re.search(r"## A first program\n\n```python\n(.*?)```", readme, re.S).group(1)
    exec(compile(program, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "66." in printed and "264.0" in printed  # the mean of each replica's sum, and the total
