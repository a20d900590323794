"""NCCL communicators for one process driving several GPUs: creation, group calls, the watchdog, error translation.

A group call is handed to the watchdog (backends/cuda/watchdog.py) before it is launched, and given an event
recorded on each device's stream once it is; the caller returns at once, so collectives pipeline on the streams as
NCCL's own do. NCCL has no timeout: a collective whose peer never starts spins forever (on the device, or on the
host inside the launch while connections are set up), and errors on the network arrive asynchronously. So the
watchdog's thread polls the events and the communicators' asynchronous errors, and past the deadline aborts the
communicators of that call; the error (DeadlineExceededError, CollectiveError) is raised at the next
synchronisation point: the next collective, `wait()`, `settle()`, or a copy to the host. Failed communicators are
dropped; the next collective on those devices creates new ones.

Aborting from the watchdog's thread while another thread may be inside NCCL: `ncclCommAbort` from another thread
is NCCL's documented way out of a call that hangs, but it frees the communicator, so nothing may touch it after
(CuPy zeroes its handle only once the abort has returned). A Clique therefore aborts its communicators once, after
any launch on them has returned (waiting LAUNCH_GRACE seconds for it: longer means it hangs inside NCCL, and only
the abort ends it); the launching thread leaves them alone once they are aborted, and every collective still
watched on them fails with a CollectiveError instead of polling them.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable, Sequence

import cupy
from cupy.cuda import nccl
from cupy_backends.cuda.api.runtime import CUDARuntimeError

from distrib.backends.cuda.errors import NCCL_HINT as HINT
from distrib.backends.cuda.watchdog import Watchdog, Watched
from distrib.errors import CollectiveError, DeadlineExceededError

Launch = Callable[[int, Any, int], None]  # (rank, communicator, stream pointer): issues the rank's NCCL calls
LAUNCH_GRACE = 1.0  # seconds an abort waits for a launch on the same communicators to return


def version() -> int:
    """The loaded NCCL's version code (X*10000+Y*100+Z since 2.9)."""
    return nccl.get_version()


class _Launching:
    """The completion event of a group call still being launched: never done (its real events replace it)."""

    done = False


LAUNCHING = _Launching()


class Clique:
    """The communicators of one tuple of CUDA ordinals (one per GPU), aborted at most once, never while in use.

    Example:
      >>> class Comm:
      ...     def abort(self):
      ...         print("aborted")
      >>> clique = Clique((0,))
      >>> clique.comms.append(Comm())
      >>> clique.abort(), clique.abort()
      aborted
      (True, False)
    """

    def __init__(self, ordinals: tuple[int, ...]):
        self.ordinals = ordinals
        self.comms: list[Any] = []  # appended as they are created (an abort must reach one whose creation hangs)
        self.ready = False  # every communicator created
        self.aborted = False
        self._aborted_count = 0  # how many of `comms` the abort reached
        self._launch = threading.Lock()  # held while NCCL calls on the communicators are in progress
        self._changed = threading.Lock()  # guards `aborted` and `_aborted_count`

    def launching(self) -> threading.Lock:
        """`with`: NCCL calls on the communicators in progress (one launching thread at a time). A plain lock, as
        every collective takes it: a generator and a condition cost microseconds per launch."""
        return self._launch

    def abort(self) -> bool:
        """Aborts the communicators (never `destroy`, which can hang) once a launch on them has returned, or after
        LAUNCH_GRACE seconds if it has not; True if this call aborted them, False if they already were."""
        with self._changed:
            if self.aborted:
                return False
            self.aborted = True
        waited = self._launch.acquire(timeout=LAUNCH_GRACE)
        try:
            with self._changed:
                self._abort_from(self._aborted_count)  # check_open may have aborted some while this waited
        finally:
            if waited:
                self._launch.release()
        return True

    def _abort_from(self, first: int) -> None:
        """Aborts comms[first:], the ones no abort has reached yet (always with `_changed` held)."""
        for comm in self.comms[first:]:
            comm.abort()
        self._aborted_count = len(self.comms)

    def check_open(self, operation: str) -> None:
        """Raises CollectiveError if the clique was aborted (past its deadline) while its communicators were being
        created, first aborting those made after the abort (a creation that waited for peers, then went on)."""
        with self._changed:
            if self.aborted:
                self._abort_from(self._aborted_count)
                raise CollectiveError(f"{operation} could not use GPUs {list(self.ordinals)}: their communicators "
                                      f"were aborted past the deadline while being created.", operation=operation)

    def poll_errors(self, operation: str) -> None:
        """Raises NCCL's asynchronous error on any of the communicators, or CollectiveError once they are aborted."""
        with self._changed:
            if self.aborted:
                raise CollectiveError(f"{operation} on GPUs {list(self.ordinals)} was cut short: its communicators "
                                      f"were aborted after an earlier collective on them failed, so its result is "
                                      f"void.", operation=operation)
            if self.ready:
                for comm in self.comms:
                    comm.check_async_error()

    def __repr__(self) -> str:
        state = "aborted" if self.aborted else "ready" if self.ready else "being created"
        return f"<Clique GPUs={list(self.ordinals)} {state}>"


class Communicators:
    """One Clique of communicators for each tuple of distinct CUDA ordinals, made with `initAll` on first use.

    Every group call of the process is serialised, whatever its tuple: a communicator must never be used by two
    threads at once, and two tuples that share a GPU must queue their kernels on its stream in the same order as
    on their other shared GPUs ((0, 1) and (1, 0) launched by two threads at once could otherwise queue in
    opposite orders on the two streams and wait for each other forever). Launches return at once, so the lock is
    held for microseconds.
    """

    def __init__(self):
        self._groups: dict[tuple[int, ...], Clique] = {}
        self._launch_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _groups
        self.watchdog = Watchdog()

    def _clique(self, ordinals: tuple[int, ...]) -> Clique:
        with self._lock:
            clique = self._groups.get(ordinals)
            if clique is None or clique.aborted:
                clique = self._groups[ordinals] = Clique(ordinals)
            return clique

    def _create(self, clique: Clique, operation: str) -> None:
        """Creates the clique's communicators, appending each to `clique.comms` as it is made."""
        try:
            with cupy.cuda.Device(clique.ordinals[0]):  # initAll switches devices; restore the current one after
                clique.comms.extend(nccl.NcclCommunicator.initAll(list(clique.ordinals)))
        except nccl.NcclError as exc:
            raise CollectiveError(f"NCCL could not create communicators for GPUs {list(clique.ordinals)} ({exc}). "
                                  f"{HINT}", operation=operation, status=exc.status) from exc

    def check(self) -> None:
        """Raises the error of a collective that failed since the last check (see the module docstring)."""
        self.watchdog.check()

    def settle(self) -> None:
        """Retires what has completed, waiting for an abort in progress, then raises the first failure, if any: after
        the host has waited for a stream, an error of the collectives queued on it surfaces here at the latest."""
        self.watchdog.settle()

    def wait(self) -> None:
        """Blocks until every launched collective has completed or failed; raises the first failure."""
        self.watchdog.wait()

    def run(self, operation: str, ordinals: Sequence[int], streams: Sequence[Any], launch: Launch,
            timeout: float) -> None:
        """Issues `launch` for every rank inside one NCCL group, watched from before the launch; returns at once.

        Raises:
          DeadlineExceededError, CollectiveError: an earlier collective failed (raised once, here or at the next
            synchronisation point); or NCCL or CUDA refused this launch (or it hung past `timeout`), and its
            communicators were aborted.
        """
        self.watchdog.check()
        ordinals = tuple(ordinals)
        sequence = self._announce(operation, timeout)
        with self._launch_lock:
            clique = self._clique(ordinals)
            # watched before the launch: a launch that hangs inside NCCL (a peer that never connects) is aborted too
            watched = Watched(operation, [LAUNCHING], time.monotonic() + timeout,
                              poll_errors=functools.partial(self._poll_errors, operation, clique), abort=clique.abort,
                              timeout_error=functools.partial(self._late, operation, ordinals, timeout, sequence))
            self.watchdog.watch(watched)
            try:
                with clique.launching():
                    if not clique.ready:  # bounded by the timeout too, but not counted against the collective's
                        self._create(clique, operation)
                        clique.check_open(operation)
                        clique.ready = True
                        watched.deadline = time.monotonic() + timeout
                    watched.events = self._launch(clique, streams, launch)
            except BaseException as exc:
                self._launch_failed(operation, clique, watched, exc)
                raise

    @staticmethod
    def _launch(clique: Clique, streams: Sequence[Any], launch: Launch) -> list[Any]:
        """The group call itself; the completion event recorded on each device's stream after it."""
        nccl.groupStart()
        try:
            for rank, (ordinal, comm, stream) in enumerate(zip(clique.ordinals, clique.comms, streams)):
                with cupy.cuda.Device(ordinal):
                    launch(rank, comm, stream.ptr)
        finally:
            nccl.groupEnd()  # a group left open would hold back every later NCCL call of this thread
        events = []
        for ordinal, stream in zip(clique.ordinals, streams):
            with cupy.cuda.Device(ordinal):
                events.append(stream.record(cupy.cuda.Event(disable_timing=True)))
        return events

    def _launch_failed(self, operation: str, clique: Clique, watched: Watched, exc: BaseException) -> None:
        """After a launch raised: some ranks' calls may be queued, waiting for the others forever, so the clique is
        aborted (unless the watchdog did, past the deadline: then its error is raised); NCCL's and CUDA's errors
        are raised as CollectiveError."""
        retired = not self.watchdog.forget(watched)
        clique.abort()
        if retired:
            self.watchdog.check()  # the watchdog's error (the deadline, naming the missing ranks) if nobody took it
        if isinstance(exc, (nccl.NcclError, CUDARuntimeError)):
            raise self._failed(operation, clique.ordinals, exc) from exc

    def _poll_errors(self, operation: str, clique: Clique) -> None:
        try:
            clique.poll_errors(operation)
        except nccl.NcclError as exc:
            raise self._failed(operation, clique.ordinals, exc) from exc

    @staticmethod
    def _failed(operation: str, ordinals: tuple[int, ...], exc: Exception) -> CollectiveError:
        library = "NCCL" if isinstance(exc, nccl.NcclError) else "CUDA"
        return CollectiveError(f"{operation} failed on GPUs {list(ordinals)}: {library} reported {exc}. The "
                               f"communicators were aborted; the next collective creates new ones. {HINT}",
                               operation=operation, status=getattr(exc, "status", None))

    def _announce(self, operation: str, timeout: float | None = None) -> int | None:
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

    def abort(self, ordinals: Sequence[int]) -> None:
        """Aborts the current communicators of `ordinals` and forgets them."""
        with self._lock:
            clique = self._groups.pop(tuple(ordinals), None)
        if clique is not None:
            clique.abort()
