"""Where `distrib bench` runs: one process driving every device, or under `mpirun -np N` one rank of a job
whose every device of every process is one rank of each collective (MultiWorkerMirroredStrategy)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Sequence

from distrib.mpi_env import mpi_environment


@dataclass(frozen=True)
class Job:
    """The processes of one `distrib bench` run, with nccl-tests' multi-process conventions.

    Each process times its own calls; a row's time is their mean over the processes and its `#wrong` their sum
    (nccl-tests' defaults); rank 0 alone prints and writes files.

    Args:
      comm: an mpi4py communicator of the job's processes (for the raw series, the barriers and the results);
        None when this process runs alone.
      first: the global rank of this process's first device.
      local: how many devices this process drives.
      ranks: every device of every process: the n of the bus bandwidth.

    Example:
      >>> Job(None, 0, 4, 4).mean(2.5), Job(None, 0, 4, 4).chief
      (2.5, True)
    """

    comm: Any
    first: int
    local: int
    ranks: int

    @property
    def processes(self) -> int:
        """How many processes the run spans."""
        return 1 if self.comm is None else self.comm.Get_size()

    @property
    def chief(self) -> bool:
        """Whether this process prints the table and writes the files (rank 0)."""
        return self.comm is None or self.comm.Get_rank() == 0

    def barrier(self) -> None:
        """Waits for every process, so that a timed loop starts together everywhere."""
        if self.comm is not None:
            self.comm.Barrier()

    def mean(self, value: float) -> float:
        """`value` averaged over the processes."""
        return value if self.comm is None else self.comm.allreduce(value) / self.processes

    def total(self, value: int | None) -> int | None:
        """`value` summed over the processes (None stays None: nothing was checked)."""
        return value if self.comm is None or value is None else self.comm.allreduce(value)

    def every_line(self, lines: Sequence[str]) -> list[str]:
        """Every process's `lines`, in rank order."""
        if self.comm is None:
            return list(lines)
        return [line for part in self.comm.allgather(list(lines)) for line in part]

    def __repr__(self) -> str:
        return f"<Job ranks {self.first}..{self.first + self.local - 1} of {self.ranks} on {self.processes} processes>"


def launched_processes() -> int:
    """How many processes the MPI launcher started (1 outside mpirun)."""
    launched = mpi_environment()
    return 1 if launched is None else launched[2]


def multi_worker(devices_per_process: int | None, backend_kind: str) -> tuple[Any, Job]:
    """A MultiWorkerMirroredStrategy over every process of the MPI job, and the Job it runs as.

    Raises:
      BackendUnavailableError: mpi4py cannot be imported (the strategy says what to install).
      ValueError: -g on GPUs (each process drives its share of the host's GPUs), or processes with different
        device counts.
    """
    from distrib.multi_worker import MultiWorkerMirroredStrategy

    if devices_per_process is not None:
        if backend_kind != "cpu":
            raise ValueError(f"-g sets the emulated devices of each process; under mpirun on GPUs each process "
                             f"drives its share of the host's GPUs. Received: -g {devices_per_process}.")
        os.environ["DISTRIB_CPU_REPLICAS"] = str(devices_per_process)
    strategy = MultiWorkerMirroredStrategy()
    group = strategy.extended.backend.group
    if len(set(group.replica_counts)) > 1:
        raise ValueError(f"distrib bench needs the same number of devices in every process, as nccl-tests does. "
                         f"Received: {list(group.replica_counts)} per rank.")
    job = Job(group.MPI.COMM_WORLD.Dup(), group.first_replica, len(strategy.extended.worker_devices), group.num_replicas)
    return strategy, job


def device_lines(backend_kind: str, backend: Any, devices: Sequence[str], job: Job) -> list[str]:
    """nccl-tests' "Using devices" lines for every rank of every process."""
    pid, host = os.getpid(), socket.gethostname()
    if backend_kind == "cpu":
        mine = [f"#  Rank {job.first + i:2d} Pid {pid:6d} on {host:>10s} device {d} (emulated on NumPy)"
                for i, d in enumerate(devices)]
    else:
        gpus = {f"GPU:{k}": gpu for k, gpu in enumerate(backend.gpus)}
        mine = [f"#  Rank {job.first + i:2d} Pid {pid:6d} on {host:>10s} device {d.split(':')[1]:>2s} "
                f"[{gpus[d].pci_bus_id}] {gpus[d].name}" for i, d in enumerate(devices)]
    return job.every_line(mine)


def label(backend_kind: str, backend: Any, job: Job) -> str:
    """The device label of titles and file names: what ran, emulated or not, and on how many processes."""
    if backend_kind == "cpu":
        if job.processes == 1:
            return f"CPU emulator, {job.ranks} emulated devices on {os.cpu_count()} cores (NumPy)"
        return (f"cpu-emulated, {job.processes} processes x {job.local} emulated device"
                f"{'s' if job.local > 1 else ''} on {os.cpu_count()} cores (NumPy over MPI)")
    name = backend.gpus[0].name
    return f"{job.ranks} x {name}" + (f", {job.processes} processes" if job.processes > 1 else "")
