"""Runs the conformance programs on the CPU emulator and compares each with TensorFlow 2.21's recorded result.

The project's own cases live in tests/conformance (programs, TensorFlow's results, and record.py, which records
them); the cases under ../shared/conformance, when that folder exists, run as an extra check.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import pytest

import distrib

CONFORMANCE = pathlib.Path(__file__).resolve().parent / "conformance"
SHARED_CONFORMANCE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "conformance"

# Where distrib differs from TensorFlow on purpose; strict, so each fails if the difference goes away.
DELIBERATE_DIFFERENCES = {
    "error_scope_object_reentered": "TensorFlow's scope() object is single-use (AttributeError on re-entry); "
                                    "distrib's may be entered again",
}


def conformance_cases(folder: pathlib.Path) -> list[pathlib.Path]:
    """The case programs under `folder`/cases, sorted by name; none when the folder is absent."""
    return sorted((folder / "cases").glob("*.py")) if folder.is_dir() else []


def load_case(path: pathlib.Path):
    """The case program at `path` as a module (NAME, DESCRIPTION, run_distrib)."""
    spec = importlib.util.spec_from_file_location(f"conformance_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected_result(path: pathlib.Path):
    """TensorFlow's recorded result for the case at `path` (cases/NAME.py beside expected/NAME.json)."""
    return json.loads((path.parents[1] / "expected" / f"{path.stem}.json").read_text())["result"]


def check_case(path: pathlib.Path, namespace=distrib, numpy=np, convert=lambda result: result) -> None:
    """Runs the case with `namespace` as its `distrib` and asserts it does what TensorFlow did.

    `convert` is applied to a returned result before comparing (the GPU tests bring CuPy arrays to the host).
    """
    case, expected = load_case(path), expected_result(path)
    if isinstance(expected, dict) and "error" in expected:
        with pytest.raises(Exception) as info:
            case.run_distrib(namespace, numpy)
        assert _error_matches(info.value, expected), (
            f"raised {type(info.value).__name__}: {info.value}; TensorFlow raises {expected['error']}")
    else:
        assert_matches(convert(case.run_distrib(namespace, numpy)), expected)


def assert_matches(actual, expected, path="result"):
    """Compares a returned structure with its JSON record, as tests/conformance/README.md describes."""
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


def _marked(path: pathlib.Path):
    reason = DELIBERATE_DIFFERENCES.get(path.stem)
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(path, marks=marks, id=path.stem)


CASES = conformance_cases(CONFORMANCE)
SHARED_CASES = conformance_cases(SHARED_CONFORMANCE)


def test_conformance_cases_are_present():
    assert len(CASES) >= 38, f"the conformance cases are missing from {CONFORMANCE}"
    recorded = {p.stem for p in (CONFORMANCE / "expected").glob("*.json")}
    assert recorded == {p.stem for p in CASES}, "every case needs TensorFlow's record (tests/conformance/record.py)"


@pytest.mark.parametrize("path", [_marked(p) for p in CASES])
def test_conformance(path):
    check_case(path)


@pytest.mark.parametrize("path", [_marked(p) for p in CASES])
def test_conformance_with_cooperative_replicas(path, monkeypatch):
    """The same programs, every replica a greenlet on the calling thread: the same results and errors."""
    monkeypatch.setenv("DISTRIB_REPLICA_EXECUTION", "cooperative")
    check_case(path)


@pytest.mark.skipif(not SHARED_CASES, reason=f"no shared conformance cases at {SHARED_CONFORMANCE} (outside the "
                                             f"repository; the project's own cases run in test_conformance)")
@pytest.mark.parametrize("path", SHARED_CASES or [None], ids=[p.stem for p in SHARED_CASES] or ["absent"])
def test_shared_conformance(path):
    check_case(path)
