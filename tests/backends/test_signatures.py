"""Collective signatures: equal on every process for the same collective, different where processes disagree."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from distrib.backends.signatures import REFUSED, signature

CASES = [("all_reduce", ((1000, "float32"),), False), ("all_reduce", ((1000, "float32"),), True),
         ("all_reduce", ((1000, "float64"),), False), ("all_reduce", ((1000, "int32"),), False),
         ("all_reduce", ((999, "float32"),), False), ("all_reduce", ((500, "float32"), (500, "float32")), False),
         ("all_gather", ((1000, "float32"),), False), ("broadcast", ((1000, "float32"),), False)]


def signatures(cases=CASES) -> list[int]:
    return [signature(what, [(count, np.dtype(name)) for count, name in parts], mean) for what, parts, mean in cases]


def test_each_difference_between_processes_gives_another_signature():
    values = signatures()
    assert len(set(values)) == len(values)
    # never "none" nor the refusal's mark, and small enough to sit beside a collective's number in a slot's cell
    assert all(REFUSED < value < 1 << 47 for value in values)


def test_processes_with_other_string_hashes_compute_the_same_signatures():
    program = "import test_signatures as t; print(t.signatures())"
    printed = {subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(__file__), env=dict(os.environ, PYTHONHASHSEED=seed)).stdout.strip()
               for seed in ("1", "2")}
    assert printed == {str(signatures())}
