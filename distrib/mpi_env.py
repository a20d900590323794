"""This process's place in an MPI job (rank, size, local rank), read from the launcher's environment variables."""

from __future__ import annotations

import os

# (rank, size, local rank, local size) as each launcher names them; Slurm's srun is read by SlurmClusterResolver.
_MPI_ENVIRONMENTS = (
    ("Open MPI", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                  "OMPI_COMM_WORLD_LOCAL_SIZE")),
    ("MPICH", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")),
    ("PMI", ("PMI_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE")),
    ("PMIx", ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE")),
)


def env_int(name: str) -> int:
    """The environment variable `name` as an integer; a ValueError naming it when it is not one."""
    raw = os.environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer. Received: {raw!r}.") from None


def mpi_environment() -> tuple[str, int, int, int, int] | None:
    """(launcher, rank, size, local rank, local size) from the MPI launcher's environment; None outside one."""
    for launcher, (rank, size, local_rank, local_size) in _MPI_ENVIRONMENTS:
        if rank in os.environ and size in os.environ:
            has_local = local_rank in os.environ and local_size in os.environ
            return (launcher, env_int(rank), env_int(size), env_int(local_rank) if has_local else 0,
                    env_int(local_size) if has_local else 1)
    return None


def reports_for_the_job() -> bool:
    """Whether this process says what every rank of its job finds alike (a bad flag): alone, or rank 0 of an MPI
    job, so that such a message is printed once rather than once per rank."""
    launched = mpi_environment()
    return launched is None or launched[1] == 0
