"""The conformance programs on the CUDA backend, every device list mapped onto GPU:0 (replicas sharing the GPU).

Each case names emulated devices ("CPU:0" ... "CPU:3"); here the same number of replicas share GPU:0 through the
same-device path, and the results must equal both TensorFlow's record and the CPU emulator's answer.
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

import distrib
from test_conformance import CASES, _marked, assert_matches, check_case, expected_result, load_case

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")


class _OnGpu(distrib.MirroredStrategy):
    """MirroredStrategy with each named device replaced by GPU:0."""

    def __init__(self, devices=None, *args, **kwargs):
        super().__init__(["GPU:0"] * (len(devices) if devices is not None else 2), *args, **kwargs)


def _to_host(value):
    return value.get() if isinstance(value, cupy.ndarray) else value


def _on_gpu_distrib() -> types.ModuleType:
    module = types.ModuleType("distrib_on_gpu")
    module.__dict__.update({k: getattr(distrib, k) for k in dir(distrib) if not k.startswith("__")})
    module.MirroredStrategy = _OnGpu
    return module


def _host_numpy() -> types.ModuleType:
    """NumPy whose asarray/array take CuPy arrays too (the cases convert their results with np.asarray)."""
    module = types.ModuleType("numpy_taking_cupy")
    module.__dict__.update({k: getattr(np, k) for k in dir(np) if not k.startswith("__")})
    module.asarray = lambda a, *args, **kwargs: np.asarray(_to_host(a), *args, **kwargs)
    module.array = lambda a, *args, **kwargs: np.array(_to_host(a), *args, **kwargs)
    return module


def _host_structure(value):
    if isinstance(value, dict):
        return {k: _host_structure(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host_structure(v) for v in value)
    return _to_host(value)


@pytest.mark.parametrize("path", [_marked(p) for p in CASES])
def test_conformance_on_a_shared_gpu(path):
    check_case(path, _on_gpu_distrib(), _host_numpy(), convert=_host_structure)  # TensorFlow's record
    expected = expected_result(path)
    if not (isinstance(expected, dict) and "error" in expected):  # and the emulator's answer
        on_gpu = _host_structure(load_case(path).run_distrib(_on_gpu_distrib(), _host_numpy()))
        assert_matches(on_gpu, json.loads(json.dumps(_record(load_case(path).run_distrib(distrib, np)))))


def _record(value):
    """A result in the JSON layout of tests/conformance, so the emulator's answer compares like TensorFlow's."""
    if isinstance(value, dict):
        return {k: _record(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_record(v) for v in value]
    if isinstance(value, str):
        return value
    array = np.asarray(value)
    return {"dtype": array.dtype.name, "shape": list(array.shape), "array": array.tolist()}
