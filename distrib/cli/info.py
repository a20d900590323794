"""`distrib info`: the backend distrib picks here and why, the GPUs and their links, the versions, what is missing."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from distrib.cli import topology
from distrib.cli.versions import missing, versions
from distrib.install_hint import pip_install
from distrib.mpi_env import mpi_environment


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the same facts as JSON")


def gather() -> dict:
    """Everything `distrib info` reports, as a JSON-ready dict; never raises for a missing GPU, driver or NVML."""
    from distrib.backends import cuda_problem, detect, get_backend
    from distrib.errors import BackendUnavailableError

    forced = os.environ.get("DISTRIB_BACKEND", "").strip().lower()
    try:
        kind = detect()
        default_devices = list(get_backend(kind).default_devices())
    except (BackendUnavailableError, ValueError) as exc:  # DISTRIB_BACKEND or DISTRIB_CPU_REPLICAS it cannot use
        kind, default_devices, reason = None, [], str(exc)
    else:
        reason = (f"DISTRIB_BACKEND={forced}" if forced else
                  "CuPy sees a GPU and NCCL is loadable" if kind == "cuda" else f"CUDA unavailable: {cuda_problem()}")
    facts: dict = {"backend": kind, "reason": reason, "default_devices": default_devices,
                   "replica_execution": _replica_execution(kind), "gpus": [], "gpu_problem": None, "versions": versions(),
                   "missing": {name: {"for": why, "extra": extra} for name, (why, extra) in missing().items()}}
    try:
        gpus = topology.read_gpus()
    except ImportError as exc:
        facts["gpu_problem"] = f"NVML is not available: pynvml is not installed ({exc}); pip install nvidia-ml-py " \
                               f"(in distrib[cuda12] and distrib[cuda13])"
    except Exception as exc:  # pynvml.NVMLError: no driver or no libnvidia-ml on this machine
        facts["gpu_problem"] = f"NVML found no GPU: {type(exc).__name__}: {exc}"
    else:
        facts["gpus"] = [vars(g) for g in gpus]
        if not gpus:
            facts["gpu_problem"] = "NVML sees no GPU"
    return facts


def _replica_execution(kind: str | None) -> str:
    """How MirroredStrategy() would run its replicas here, and what decided it."""
    from distrib.options import replica_execution, replica_execution_is_set

    try:
        chosen = replica_execution(None)
    except ValueError as exc:
        return f"none ({exc})"
    if kind == "cuda":
        return ("threads (GPU replicas run on threads unless a strategy asks for replica_execution='cooperative', "
                "which replicas sharing one GPU allow; DISTRIB_REPLICA_EXECUTION applies to emulated replicas only)")
    if replica_execution_is_set():
        return f"{chosen} (DISTRIB_REPLICA_EXECUTION={chosen})"
    return (f"{chosen} (the default; DISTRIB_REPLICA_EXECUTION=cooperative runs emulated replicas as greenlets, as "
            f"`distrib train` does unless it is set)")


def render(facts: dict) -> list[str]:
    """The facts as plain text lines."""
    v = facts["versions"]
    lines = [f"distrib {v['distrib']} on Python {v['python']}, NumPy {v['numpy']}",
             f"backend: {facts['backend'] or 'none'} ({facts['reason']})",
             f"default devices: {', '.join(facts['default_devices']) or 'none'}",
             f"replica execution: {facts['replica_execution']}", ""]
    if facts["gpu_problem"]:
        lines.append(f"GPUs: none ({facts['gpu_problem']})")
    else:
        lines.append("GPUs:")
        for g in facts["gpus"]:
            lines.append(f"  GPU{g['index']}: {g['name']}, {g['memory_bytes'] / 2**30:.0f} GiB, compute capability "
                         f"{g['compute_capability']}, PCIe {g['pcie']}, bus {g['bus_id']}")
        lines += ["", topology.matrix([topology.GpuInfo(**g) for g in facts["gpus"]])]
    lines += ["", "versions:"]
    lines += [f"  {name:<14s}{version or 'not installed'}" for name, version in v.items()]
    if facts["missing"]:
        lines += ["", "missing:"]
        lines += [f"  {name:<14s}for {m['for']}: {_install_command(m['extra'])}"
                  for name, m in facts["missing"].items()]
    return lines


def _install_command(extras: str) -> str:
    """"distrib[a], distrib[b] or distrib[c]" -> "pip install 'distrib[a]' (or the b, c extras)": one extra to
    install, since pip reads the whole quoted string as one requirement (from a clone: its path, not the name)."""
    first, *others = [name[len("distrib["):-1] for name in re.split(r", | or ", extras)]
    extra = "extras" if len(others) > 1 else "extra"
    return pip_install(first) + (f" (or the {', '.join(others)} {extra})" if others else "")


def main(argv: list[str] | None = None) -> int:
    """Prints what distrib would use here; `--json` prints it as JSON."""
    parser = argparse.ArgumentParser(prog="distrib info", description=__doc__.split(": ", 1)[1])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Prints the facts; exit status 1 when the environment leaves distrib no backend to run on, or no way to run
    its replicas (a $DISTRIB_REPLICA_EXECUTION every strategy would refuse)."""
    facts = gather()
    status = 0 if facts["backend"] and not facts["replica_execution"].startswith("none (") else 1
    if args.json:
        print(json.dumps(facts, indent=1))
        return status
    lines = render(facts)
    if sys.stdout.isatty() and mpi_environment() is None:  # an MPI launcher's pseudo-terminal is its log
        from rich.console import Console

        Console().print("\n".join(lines), markup=False, highlight=True)
    else:
        print("\n".join(lines))
    return status
