"""A thread that ends this rank with a typed error when a peer dies or stalls while this rank is inside an MPI call.

A blocking MPI call cannot be interrupted: a peer that dies in the middle of a transfer leaves this rank inside
it, where no Python code of its thread runs again (mpirun then sends SIGTERM and, one second later, SIGKILL).
This thread runs while that thread is in MPI (mpi4py releases the GIL there). While a channel is inside a call,
it checks every `POLL_SECONDS` whether a peer on this host has exited, and it wakes at once on SIGTERM (through
`signal.set_wakeup_fd`). Then it prints the WorkerFailedError naming the dead ranks and ends this process with
status 1, as an uncaught exception would; a call past its collective timeout prints a DeadlineExceededError and
aborts the MPI job, so no rank waits forever. Outside a call the calling thread itself raises (process_group.py).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable

from distrib.errors import DeadlineExceededError, WorkerFailedError
from distrib.options import default_timeout

POLL_SECONDS = 0.05
GRACE_SECONDS = 0.2  # a call still running this long after a peer exited did not just finish as it exited
TERMINATED_GRACE_SECONDS = 0.1  # after SIGTERM: Open MPI 5's mpirun sends SIGKILL 0.25 s later (4: 1 s), so the
#                                 error must be out well before
RESTART = "Restart the job; `--resume` continues from the last checkpoint."  # after a rank failed, not a Ctrl-C


class CallWatchdog:
    """Watches `group`'s channels from a daemon thread; `start()` once, from the main thread.

    Args:
      group: the ProcessGroup whose channels (`group.channels`) it watches.
      end: how the process ends after the error is printed (tests pass their own); default `os._exit(1)`.
    """

    def __init__(self, group: Any, end: Callable[[BaseException], None] | None = None):
        self.group = group
        self._end = end or _exit
        self._wake, self._wakeup = socket.socketpair()
        for sock in (self._wake, self._wakeup):
            sock.setblocking(False)
        self.terminated_at: float | None = None  # when SIGTERM last arrived (mpirun ending the job)
        # why mpirun is ending it, read as its SIGTERM arrives: a peer that exits because of the same SIGTERM a moment
        # later, while this rank's main thread has not handled it yet, must not be taken for the cause
        self.ending: tuple[str, tuple[int, ...], str] | None = None  # ProcessGroup.launcher_ending()
        self.fired: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="distrib-mpi-watchdog", daemon=True)

    def start(self) -> None:
        """Starts the thread; routes signals to it unless the program already has a wakeup fd (e.g. asyncio)."""
        if threading.current_thread() is threading.main_thread():
            try:
                previous = signal.set_wakeup_fd(self._wakeup.fileno(), warn_on_full_buffer=False)
            except ValueError:  # not the main interpreter
                previous = -1
            if previous != -1:
                signal.set_wakeup_fd(previous)  # keep the program's; dead peers are still found by polling
            else:  # a forked child has no watchdog: its signals must not wake the parent's
                os.register_at_fork(after_in_child=_forget_wakeup_fd)
        self._thread.start()

    def _run(self) -> None:
        while self.fired is None:
            select.select([self._wake], [], [], POLL_SECONDS)
            try:
                if signal.SIGTERM in self._wake.recv(256):
                    self.ending = self.group.launcher_ending()
                    self.terminated_at = time.monotonic()
            except BlockingIOError:
                pass
            self.check()

    def check(self) -> None:
        """One look at the channels: fires when one is inside a call that a failed peer keeps from returning."""
        for channel in self.group.channels:
            call = channel.in_call
            if call is None:
                continue
            error = self._failure(channel, call)
            if error is not None and channel.in_call is call:
                self.fire(error)
                return

    def _failure(self, channel: Any, call: Any) -> BaseException | None:
        group = self.group
        terminated = self.terminated_at is not None and self.terminated_at >= call.started  # earlier: raised
        dead = () if terminated else group.dead_local_ranks()
        if dead or terminated:
            # a call whose peers are all there may still return, to raise in Python
            time.sleep(TERMINATED_GRACE_SECONDS if terminated else GRACE_SECONDS)
            if channel.in_call is not call:
                return None
            if terminated:
                who, dead, restart = self.ending
                who = f"the MPI launcher is ending the job (SIGTERM): {who}"
            else:
                who, restart = f"{group.describe(dead)} died", RESTART
            return WorkerFailedError(
                f"{who} during {call.operation} (collective #{call.sequence} of the job's {channel.name}), while "
                f"rank {group.rank} was inside the MPI call, which cannot return without it: rank {group.rank} ends "
                f"now. {restart}".rstrip(), ranks=dead)
        limit = call.timeout if call.timeout is not None else default_timeout()
        if time.monotonic() - call.started > limit:
            stopped = group.stopped_local_ranks()
            stalled = f"{group.describe(stopped)}, stopped," if stopped else "a rank (none on this host is stopped)"
            return DeadlineExceededError(
                f"{call.operation} across processes did not complete within {limit:g} s (collective #{call.sequence} "
                f"of the job's {channel.name}): every rank reached it, and {stalled} stalled inside it. Rank "
                f"{group.rank} aborts the MPI job. Raise CommunicationOptions(timeout_seconds=...) if the work is "
                f"just slow.", operation=call.operation, missing_ranks=stopped,
                missing_replicas=group.replicas_of(stopped))
        return None

    def fire(self, error: BaseException) -> None:
        """Records `error` as the group's failure, prints it as an uncaught exception would be, ends the process."""
        self.fired = self.group.broken = error
        self.group.say_last_words(error)  # what the program says as it ends, its main thread being stuck here
        if isinstance(error, DeadlineExceededError):
            self.group.comm.Abort(1)  # nobody else ends the job: every rank, the stalled one too
        self._end(error)

    def __repr__(self) -> str:
        return f"<CallWatchdog rank={self.group.rank} alive={self._thread.is_alive()}>"


def _forget_wakeup_fd() -> None:
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # not the main thread
        pass


def _exit(error: BaseException) -> None:
    sys.stdout.flush()
    os._exit(1)
