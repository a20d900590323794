"""Completion of asynchronous collectives, watched on a thread of its own: deadlines, asynchronous errors, aborts.

A collective is launched and handed to the watchdog; the caller returns at once, so collectives pipeline on the
device streams as NCCL's own do. The watchdog's thread polls what it watches every few milliseconds: past a
collective's deadline, or when its communicators report an asynchronous error, it aborts them (which ends the
device work waiting on a missing peer) and keeps the error. The error is raised, once, at the caller's next
synchronisation point: the next collective, `wait()` (a backend's synchronize), or a copy to the host.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

SPIN_SECONDS = 2e-4  # a waiting caller polls without sleeping this long: small collectives finish within it
MAX_CALLER_SLEEP = 1e-3  # a waiting caller sleeps at most this long between polls
THREAD_PAUSES = (1e-3, 1e-2)  # the watchdog thread's poll interval, doubling from the first to the second


class Backoff:
    """A waiting caller's pause between polls: none for SPIN_SECONDS, then sleeps doubling up to MAX_CALLER_SLEEP."""

    def __init__(self):
        self._start = time.monotonic()
        self._pause = 0.0

    def idle(self) -> None:
        """Called after a poll that found nothing new."""
        if time.monotonic() - self._start >= SPIN_SECONDS:
            self._pause = min(MAX_CALLER_SLEEP, max(self._pause * 2, 2e-5))
            time.sleep(self._pause)


def wait_for(events: Sequence[Any]) -> None:
    """Returns once every event (anything with a `done` property: CUDA events and streams) is done, polling.

    The host waits for the GPU this way rather than by a blocking CUDA synchronise: on 2026-11-27's H200, a
    cudaDeviceSynchronize after an NCCL call took 2.4 ms however little was queued, while polling sees a short
    collective done within microseconds.
    """
    backoff = Backoff()
    for event in events:
        while not event.done:
            backoff.idle()


@dataclass(eq=False)
class Watched:
    """One collective: its completion events (anything with a `done` property), deadline and callbacks.

    A collective may be watched before its launch returns, with events that are not done yet; the launching thread
    sets `events` once it has them, or `forget`s it if the launch failed.
    """

    operation: str
    events: Sequence[Any]
    deadline: float  # time.monotonic() seconds
    poll_errors: Callable[[], None]  # raises the library's error if the communicators report an asynchronous one,
    #                                  or were aborted (asked first: a collective cut short by an abort completes too)
    abort: Callable[[], None]  # aborts the communicators, so their pending device work ends
    timeout_error: Callable[[], BaseException]  # the error to raise past the deadline
    launched: float = field(default_factory=time.monotonic)


class Watchdog:
    """Watches launched collectives until they complete, from one daemon thread started on first use.

    Example:
      >>> class Done:
      ...     done = True
      >>> dog = Watchdog()
      >>> dog.watch(Watched("all_reduce", [Done()], time.monotonic() + 1, lambda: None, lambda: None,
      ...                   lambda: TimeoutError("late")))
      >>> dog.wait()
      >>> dog.pending()
      0
    """

    def __init__(self):
        self._watched: collections.deque[Watched] = collections.deque()
        self._lock = threading.Condition()  # guards _watched and _error; notified when either changes
        self._poll_lock = threading.Lock()  # one poller at a time, so nothing is aborted twice
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def watch(self, watched: Watched) -> None:
        """Adds a launched collective; starts the thread if it is not running (also after a fork)."""
        with self._lock:
            idle = not self._watched  # the thread waits for work only while nothing is watched
            self._watched.append(watched)
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="distrib-watchdog", daemon=True)
                self._thread.start()
            elif idle:  # otherwise it is polling already: waking it per launch would take the GIL from the caller
                self._lock.notify_all()

    def pending(self) -> int:
        """How many watched collectives have neither completed nor failed."""
        return len(self._watched)

    def check(self) -> None:
        """Raises, once, the error of a collective that failed since the last check."""
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def settle(self) -> None:
        """One pass over the watched collectives (after any pass in progress, an abort included), then `check()`.

        Once the host has waited for a stream, this raises the failure of any collective queued on it: its events are
        done, so this pass retires it, or the pass in progress that is aborting it has kept its error.
        """
        self._poll()
        self.check()

    def forget(self, watched: Watched) -> bool:
        """Stops watching `watched` (after any pass in progress); False if it was no longer watched (retired)."""
        with self._poll_lock, self._lock:
            try:
                self._watched.remove(watched)
            except ValueError:
                return False
            self._lock.notify_all()
            return True

    def wait(self) -> None:
        """Blocks until every watched collective has completed or failed, then raises the first failure, if any.

        The caller polls too, spinning briefly and then sleeping, so a short collective is seen done within
        microseconds rather than at the thread's next poll; deadlines bound the wait.
        """
        backoff = Backoff()
        while self._watched:
            if not self._poll():
                backoff.idle()
        self.check()

    def _poll(self) -> bool:
        """One pass over the watched collectives, oldest first; True if any completed or failed."""
        with self._poll_lock:
            finished: list[Watched] = []
            failure: BaseException | None = None
            now = time.monotonic()
            for watched in list(self._watched):
                try:
                    watched.poll_errors()
                    if all(event.done for event in watched.events):  # a failed query (a CUDA error) fails it too
                        finished.append(watched)
                        continue
                    if now > watched.deadline:
                        raise watched.timeout_error()
                except BaseException as exc:  # the collective failed: abort it and keep its error for the caller
                    try:
                        watched.abort()
                    finally:
                        finished.append(watched)
                        failure = failure or exc
            if not finished:
                return False
            with self._lock:
                for watched in finished:
                    self._watched.remove(watched)
                if failure is not None and self._error is None:
                    self._error = failure
                self._lock.notify_all()
            return True

    def _run(self) -> None:
        pause = THREAD_PAUSES[0]
        while True:
            with self._lock:
                while not self._watched:
                    self._lock.wait()
                    pause = THREAD_PAUSES[0]
            if self._poll():
                pause = THREAD_PAUSES[0]
            else:
                time.sleep(pause)
                pause = min(THREAD_PAUSES[1], pause * 2)

    def __repr__(self) -> str:
        return f"<Watchdog pending={self.pending()}>"
