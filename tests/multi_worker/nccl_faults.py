"""Run under `mpirun -np 2`, no GPU needed: a rank fails while the other launches NCCL collectives, which return at
once and are never waited for; rank 0 must still get a typed error naming rank 1, and the job must end.

The multi-process CUDA backend's NCCL bookkeeping (JobCommunicators) runs as it does on GPUs, with stand-ins for
the communicators and their launches: a collective's completion event is done once every rank has launched it, as
NCCL's is once every rank has joined. Each rank launches all-reduces; rank 1 fails before the 3rd.
argv[1] is the fault: "kill" (SIGKILL), "stall" (sleep instead), or "stall-at-exit" (sleep, while rank 0 launches
only 3 collectives and ends its program normally, the 3rd still in flight). argv[2] is the JSON file each rank writes
the error it caught to (+ `.rank`), argv[3] the collective timeout in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from distrib.backends.cuda.multi_process import JobCommunicators
from distrib.backends.process_group import ProcessGroup
from distrib.errors import DistribError, WorkerFailedError

mode, report_path, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
group = ProcessGroup(1)


class Launched:
    """The completion event of collective #`sequence`: done once every rank has launched it."""

    def __init__(self, sequence: int):
        self.sequence = sequence

    @property
    def done(self) -> bool:
        return not group.missing(self.sequence)


class Communicator:
    def abort(self) -> None:
        pass

    def check_async_error(self) -> None:
        pass


class StandIns(JobCommunicators):
    """JobCommunicators whose communicators and launches are stand-ins (no GPU, no NCCL)."""

    def _create(self, clique, operation):
        clique.comms.append(Communicator())

    def _announce(self, operation, timeout=None):
        self.sequence = super()._announce(operation, timeout)
        return self.sequence

    def _launch(self, clique, streams, launch):
        return [Launched(self.sequence)]


communicators = StandIns(group, [0])


def all_reduce() -> None:
    communicators.run("all_reduce", [0], [None], lambda rank, comm, stream: None, timeout)


began = time.monotonic()
try:
    for i in range(3 if mode == "stall-at-exit" and group.rank == 0 else 5):
        if i == 2 and group.rank == 1:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        all_reduce()
        began = time.monotonic()
except DistribError as exc:
    report_path += f".{group.rank}"
    with open(report_path, "w") as file:
        json.dump({"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - began}, file)
    try:  # the job is broken: a later collective fails at once instead of waiting again
        all_reduce()
    except WorkerFailedError as later:
        with open(report_path + ".later", "w") as file:
            file.write(str(later))
    raise
