"""NCCL communicators for one process driving several GPUs: creation, group calls, the watchdog, error translation.

A group call is launched and handed to the watchdog (backends/watchdog.py) with an event recorded on each
device's stream; the caller returns at once, so collectives pipeline on the streams as NCCL's own do. NCCL has no
timeout: a collective whose peer never starts spins forever, and errors on the network arrive asynchronously. So
the watchdog's thread polls the events and the communicators' asynchronous errors, and past the deadline aborts the
communicators of that call; the error (DeadlineExceededError, CollectiveError) is raised at the next
synchronisation point: the next collective, `wait()`, or a copy to the host. Failed communicators are dropped; the
next collective on those devices creates new ones.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import cupy
from cupy.cuda import nccl

from distrib.backends.cuda.errors import NCCL_HINT as HINT
from distrib.backends.cuda.watchdog import Watchdog, Watched
from distrib.errors import CollectiveError, DeadlineExceededError

Launch = Callable[[int, Any, int], None]  # (rank, communicator, stream pointer): issues the rank's NCCL calls
ABORT_LOCK_SECONDS = 1.0  # how long an abort waits for a launch in progress to leave NCCL


def version() -> int:
    """The loaded NCCL's version code (X*10000+Y*100+Z since 2.9)."""
    return nccl.get_version()


class Communicators:
    """One communicator per device for each tuple of distinct CUDA ordinals, made with `initAll` on first use.

    Every group call of the process is serialised, whatever its tuple: a communicator must never be used by two
    threads at once, and two tuples that share a GPU must queue their kernels on its stream in the same order as
    on their other shared GPUs ((0, 1) and (1, 0) launched by two threads at once could otherwise queue in
    opposite orders on the two streams and wait for each other forever). Launches return at once, so the lock is
    held for microseconds.
    """

    def __init__(self):
        self._groups: dict[tuple[int, ...], list[Any]] = {}
        self._launch_lock = threading.RLock()  # reentrant: a launch that fails aborts its communicators under it
        self._lock = threading.Lock()
        self.watchdog = Watchdog()

    def _communicators(self, ordinals: tuple[int, ...], operation: str) -> list[Any]:
        comms = self._groups.get(ordinals)
        if comms is None:
            try:
                with cupy.cuda.Device(ordinals[0]):  # initAll switches devices; restore the current one after
                    comms = nccl.NcclCommunicator.initAll(list(ordinals))
            except nccl.NcclError as exc:
                raise CollectiveError(f"NCCL could not create communicators for GPUs {list(ordinals)} ({exc}). "
                                      f"{HINT}", operation=operation, status=exc.status) from exc
            self._groups[ordinals] = comms
        return comms

    def check(self) -> None:
        """Raises the error of a collective that failed since the last check (see the module docstring)."""
        self.watchdog.check()

    def wait(self) -> None:
        """Blocks until every launched collective has completed or failed; raises the first failure."""
        self.watchdog.wait()

    def run(self, operation: str, ordinals: Sequence[int], streams: Sequence[Any], launch: Launch,
            timeout: float) -> None:
        """Issues `launch` for every rank inside one NCCL group and hands the call to the watchdog; returns at once.

        Raises:
          DeadlineExceededError, CollectiveError: an earlier collective failed (raised once, here or at the next
            synchronisation point); or NCCL or CUDA refused this launch, whose communicators were then aborted.
        """
        self.watchdog.check()
        ordinals = tuple(ordinals)
        sequence = self._announce(operation)
        with self._launch_lock:
            comms = self._communicators(ordinals, operation)
            try:
                nccl.groupStart()
                try:
                    for rank, (ordinal, comm, stream) in enumerate(zip(ordinals, comms, streams)):
                        with cupy.cuda.Device(ordinal):
                            launch(rank, comm, stream.ptr)
                finally:
                    nccl.groupEnd()
                events = []
                for ordinal, stream in zip(ordinals, streams):
                    with cupy.cuda.Device(ordinal):
                        events.append(stream.record(cupy.cuda.Event(disable_timing=True)))
            except (nccl.NcclError, cupy.cuda.runtime.CUDARuntimeError) as exc:
                self._abort(ordinals, comms)
                raise self._failed(operation, ordinals, exc) from exc
        self.watchdog.watch(Watched(operation, events, time.monotonic() + timeout,
                                    poll_errors=lambda: self._poll_errors(operation, ordinals, comms),
                                    abort=lambda: self._abort(ordinals, comms),
                                    timeout_error=lambda: self._late(operation, ordinals, timeout, sequence)))

    def _poll_errors(self, operation: str, ordinals: tuple[int, ...], comms: list[Any]) -> None:
        try:
            for comm in comms:
                comm.check_async_error()
        except nccl.NcclError as exc:
            raise self._failed(operation, ordinals, exc) from exc

    @staticmethod
    def _failed(operation: str, ordinals: tuple[int, ...], exc: Exception) -> CollectiveError:
        library = "NCCL" if isinstance(exc, nccl.NcclError) else "CUDA"
        return CollectiveError(f"{operation} failed on GPUs {list(ordinals)}: {library} reported {exc}. The "
                               f"communicators were aborted; the next collective creates new ones. {HINT}",
                               operation=operation, status=getattr(exc, "status", None))

    def _announce(self, operation: str) -> int | None:
        """Tells the peers of a multi-process job that this collective is launched; its number (None here)."""
        return None

    def _late(self, operation: str, ordinals: tuple[int, ...], timeout: float,
              sequence: int | None) -> BaseException:
        """The error of a collective past its deadline (multi-process: naming the ranks that never launched it)."""
        return DeadlineExceededError(
            f"{operation} did not complete within {timeout:g} s on GPUs {list(ordinals)}; NCCL has no timeout of its "
            f"own, so the communicators were aborted (the next collective creates new ones). {HINT} Raise "
            f"CommunicationOptions(timeout_seconds=...) or $DISTRIB_COLLECTIVE_TIMEOUT if the work is just slow.",
            operation=operation)

    def _abort(self, ordinals: tuple[int, ...], comms: list[Any]) -> None:
        """Aborts `comms` (never `destroy`, which can hang) and forgets them if they are still the current ones.

        Called by the watchdog's thread too: it waits for a launch in progress (launches hold the lock for
        microseconds), so no thread is inside NCCL on a communicator as it is freed, nor picks it up afterwards.
        A launch hung inside NCCL is aborted all the same after `ABORT_LOCK_SECONDS`: that is NCCL's way out.
        """
        locked = self._launch_lock.acquire(timeout=ABORT_LOCK_SECONDS)
        try:
            with self._lock:
                if self._groups.get(ordinals) is comms:
                    del self._groups[ordinals]
            for comm in comms:
                comm.abort()
        finally:
            if locked:
                self._launch_lock.release()

    def abort(self, ordinals: Sequence[int]) -> None:
        """Aborts the current communicators of `ordinals` and forgets them."""
        comms = self._groups.get(tuple(ordinals))
        if comms is not None:
            self._abort(tuple(ordinals), comms)
