"""Runs every program in ../shared/conformance on the CPU emulator and compares with TensorFlow 2.21's results."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import pytest

import distrib

CONFORMANCE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "conformance"
CASES = sorted((CONFORMANCE / "cases").glob("*.py")) if CONFORMANCE.is_dir() else []

def _load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(f"conformance_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_matches(actual, expected, path="result"):
    """Compares a returned structure with its JSON record, as ../shared/conformance/README.md describes."""
    if isinstance(expected, dict) and set(expected) == {"dtype", "shape", "array"}:
        array = np.asarray(actual)
        want = np.asarray(expected["array"], dtype=expected["dtype"]).reshape(expected["shape"])
        assert array.shape == want.shape, f"{path}: shape {array.shape} != {want.shape}"
        kind = {"b": "bool", "i": "int", "u": "int", "f": "float"}
        assert kind[array.dtype.kind] == kind[want.dtype.kind], f"{path}: dtype {array.dtype} vs {want.dtype}"
        if want.dtype.kind == "f":
            np.testing.assert_allclose(array, want, rtol=1e-5, atol=1e-6, err_msg=path)
        else:
            np.testing.assert_array_equal(array, want, err_msg=path)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: expected a dict, got {type(actual).__name__}"
        assert set(actual) == set(expected), f"{path}: keys {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            assert_matches(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, list):
        assert isinstance(actual, (list, tuple)), f"{path}: expected a list, got {type(actual).__name__}"
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_matches(a, e, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def _error_matches(exc: BaseException, expected: dict) -> bool:
    names = {cls.__name__ for cls in type(exc).__mro__}
    base = expected.get("base")
    return expected["error"] in names or (base is not None and base in names)


def test_conformance_cases_are_present():
    assert CASES, f"no conformance cases found under {CONFORMANCE}"


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_conformance(path):
    case = _load(path)
    expected = json.loads((CONFORMANCE / "expected" / f"{path.stem}.json").read_text())["result"]
    if isinstance(expected, dict) and "error" in expected:
        with pytest.raises(Exception) as info:
            case.run_distrib(distrib, np)
        assert _error_matches(info.value, expected), (
            f"raised {type(info.value).__name__}: {info.value}; TensorFlow raises {expected['error']}")
    else:
        assert_matches(case.run_distrib(distrib, np), expected)
