"""Run under `mpirun -np 2`: rank 1 fails at the 3rd step, and rank 0 must get a typed error naming rank 1.

argv[1] is the fault: "kill" (SIGKILL before the step's collective), "stall" (sleep instead of reaching it),
"raise" (an exception the program does not catch), "exit" (`sys.exit(3)`: the program ends early), "kill-mid" (SIGKILL while both ranks are inside the MPI call
of a 32 MB all-reduce) or "stop-mid" (SIGSTOP there). argv[2] is the JSON file rank 0 writes the error it caught
to; argv[3] the collective timeout in seconds.
Inside an MPI call no error can be caught: rank 0's watchdog prints it and ends the process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import numpy as np

import distrib

mode, report_path = sys.argv[1], sys.argv[2]
strategy = distrib.MultiWorkerMirroredStrategy(
    communication_options=distrib.CommunicationOptions(timeout_seconds=float(sys.argv[3])))
rank = strategy.cluster_resolver.task_id
size = 8 << 20 if mode.endswith("-mid") else 1000  # float32 elements


def step():
    return distrib.get_replica_context().all_reduce("SUM", np.ones(size, np.float32))


def signal_inside_the_next_call(signum):
    """Sends `signum` to this process once its thread is inside the MPI call (the fault injector's only peek
    inside)."""
    channel = strategy.extended._group.channels[0]
    while channel.in_call is None:
        time.sleep(0.0005)
    time.sleep(0.002)
    os.kill(os.getpid(), signum)


began = time.monotonic()
try:
    for i in range(5):
        if i == 2 and rank == 1:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif mode == "raise":
                raise ValueError("a bug in rank 1's program")
            elif mode == "exit":
                sys.exit(3)
            elif mode.endswith("-mid"):
                signum = signal.SIGKILL if mode == "kill-mid" else signal.SIGSTOP
                threading.Thread(target=signal_inside_the_next_call, args=(signum,), daemon=True).start()
            else:
                time.sleep(3600)
        strategy.run(step)
        began = time.monotonic()
except distrib.errors.DistribError as exc:
    report_path += f".{rank}"
    with open(report_path, "w") as file:
        json.dump({"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - began,
                   "missing_ranks": list(getattr(exc, "missing_ranks", ())),
                   "ranks": list(getattr(exc, "ranks", ()))}, file)
    try:  # the job is broken: a later collective fails at once instead of waiting again
        strategy.run(step)
    except distrib.errors.WorkerFailedError as later:
        with open(report_path + ".later", "w") as file:
            file.write(str(later))
    raise
