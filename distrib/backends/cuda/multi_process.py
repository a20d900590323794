"""The CUDA backend across processes: one NCCL communicator over every GPU of every MPI rank.

Each rank drives its share of its host's GPUs (all of them with one rank per host; a contiguous slice with
several; a shared GPU when ranks outnumber GPUs, which NCCL accepts once each rank has its own NCCL_HOSTID).
Rank 0 makes the NCCL unique id and MPI broadcasts it; every rank then creates one communicator per local GPU
inside one NCCL group, global NCCL ranks following global replica ids (a host's GPUs are neighbouring ranks).
Collectives are the single-process backend's NCCL group calls on these communicators; MEAN divides by the
global replica count, and gathers, broadcasts and reduce-scatters are sized for every replica of the job.

On GPUs: tests/gpu/test_gpu_multi_process.py (two processes sharing one H200: collectives and variable updates
through one communicator, a killed and a stalled rank) passed on 2026-11-27 once the fixes of that day were in
(bench/results/2026-11-27-h200-run2/); several GPUs per host and several hosts have not been tried.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any, Sequence

import cupy
from cupy.cuda import nccl

from distrib.backends.cuda import dtypes as cuda_dtypes
from distrib.backends.cuda import nccl as nccl_comms
from distrib.backends.cuda import errors as cuda_errors
from distrib.backends.cuda.backend import PROTOCOL_METHODS, CudaBackend
from distrib.backends.process_group import ProcessGroup
from distrib.mpi_env import mpi_environment
from distrib.errors import CollectiveError, DeadlineExceededError, WorkerFailedError
from distrib.plan import NATIVE, integer_mean, is_inexact


MAX_LEAD = 2  # collectives a rank may launch past the last one every peer has launched


def local_gpus(count: int, local_rank: int, local_size: int) -> list[int]:
    """The CUDA ordinals a rank drives: a contiguous share of the host's `count` GPUs, or one shared GPU.

    Example:
      >>> local_gpus(8, 1, 2), local_gpus(1, 1, 2)
      ([4, 5, 6, 7], [0])
    """
    if local_size <= count:
        share = count // local_size
        return list(range(local_rank * share, (local_rank + 1) * share))
    return [local_rank % count]


class JobCommunicators(nccl_comms.Communicators):
    """The job-wide communicators for this rank's GPUs, created once from a unique id broadcast over MPI."""

    def __init__(self, group: ProcessGroup, ordinals: Sequence[int]):
        super().__init__()
        self._group, self._ordinals = group, tuple(ordinals)
        group.drains.append(self.wait)  # at exit, before MPI_Finalize waits for every peer

    def _create(self, clique: nccl_comms.Clique, operation: str) -> None:
        ordinals = clique.ordinals
        if ordinals != self._ordinals:
            raise CollectiveError(f"{operation} must run on this rank's GPUs {list(self._ordinals)}. Received: "
                                  f"{list(ordinals)}.", operation=operation)
        group, received = self._group, []
        group.run(f"{operation} (creating the job's NCCL communicator)", lambda: received.append(
            group.comm.bcast(nccl.get_unique_id() if group.rank == 0 else None, root=0)), None)
        unique_id = received[0]
        clique.check_open(operation)  # not past the deadline while the ranks met: no communicator outlives it
        try:
            nccl.groupStart()  # several communicators in one thread must be created inside one group
            try:
                for k, ordinal in enumerate(ordinals):
                    with cupy.cuda.Device(ordinal):  # appended at once: a creation that hangs is aborted through it
                        clique.comms.append(nccl.NcclCommunicator(group.num_replicas, unique_id,
                                                                  group.first_replica + k))
            finally:
                nccl.groupEnd()  # a group left open would hold back every later NCCL call of this thread
        except nccl.NcclError as exc:
            raise CollectiveError(f"NCCL could not join the job's communicator from rank {group.rank} (GPUs "
                                  f"{list(ordinals)}): {exc}.", operation=operation, status=exc.status) from exc

    def _announce(self, operation: str, timeout: float | None = None) -> int:
        """Announces the collective, once no peer is more than MAX_LEAD collectives behind (within `timeout`): the
        launches return at once, so a program that never waits for a result would otherwise run past a peer that
        stalled or died, and meet the error only at exit."""
        try:
            return self._group.announce(operation, timeout, lead=MAX_LEAD)
        except DeadlineExceededError as exc:
            late = exc
        self.watchdog.settle()  # raises the error of the collective the peer never launched, if already kept
        raise late

    def _failed(self, operation: str, ordinals: tuple[int, ...], exc: Exception) -> BaseException:
        """NCCL's error of a launch or a running collective; a WorkerFailedError naming them when ranks on this host
        have died (NCCL then reports "remote process exited" before the process group notices)."""
        died = self._dead_peers(operation, ordinals, f"failed ({exc})")
        return died if died is not None else super()._failed(operation, ordinals, exc)

    def _dead_peers(self, operation: str, ordinals: tuple[int, ...], what: str) -> WorkerFailedError | None:
        """The job's WorkerFailedError (kept as the group's) if ranks on this host have died, else None."""
        group = self._group
        dead = group.dead_local_ranks()
        if not dead:
            return None
        group.broken = WorkerFailedError(
            f"{group.describe(dead)} died: {operation} on GPUs {list(ordinals)} {what}, and its communicators were "
            f"aborted. Restart the job; `--resume` continues from the last checkpoint.", ranks=dead)
        return group.broken

    def _late(self, operation: str, ordinals: tuple[int, ...], timeout: float, sequence: int | None) -> BaseException:
        """Names the ranks that never launched collective #`sequence`, as the CPU path names those that never
        reached it; a dead rank on this host is a WorkerFailedError."""
        group = self._group
        died = self._dead_peers(operation, ordinals, f"did not complete within {timeout:g} s")
        if died is not None:
            return died
        missing = group.missing(sequence)
        if missing:
            return group.missing_error(operation, timeout, sequence, missing, f" NCCL has no timeout of its own: the "
                                       f"communicators on GPUs {list(ordinals)} were aborted.")
        late = super()._late(operation, ordinals, timeout, sequence)
        return DeadlineExceededError(f"{late} Every rank launched it (collective #{sequence} of the job's "
                                     f"collectives): the stall is in a rank's GPU work or the network.",
                                     operation=operation)


class MultiProcessCudaBackend(CudaBackend):
    """CuPy arrays on this rank's GPUs; NCCL collectives span every GPU of every rank of the MPI job."""

    name = "cuda+mpi"

    def __init__(self):
        super().__init__()
        _, _, _, local_rank, local_size = mpi_environment() or (None, 0, 1, 0, 1)
        self._local = local_gpus(len(self.gpus), local_rank, local_size)
        if local_size > len(self.gpus):  # ranks share a GPU: NCCL tells them apart by host id
            os.environ.setdefault("NCCL_HOSTID", f"{socket.gethostname()}-{local_rank}")
        self.group = ProcessGroup(len(self._local))
        self._comms = JobCommunicators(self.group, self._local)

    def default_devices(self) -> tuple[str, ...]:
        return tuple(f"GPU:{k}" for k in self._local)

    def _divide(self, arrays: list[Any]) -> list[Any]:
        count = self.group.num_replicas
        out = []
        for array in arrays:
            if is_inexact(array.dtype):  # bfloat16 too, which CuPy's own division does not know
                self._divide_in_place([array], [array.device.id], count)
                out.append(array)
            else:  # integer MEAN: SUM, then true division, as TensorFlow does
                with self._on(array.device.id):
                    out.append(integer_mean(array, count))
        return out

    def execute(self, plan, per_device, devices, *, timeout=None):
        # every method is one job-wide NCCL all-reduce, as on the MPI emulator: pack by pack, this process's
        # devices would be the whole group (a hierarchical sum misses the other ranks; a ring pads each chunk to
        # the local device count, which the job-wide reduce_scatter refuses unless it divides by every replica)
        whole_job = dataclasses.replace(plan, mean=False, method=NATIVE, roots=())
        results = super().execute(whole_job, per_device, devices, timeout=timeout)
        return [self._divide(values) for values in results] if plan.mean else results

    def all_reduce(self, flats, chunks, devices, mean, *, timeout=None):
        outputs = super().all_reduce(flats, chunks, devices, False, timeout=timeout)
        return self._divide(outputs) if mean else outputs

    def _gathered_count(self, local: int) -> int:
        return self.group.num_replicas

    def gather_rows(self, rows, *, timeout=None):
        return self.group.gather_rows(rows, timeout)

    def reduce_scatter(self, flats, devices, *, timeout=None):
        # via a whole all-reduce: simple and correct; RING plans across processes are rare
        n, first = self.group.num_replicas, self.group.first_replica
        if flats[0].size % n:
            raise ValueError(f"reduce_scatter needs a length divisible by {n} replicas. Received: {flats[0].size}.")
        totals = self.all_reduce(flats, ((0, flats[0].size),), devices, False, timeout=timeout)
        part = flats[0].size // n
        return [self.copy(total[(first + k) * part:(first + k + 1) * part], device)
                for k, (total, device) in enumerate(zip(totals, devices))]

    def broadcast(self, array, devices, *, timeout=None):
        """Rank 0's first GPU's `array` on `devices` of every rank (each passes an array of that shape).

        Every GPU of the job's communicator takes part, whichever `devices` are asked for.
        """
        mine = self.default_devices()
        outputs = [self.copy(array, d) for d in mine]
        nbytes = outputs[0].nbytes

        def launch(rank, comm, stream):
            comm.broadcast(outputs[rank].data.ptr, outputs[rank].data.ptr, nbytes, cuda_dtypes.BYTES, 0, stream)

        if nbytes:
            self._group("broadcast", self._local, launch, timeout)
        return [outputs[mine.index(d)] for d in devices]

    def __repr__(self) -> str:
        return f"<MultiProcessCudaBackend rank={self.group.rank} of {self.group.size}, GPUs={self._local}>"


# Its own methods leave with distrib's errors too, as CudaBackend's do (the integer mean's division, the copies).
for _name in PROTOCOL_METHODS:
    if _name in vars(MultiProcessCudaBackend):
        setattr(MultiProcessCudaBackend, _name, cuda_errors.translating(vars(MultiProcessCudaBackend)[_name]))
