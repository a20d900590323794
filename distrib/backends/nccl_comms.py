"""NCCL communicators for one process driving several GPUs: creation, group calls, the watchdog, error translation.

NCCL has no timeout: a collective whose peer never starts spins forever, and errors on the network arrive
asynchronously. So every group call is followed by a watchdog: an event recorded on each device's stream is
polled until all complete; meanwhile each communicator is asked for asynchronous errors, and past the deadline
every communicator of the group is aborted and DeadlineExceededError raised. Failed communicators are dropped;
the next collective on those devices creates new ones.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import cupy
from cupy.cuda import nccl

from distrib.errors import CollectiveError, DeadlineExceededError

SPIN_SECONDS = 2e-4  # poll without sleeping this long: small collectives finish within it
MAX_SLEEP_SECONDS = 1e-3

HINT = ("Run with NCCL_DEBUG=WARN for NCCL's own account. A hang between GPUs of one machine is often broken "
        "peer-to-peer transfers: try NCCL_P2P_DISABLE=1, and check that IOMMU and PCI ACS are off.")

Launch = Callable[[int, Any, int], None]  # (rank, communicator, stream pointer): issues the rank's NCCL calls


def version() -> int:
    """The loaded NCCL's version code (X*10000+Y*100+Z since 2.9)."""
    return nccl.get_version()


class Communicators:
    """One communicator per device for each tuple of distinct CUDA ordinals, made with `initAll` on first use.

    Group calls on one tuple are serialised: a communicator must never be used by two threads at once.
    """

    def __init__(self):
        self._groups: dict[tuple[int, ...], list[Any]] = {}
        self._locks: dict[tuple[int, ...], threading.Lock] = {}
        self._lock = threading.Lock()

    def _lock_for(self, ordinals: tuple[int, ...]) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(ordinals, threading.Lock())

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

    def run(self, operation: str, ordinals: Sequence[int], streams: Sequence[Any], launch: Launch,
            timeout: float) -> None:
        """Issues `launch` for every rank inside one NCCL group, then waits for completion under the watchdog.

        Raises:
          DeadlineExceededError: the group did not complete within `timeout` seconds.
          CollectiveError: NCCL or CUDA reported an error; the communicators were aborted.
        """
        ordinals = tuple(ordinals)
        with self._lock_for(ordinals):
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
                self._wait(operation, ordinals, comms, events, timeout)
            except (nccl.NcclError, cupy.cuda.runtime.CUDARuntimeError) as exc:
                self.abort(ordinals)
                library = "NCCL" if isinstance(exc, nccl.NcclError) else "CUDA"
                raise CollectiveError(f"{operation} failed on GPUs {list(ordinals)}: {library} reported {exc}. The "
                                      f"communicators were aborted; the next collective creates new ones. {HINT}",
                                      operation=operation, status=getattr(exc, "status", None)) from exc

    def _wait(self, operation: str, ordinals: tuple[int, ...], comms: list[Any], events: list[Any],
              timeout: float) -> None:
        start = time.monotonic()
        pending = events
        pause = 0.0
        while True:
            pending = [e for e in pending if not e.done]
            if not pending:
                return
            waited = time.monotonic() - start
            if waited < SPIN_SECONDS:
                continue
            for comm in comms:
                comm.check_async_error()
            if waited > timeout:
                self.abort(ordinals)
                raise DeadlineExceededError(
                    f"{operation} did not complete within {timeout:g} s on GPUs {list(ordinals)}; NCCL has no timeout "
                    f"of its own, so the communicators were aborted (the next collective creates new ones). {HINT} "
                    f"Raise CommunicationOptions(timeout_seconds=...) or $DISTRIB_COLLECTIVE_TIMEOUT if the work is "
                    f"just slow.", operation=operation)
            pause = min(MAX_SLEEP_SECONDS, max(pause * 2, 2e-5))
            time.sleep(pause)

    def abort(self, ordinals: Sequence[int]) -> None:
        """Aborts the communicators of `ordinals` (never `destroy`, which can hang) and forgets them."""
        for comm in self._groups.pop(tuple(ordinals), ()):
            comm.abort()
