"""Run under `mpirun -np 2` with one emulated replica per process; rank 0 writes what it saw to the JSON file argv[1].

First the MPI backend's all-reduce in the shapes one replica per process takes (its own buffer sent as MPI sums
it, float16 summed as float32, chunked calls, means); then rank 0 runs thousands of announcements ahead of rank 1,
which does not poll meanwhile. By message ($DISTRIB_MPI_ANNOUNCEMENTS=messages) they fill the transport's queue,
so some go out while an earlier one is still in flight, and every one must still arrive, in order; in shared
memory each overwrites the last. Either way the collectives after them must pair up. Last, rank 1 leaves the job
and rank 0, about to wait for it, must learn that it left.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
import time

import numpy as np

import distrib

from distrib.backends.mpi import MpiBackend

AHEAD = 3000
if os.environ.get("ONE_RANK_WANTS_MESSAGES") and os.environ.get("OMPI_COMM_WORLD_RANK") == "1":
    os.environ["DISTRIB_MPI_ANNOUNCEMENTS"] = "messages"  # rank 1 only: the host's ranks must agree on messages
backend = MpiBackend(1)
group, devices = backend.group, backend.default_devices()
report: dict = {}
for dtype in ("float32", "float16", "int32"):
    for size in (10, 1 << 15):  # below and above the buffer pool's threshold
        values = np.arange(size) % 100
        mine = (values * (group.rank + 1)).astype(dtype)  # summed over the 2 ranks: 3 * values
        cases = [("sum", ((0, size),), False), ("chunked sum", ((0, 3), (3, size)), False)]
        for name, chunks, mean in cases + [("mean", ((0, size),), True)] * (dtype != "int32"):  # of floats only
            (result,) = backend.all_reduce([mine], chunks, devices, mean)
            expected = values * (1.5 if mean else 3)
            report[f"{name} of {size} {dtype}"] = bool(np.array_equal(result, expected.astype(result.dtype))) and \
                not result.flags.writeable and not np.shares_memory(result, mine)

channel = group.channels[0]
sent_while_in_flight = 0
if group.rank == 0:
    for _ in range(AHEAD):
        group.announce()
        sent_while_in_flight = max(sent_while_in_flight, len(channel._stamps))
else:
    time.sleep(1.0)  # does not poll: rank 0's announcements pile up
    for _ in range(AHEAD):
        group.announce()
group.barrier("the barrier after the flood", timeout=20)
(total,) = backend.all_reduce([np.array([group.rank + 1.0])], ((0, 1),), devices, False, timeout=20)
report["flood"] = {"by message": list(channel._peers), "in shared memory": list(channel._near),
                   "boards left behind": glob.glob(os.path.join(tempfile.gettempdir(), "distrib-announcements-*")) +
                   glob.glob("/dev/shm/distrib-announcements-*"),
                   "sent_while_in_flight": sent_while_in_flight, "missing": list(group.missing(channel.sequence)),
                   "sum after": float(total[0])}
# launches (NCCL's collectives are asynchronous) run at most `lead` collectives ahead of the slowest peer: rank 0's
# third waits until rank 1, half a second late, has announced its first
began = time.monotonic()
if group.rank == 1:
    time.sleep(0.5)
for _ in range(3):
    group.announce("a launch", timeout=10, lead=2)
report["lead"] = {"waited": time.monotonic() - began}
group.barrier("the barrier after the launches", timeout=20)
# rank 1 leaves (as its program's end does): rank 0, waiting for a next collective, is told so, and the error it
# raises names rank 1 as gone rather than late; so does a launch more than `lead` collectives past rank 1's last
if group.rank == 1:
    for each in group.channels:
        each.leave()
else:
    until = time.monotonic() + 10
    while channel.left_error("all_reduce", channel.sequence + 1, group.missing(channel.sequence + 1)) is None \
            and time.monotonic() < until:
        time.sleep(0.001)
    error = group.missing_error("all_reduce", 5.0, channel.sequence + 1, group.missing(channel.sequence + 1))
    report["left"] = {"missing": list(group.missing(channel.sequence + 1)), "type": type(error).__name__,
                      "ranks": list(error.ranks), "message": str(error)}
    group.broken = None
    launched = 0
    try:
        for _ in range(3):
            group.announce("a launch", timeout=10, lead=2)
            launched += 1
    except distrib.errors.WorkerFailedError as exc:
        report["left"]["launch"] = {"launched": launched, "ranks": list(exc.ranks), "message": str(exc)}
    group.broken = None  # this job goes on to end normally
if group.rank == 0:
    with open(sys.argv[1], "w") as file:
        json.dump(report, file)
