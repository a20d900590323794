"""How the thread that called a threaded run waits on its replicas: for each phase, within the run's deadline and
each collective's timeout, and for a failed run's other replicas to stop."""

from __future__ import annotations

import time
from typing import Sequence

from distrib.errors import DeadlineExceededError
from distrib.replica_threads import RUNNING, WAITING, ReplicaThread, Run

POLL_SECONDS = 0.05  # how often a wait looks at the clock (and a run lock's waiter for a deadlock)
_UNWIND_SECONDS = 0.1  # how long an interrupted run waits for its replicas to unwind before replacing threads


def wait_for_phase(run: Run, threads: list[ReplicaThread]) -> None:
    """Waits until every replica of `run` reported for this phase; DeadlineExceededError past the run's deadline, or
    past a collective's timeout counted from the first replica to reach it."""
    while not run.phase_done.acquire(timeout=POLL_SECONDS):
        if run.deadline is not None and time.monotonic() >= run.deadline:
            late = [i for i, s in enumerate(run.status) if s == RUNNING]
            raise DeadlineExceededError(
                f"Strategy.run did not finish within RunOptions(timeout_seconds=...): replicas {late} are "
                f"still running their function.\n{_stacks(threads, late)}",
                missing_replicas=tuple(late), operation="run")
        with run.lock:
            first = run.first_arrival
            if first is None or run.woken:
                continue
            arrived = [i for i, s in enumerate(run.status) if s == WAITING]
            kind, _, _, timeout = run.requests[arrived[0]]
            limit = timeout if timeout is not None else run.default_timeout
            if time.monotonic() - first < limit:
                continue
            missing = tuple(i for i, s in enumerate(run.status) if s == RUNNING)
        raise DeadlineExceededError(
            f"{kind} timed out after {limit:g} s waiting for replicas {list(missing)} (replicas {arrived} "
            f"arrived). Every replica must make the same collective calls in the same order; a replica "
            f"that skips one, or is stuck before it, stalls the others. Raise "
            f"CommunicationOptions(timeout_seconds=...) or $DISTRIB_COLLECTIVE_TIMEOUT if the work is "
            f"just slow.\n{_stacks(threads, missing)}", missing_replicas=missing, operation=kind)


def patience(run: Run, exc: BaseException) -> float:
    """How long a failed run waits for its other replicas to stop before it replaces their threads.

    An error in user code waits for them (up to the collective timeout), so that no replica function still
    runs once `run` has returned; a Ctrl-C or a timeout waits only for replicas already unwinding.
    """
    if not isinstance(exc, Exception) or isinstance(exc, DeadlineExceededError):
        return _UNWIND_SECONDS
    if run.deadline is None:
        return run.default_timeout
    return min(run.default_timeout, max(run.deadline - time.monotonic(), _UNWIND_SECONDS))


def _stacks(threads: list[ReplicaThread], replicas: Sequence[int]) -> str:
    return "".join(f"Replica {i} is at:\n{threads[i].stack()}" for i in replicas)
