"""Backend selection: `detect()` picks "cuda" when CuPy sees a GPU and NCCL loads, else "cpu", and says why.

`DISTRIB_BACKEND=cpu|cuda` forces one; forcing a backend that cannot run raises `BackendUnavailableError`
naming what is missing. Nothing falls back silently: the choice and its reason are logged once per process.
`backend_for_devices` picks the backend a list of device names needs.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
import warnings
from typing import Sequence

from distrib.backends.base import Backend
from distrib.devices import canonical_name, parse_device
from distrib.errors import BackendUnavailableError
from distrib.install_hint import pip_install

logger = logging.getLogger("distrib")

_CLASSES = {"cpu": ("distrib.backends.cpu", "CpuBackend"), "cuda": ("distrib.backends.cuda.backend", "CudaBackend")}
_INSTANCES: dict[str, Backend] = {}
_DETECTED: list[tuple[str, str]] = []
_LOGGED: set[str] = set()
_LOCK = threading.RLock()


def _log_once(kind: str, message: str) -> None:
    if kind in _LOGGED:
        return
    _LOGGED.add(kind)
    # A library must not configure logging, but this one line should reach users who have not either.
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("distrib: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    logger.info(message)


def cuda_problem() -> str | None:
    """Why the CUDA backend cannot run here (None if it can): CuPy missing, or which of a GPU and NCCL is missing."""
    if importlib.util.find_spec("cupy") is None:
        return f"CuPy is not installed ({pip_install('cuda12')}, or the cuda13 extra)"
    try:
        import cupy
    except Exception as exc:  # a broken CuPy install is as good as none
        return f"CuPy failed to import ({type(exc).__name__}: {exc})"
    problems = []
    if not cupy.is_available():
        problems.append("CuPy sees no CUDA GPU (no driver, or CUDA_VISIBLE_DEVICES hides them all)")
    try:
        with warnings.catch_warnings():  # CuPy warns when libnccl is missing; the reason below says it instead
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl
    except Exception as exc:
        problems.append(f"cupy.cuda.nccl failed to import ({exc}); pip install nvidia-nccl-cu12 (in distrib[cuda12]) "
                        f"or nvidia-nccl-cu13 (in distrib[cuda13])")
    else:
        if not getattr(nccl, "available", False):
            problems.append("NCCL is not loadable; pip install nvidia-nccl-cu12 (in distrib[cuda12]) or "
                            "nvidia-nccl-cu13 (in distrib[cuda13])")
    if not problems and importlib.util.find_spec(_CLASSES["cuda"][0]) is None:
        problems.append("this build of distrib has no CUDA backend module")
    return "; and ".join(problems) or None


def detect() -> str:
    """The backend kind to use by default: $DISTRIB_BACKEND if set, else "cuda" when usable, else "cpu"."""
    with _LOCK:
        if not _DETECTED:
            forced = os.environ.get("DISTRIB_BACKEND", "").strip().lower()
            if forced:
                if forced not in _CLASSES:
                    raise ValueError(f"DISTRIB_BACKEND must be 'cpu' or 'cuda'. Received: {forced!r}.")
                if forced == "cuda" and (problem := cuda_problem()):
                    raise BackendUnavailableError(f"DISTRIB_BACKEND=cuda, but {problem}. Unset DISTRIB_BACKEND (a "
                                                  f"GPU is then used where one works) or set it to cpu.")
                kind, reason = forced, f"DISTRIB_BACKEND={forced}"
            elif (problem := cuda_problem()) is None:
                kind, reason = "cuda", "CuPy sees a GPU and NCCL is loadable"
            else:
                kind, reason = "cpu", problem
            if kind == "cpu":  # a bad replica count raises before the line saying the emulator is in use
                from distrib.backends.cpu import replicas_from_environment

                replicas_from_environment()
            _DETECTED.append((kind, reason))
            _log_once(kind, f"using the {kind} backend ({'emulated devices: ' if kind == 'cpu' else ''}{reason})")
        return _DETECTED[0][0]


def get_backend(kind: str | None = None) -> Backend:
    """The process-wide backend instance of `kind` ("cpu" or "cuda"); None means `detect()`."""
    with _LOCK:
        if kind is None:
            kind = detect()
        else:
            _log_once(kind, f"using the {kind} backend (the strategy names {kind.upper() if kind == 'cpu' else 'GPU'} "
                            f"devices{'; emulated on NumPy' if kind == 'cpu' else ''})")
        if kind not in _INSTANCES:
            if kind not in _CLASSES:
                raise ValueError(f"Unknown backend {kind!r}: expected 'cpu' or 'cuda'.")
            if kind == "cuda" and (problem := cuda_problem()):
                raise BackendUnavailableError(f"GPU devices need the CUDA backend, but {problem}.")
            module, cls = _CLASSES[kind]
            _INSTANCES[kind] = getattr(importlib.import_module(module), cls)()
        return _INSTANCES[kind]


_MULTI_PROCESS = {"cpu": ("distrib.backends.mpi", "MpiBackend"),
                  "cuda": ("distrib.backends.cuda.multi_process", "MultiProcessCudaBackend")}


def get_multi_process_backend() -> Backend:
    """The process-wide backend of a multi-worker job: NCCL across the processes' GPUs where the CUDA backend
    runs, else the CPU emulator over MPI. Creating it joins the MPI job, so every rank must call it."""
    with _LOCK:
        kind = detect()
        key = f"{kind}+mpi"
        if key not in _INSTANCES:
            module, cls = _MULTI_PROCESS[kind]
            _INSTANCES[key] = getattr(importlib.import_module(module), cls)()
        return _INSTANCES[key]


def backend_for_devices(devices: Sequence[str] | None) -> tuple[Backend, tuple[str, ...]]:
    """The backend that runs `devices` (all GPUs or all emulated CPUs) and their canonical names; None: every GPU
    when the CUDA backend can run, else the emulated CPUs of `default_devices()`."""
    if devices is None:
        backend = get_backend(detect())
        return backend, backend.default_devices()
    if isinstance(devices, str) or not isinstance(devices, (list, tuple)):
        raise TypeError(f"devices must be a list of device names such as ['GPU:0', 'GPU:1']. Received: {devices!r}.")
    if not devices:
        raise ValueError("devices must name at least one device. Received: [].")
    names = tuple(canonical_name(d) for d in devices)
    kinds = {parse_device(n).kind for n in names}
    if len(kinds) > 1:
        raise ValueError(f"A MirroredStrategy runs on one kind of device: all GPUs or all (emulated) CPUs. "
                         f"Received: {list(devices)}.")
    if kinds == {"GPU"} and (problem := cuda_problem()) is not None:
        raise ValueError(f"Unknown devices {list(devices)}: GPU devices need the CUDA backend, but {problem}. "
                         f"Without a GPU, name emulated CPU devices such as ['CPU:0', 'CPU:1'].")
    backend = get_backend("cuda" if kinds == {"GPU"} else "cpu")
    for name in names:
        backend.check_device(name)
    if kinds == {"CPU"} and len(set(names)) != len(names):
        raise ValueError(f"No duplicates allowed in `devices` for emulated CPU devices. Received: {list(devices)}.")
    return backend, names


__all__ = ["Backend", "backend_for_devices", "cuda_problem", "detect", "get_backend", "get_multi_process_backend"]
