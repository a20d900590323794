"""Run under `mpirun -np 2`, no GPU needed: the multi-process CUDA backend's deadline errors name the late rank.

Each rank joins the job's process group and its NCCL communicators' bookkeeping (JobCommunicators, which creates
no NCCL communicator until a collective runs). Both launch collective #1; rank 1 then stalls before #2. Rank 0
hands both to the CUDA watchdog with completion events that never fire, as NCCL's do when a peer never joins,
and writes the errors the watchdog raises past their deadlines to the JSON file argv[1].
"""

from __future__ import annotations

import json
import sys
import time

from distrib.backends.cuda.multi_process import JobCommunicators
from distrib.backends.cuda.watchdog import Watched
from distrib.backends.process_group import ProcessGroup


class NeverDone:
    """Stands for the CUDA event of a collective whose peer never launched it."""

    done = False


group = ProcessGroup(1)
communicators = JobCommunicators(group, [0])
aborted = []


def launch_and_wait(operation: str) -> dict:
    """What Communicators.run does around an NCCL launch, without the launch; then the caller's wait."""
    sequence = communicators._announce(operation)
    communicators.watchdog.watch(Watched(
        operation, [NeverDone()], time.monotonic() + 1.0, lambda: None, lambda: aborted.append(operation),
        lambda: communicators._late(operation, (0,), 1.0, sequence)))
    try:
        communicators.wait()
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc), "missing_ranks": list(exc.missing_ranks),
                "missing_replicas": list(exc.missing_replicas)}
    return {"type": None}


if group.rank == 1:
    communicators._announce("all_reduce")  # collective #1, then a stall before #2
    time.sleep(30)
else:
    report = {"launched_by_all": launch_and_wait("all_reduce"), "stalled": launch_and_wait("broadcast"),
              "aborted": aborted}
    try:
        group.run("barrier", lambda: None, 0.1)
    except Exception as exc:
        report["later"] = f"{type(exc).__name__}: {exc}"
    with open(sys.argv[1], "w") as file:
        json.dump(report, file)
