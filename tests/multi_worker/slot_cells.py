"""Run under `mpirun -np 2` (shared-memory announcements); rank 1 writes what it saw to the JSON file argv[1].

A peer's slot keeps the signatures of its last two collectives, each beside its collective's number. Rank 0 is
put two collectives ahead of rank 1, as launches with a lead may run: a collective n announced with signature X,
then n + 1 refused, then n + 2 with signature Y, which overwrites n's cell. Rank 1 then makes n with X (its cell
now says n + 2: no mismatch may be read into it), n + 1 (refused: it must raise), and n + 2 with Y. Then a
refusal waits until the peer reaches the refused collective, and real collectives pair up after all of it.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from mpi4py import MPI

from distrib.backends.signatures import REFUSED, signature
from distrib.backends.mpi import MpiBackend
from distrib.errors import CollectiveMismatchError

backend = MpiBackend(1)
group, devices = backend.group, backend.default_devices()
channel = group.collectives
comm = MPI.COMM_WORLD
report: dict = {"slots": bool(channel._near) and not channel._peers}
X = signature("first", ((4, np.dtype(np.float32)),))
Y = signature("third", ((8, np.dtype(np.float64)),))
first = channel.sequence + 1
comm.barrier()
if group.rank == 0:  # what announcing n, refusing n + 1 and announcing n + 2 leaves in its slot
    for number, mark in ((first, X), (first + 1, REFUSED), (first + 2, Y)):
        channel._slot[2 - (number & 1)] = mark << 16 | number & 0xFFFF
        channel._slot[0] = number
    channel.sequence = first + 2
comm.barrier()
if group.rank == 1:
    made = []
    channel.run("first", lambda: made.append("first"), 10, X)
    try:
        channel.run("second", lambda: made.append("second"), 10, signature("second", ((4, np.dtype(np.int32)),)))
        report["refused"] = "not raised"
    except CollectiveMismatchError as error:
        report["refused"] = str(error)
    channel.run("third", lambda: made.append("third"), 10, Y)
    report["made"] = made
comm.barrier()
# a refusal returns once every peer has reached the refused collective (rank 0 comes 0.3 s late)
if group.rank == 1:
    start = time.perf_counter()
    channel.refuse()
    report["refusal waited"] = time.perf_counter() - start
else:
    time.sleep(0.3)
    try:
        backend.all_reduce([np.ones(3, np.float32)], ((0, 3),), devices, False, timeout=10)
        report["peer of the refusal"] = "not raised"
    except CollectiveMismatchError as error:
        report["peer of the refusal"] = str(error)
(total,) = backend.all_reduce([np.array([group.rank + 1.0])], ((0, 1),), devices, False, timeout=10)
report["sum after"] = float(total[0])
everything = comm.allgather(report)
if group.rank == 1:
    with open(sys.argv[1], "w") as file:
        json.dump({"rank 0": everything[0], "rank 1": everything[1]}, file)
