"""Replica threads lent to host work: those waiting at a merge_call (to the merge), or idle between runs."""

from __future__ import annotations

import _thread
import threading
from typing import Any, Callable, Sequence

from distrib.backends.parallel import Team
from distrib.interrupts import deferred_interrupts


class ReplicaTeam(Team):
    """The merge thread plus replica threads parked at the rendezvous, each running one task of a call.

    A parked replica thread waits on its `go` lock; a task is handed over by setting its `task` and releasing
    `go`, and the thread parks again once the task is done (see `ReplicaThread.rendezvous`).

    Args:
      threads: replica threads that are all waiting at the rendezvous for this merge.

    Example:
      >>> team = ReplicaTeam([])
      >>> team.run([lambda: None])
      >>> team
      <ReplicaTeam size=1>
    """

    def __init__(self, threads: Sequence[Any]):
        self._threads = list(threads)
        self.size = len(self._threads) + 1
        self._lock = threading.Lock()
        self._done = _thread.allocate_lock()
        self._pending = 0
        self._error: BaseException | None = None
        self._busy = False

    def __repr__(self) -> str:
        return f"<ReplicaTeam size={self.size}>"

    def run(self, tasks: Sequence[Callable[[], None]]) -> None:
        if len(tasks) > self.size:
            raise ValueError(f"A team of {self.size} threads runs at most {self.size} tasks. Received: {len(tasks)}.")
        if self._busy:  # a task that splits work of its own: its helpers are taken, so run it here
            for task in tasks:
                task()
            return
        helpers = list(zip(self._threads, tasks[1:]))
        self._pending, self._error = len(helpers), None
        # a Ctrl-C waits for the end of the call: the helpers write into buffers the caller is about to drop
        with deferred_interrupts():
            if helpers:
                self._done.acquire()  # released by the last helper to finish
            self._busy = True
            for worker, task in helpers:
                worker.task = lambda task=task: self._help(task)
                worker.go.release()
            try:
                tasks[0]()
            except BaseException as exc:  # noqa: BLE001 - raised below, once the helpers are done
                self._record(exc)
            try:
                if helpers:
                    self._done.acquire()
                    self._done.release()
            finally:
                self._busy = False
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _help(self, task: Callable[[], None]) -> None:
        """Runs on a helper thread: never raises, so the thread goes back to waiting at the rendezvous."""
        try:
            task()
        except BaseException as exc:  # noqa: BLE001 - handed to the merge thread
            self._record(exc)
        finally:
            with self._lock:
                self._pending -= 1
                if self._pending == 0:
                    self._done.release()

    def _record(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = exc


class IdleThreadsTeam(Team):
    """A strategy's replica threads between runs, borrowed for one call at a time by work outside any run.

    Each `run` takes the strategy's run lock without waiting, so a run in progress (or one that starts first)
    keeps its threads, and the tasks then run one after another on the calling thread.

    Args:
      threads: the strategy's replica threads (its list: replaced threads are seen).
      run_lock: the lock a run holds while it uses the threads.

    Example:
      >>> import threading
      >>> team = IdleThreadsTeam([], threading.Lock())
      >>> team.run([lambda: None])
      >>> team
      <IdleThreadsTeam size=1>
    """

    def __init__(self, threads: Sequence[Any], run_lock: Any):
        self._threads, self._run_lock = threads, run_lock
        self.size = len(threads) + 1

    def __repr__(self) -> str:
        return f"<IdleThreadsTeam size={self.size}>"

    def run(self, tasks: Sequence[Callable[[], None]]) -> None:
        acquired = False
        try:
            with deferred_interrupts():  # a Ctrl-C cannot land between taking the lock and `acquired`
                acquired = self._run_lock.acquire(blocking=False)
            if acquired:
                ReplicaTeam(self._threads).run(tasks)
            else:  # a run has the threads
                for task in tasks:
                    task()
        finally:
            if acquired:
                self._run_lock.release()
