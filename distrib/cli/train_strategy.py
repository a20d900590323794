"""How `distrib train` sets up: its strategy and devices (`--replicas`, mpirun), compute dtype and BLAS threads."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys

import numpy as np

from distrib.backends import detect, get_backend
from distrib.backends.parallel import usable_cores
from distrib.install_hint import pip_install
from distrib.options import replica_execution_is_set
from distrib.mirrored import MirroredStrategy
from distrib.mpi_env import mpi_environment
from distrib.multi_worker import MultiWorkerMirroredStrategy
from distrib.strategy import Strategy


def compute_dtype(precision: str, xp):
    """The array dtype for `--precision` on this array module; ValueError where it has none."""
    if precision != "bfloat16":
        return xp.dtype(precision)
    if xp is not np:
        # The reason given is out of date: CuPy 14 holds ml_dtypes' bfloat16 (the CUDA backend reduces it, its GPU
        # tests check that). What has not run on a GPU is the model's bfloat16 forward and backward passes (CuPy's
        # matmul and elementwise ops in bfloat16), so the refusal stays until a GPU run shows they train.
        raise ValueError(f"--precision bfloat16 is not available: {xp.__name__} has no bfloat16 arrays. "
                         f"Use --precision float16.")
    if importlib.util.find_spec("ml_dtypes") is None:
        raise ValueError("--precision bfloat16 on the CPU emulator needs ml_dtypes (NumPy has no bfloat16 of its "
                         "own): pip install ml_dtypes, or use --precision float16.")
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


def replica_devices(replicas: int | None, available: tuple[str, ...]) -> list[str] | None:
    """The devices of `--replicas N`: N of the GPUs (cycling over them when there are fewer), else N emulated CPUs.

    `available` is the backend's default devices; None keeps them all.
    """
    if replicas is None:
        return None
    gpus = [device for device in available if device.startswith("GPU:")]
    if gpus:
        return [gpus[i % len(gpus)] for i in range(replicas)]
    return [f"CPU:{i}" for i in range(replicas)]


def blas_threads(replicas: int, cores: int) -> int:
    """Each replica's BLAS threads: the cores but one (the driving thread's: input, merges) shared out, at least 1.

    Replicas run their matmuls at once, so a BLAS that spreads each over every core oversubscribes them, and its
    spinning threads then wait on each other: 1 replica on 2 cores with 2 OpenBLAS threads ran 20x slower.
    """
    return max(1, (cores - 1) // replicas)


def replicas_at_once(strategy: Strategy) -> int:
    """How many of this process's replicas compute at the same time: all of them on threads, one when they are
    cooperative (they take turns, so each matmul may have the cores that replicas on threads share)."""
    extended = strategy.extended
    return 1 if extended.replica_execution == "cooperative" else len(extended.worker_devices)


@contextlib.contextmanager
def shared_cores(replicas: int):
    """Limits BLAS and OpenMP to `blas_threads` inside the block (threadpoolctl: any BLAS); yields the limit."""
    if importlib.util.find_spec("threadpoolctl") is None:
        print("distrib train: threadpoolctl is not installed, so BLAS threads are not shared among the replicas "
              f"({pip_install('train')}).", file=sys.stderr)
        yield None
        return
    from threadpoolctl import threadpool_limits

    threads = blas_threads(replicas, usable_cores())
    with threadpool_limits(limits=threads):
        yield threads


class AlikeOnEveryRank(ValueError):
    """A refusal every rank of an MPI job makes alike (from what the job agreed on), which rank 0 alone says."""


def make_strategy(args: argparse.Namespace) -> Strategy:
    """The MirroredStrategy `--replicas` asks for, or under `mpirun -np N` (N > 1) a MultiWorkerMirroredStrategy
    with `--replicas` emulated replicas per process; ValueError if the batch or precision cannot run on it."""
    launched = mpi_environment()
    if launched is not None and launched[2] > 1:
        if args.replicas is not None:
            if detect() != "cpu":
                raise ValueError("--replicas sets the emulated replicas of each process; under mpirun on GPUs each "
                                 f"process drives its share of the host's GPUs. Received: --replicas {args.replicas}.")
            os.environ["DISTRIB_CPU_REPLICAS"] = str(args.replicas)
        strategy = MultiWorkerMirroredStrategy(replica_execution=replica_execution())
    else:
        devices = None if args.replicas is None else replica_devices(args.replicas, get_backend().default_devices())
        strategy = MirroredStrategy(devices, replica_execution=replica_execution())
    replicas = strategy.num_replicas_in_sync
    if args.global_batch_size % replicas:
        raise AlikeOnEveryRank(f"--global-batch-size must divide evenly over the {replicas} replicas, so that "
                               f"every replica's batch mean weighs rows equally. Received: {args.global_batch_size}.")
    compute_dtype(args.precision, strategy.extended.backend.xp)
    return strategy


def replica_execution() -> str | None:
    """Emulated replicas train cooperatively unless $DISTRIB_REPLICA_EXECUTION says otherwise: the step has no
    Python shared between replicas, and on the emulator it ran 35-65 % more samples/s than with replica threads."""
    if replica_execution_is_set() or detect() != "cpu":
        return None
    return "cooperative"
