"""The closure queue: one dispatcher thread per worker takes the next closure, re-queues it if the worker died."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

from distrib.errors import WorkerError
from distrib import ray_runtime

FORGET_EVERY = 64  # finished closures whose write tags the servers drop in one message
MAX_ATTEMPTS = 4  # a closure whose worker dies this many times running it fails, instead of killing them all
BACK_SECONDS = 120.0  # how long a dispatcher waits for Ray to restart its dead worker before sending it more


class Closure:
    """A scheduled call, its result holder, and how many times a worker began it.

    Args:
      closure_id: its number, in scheduling order.
      name: the scheduled function's name, for messages.
      payload: the call pickled (closures.pack), or a function making it when the dispatcher takes the closure
        (it waits for the RemoteValues among the arguments).
      result_type: the class of its result holder (RemoteValue).
    """

    def __init__(self, closure_id: int, name: str, payload: bytes | Callable[[], bytes], result_type: type):
        self.id, self.name, self._payload = closure_id, name, payload
        self.result = result_type(closure_id)
        self.attempts = 0

    def payload(self) -> bytes:
        if callable(self._payload):
            self._payload = self._payload()  # once: a re-run sends the same bytes
        return self._payload


class ClosureQueue:
    """Closures waiting for a worker, and the threads that feed them to the workers, one thread per worker.

    The threads hold this queue, not the coordinator, so a coordinator dropped with its strategy can be
    collected; `stop()` ends them.

    Args:
      workers: the worker actors.
      forget: called with the ids of finished closures, so that the servers drop their write tags.
    """

    def __init__(self, workers: list[Any], forget: Callable[[list[int]], None]):
        self._workers, self._forget = workers, forget
        self._queue: collections.deque[Closure | None] = collections.deque()
        self._lock = threading.Condition()
        self.unfinished = 0
        self._errors: list[BaseException] = []
        self._finished_ids: list[int] = []
        self._threads = [threading.Thread(target=self._dispatch, args=(i,), daemon=True,
                                          name=f"distrib-ps-worker-{i}") for i in range(len(workers))]
        for thread in self._threads:
            thread.start()

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def put(self, closure: Closure) -> None:
        with self._lock:
            self.unfinished += 1
            self._queue.append(closure)
            self._lock.notify_all()

    def finished(self) -> bool:
        with self._lock:
            return self.unfinished == 0

    def wait_until_finished(self) -> None:
        with self._lock:
            self._lock.wait_for(lambda: self.unfinished == 0)
        self._forget_finished()

    def raise_error(self) -> None:
        """Raises the first error a closure raised since the last call, if any (each error is raised once)."""
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def stop(self) -> None:
        """Ends the threads once the closures queued so far are done."""
        with self._lock:
            self._queue.extend([None] * len(self._threads))
            self._lock.notify_all()

    def _dispatch(self, index: int) -> None:
        died = ray_runtime.actor_died_errors()
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._queue)
                closure = self._queue.popleft()
            if closure is None:
                return
            closure.attempts += 1
            try:
                payload = closure.payload()
            except Exception as exc:  # noqa: BLE001 - an argument's closure failed, or fn cannot be pickled
                self._finish(closure, None, exc)
                continue
            try:
                status, value = ray_runtime.get(self._workers[index].run.remote(closure.id, closure.name, payload))
            except died as exc:  # the worker's process died mid-closure: Ray restarts it; the closure runs again
                if closure.attempts < MAX_ATTEMPTS:
                    with self._lock:  # another worker may take it meanwhile
                        self._queue.appendleft(closure)
                        self._lock.notify_all()
                    self._wait_until_back(index, died)
                    continue
                status, value = "error", WorkerError(
                    f"A scheduled closure's worker died each of the {closure.attempts} times it ran it (a crash, "
                    f"out of memory, or a kill, not an exception). Received: closure {closure.id}, "
                    f"{closure.name!r}; last: {type(exc).__name__}.")
                self._wait_until_back(index, died)
            except Exception as exc:  # noqa: BLE001 - Ray failed the call itself
                status, value = "error", exc
            self._finish(closure, value if status == "ok" else None, value if status == "error" else None)

    def _wait_until_back(self, index: int, died: tuple[type, ...]) -> None:
        """Returns once worker `index`, restarted by Ray, answers (or after BACK_SECONDS): a closure sent to it while
        it restarts fails at once (ActorUnavailableError), and on a loaded machine a restart outlasted every
        attempt a closure has, so that a worker killed once failed its closure as if it had died four times."""
        deadline = time.monotonic() + BACK_SECONDS
        while time.monotonic() < deadline:
            try:
                ray_runtime.get(self._workers[index].pid.remote())
                return
            except died:
                time.sleep(0.05)

    def _finish(self, closure: Closure, value: Any, error: BaseException | None) -> None:
        closure.result._set(value, error)
        with self._lock:
            if error is not None:
                self._errors.append(error)
            self._finished_ids.append(closure.id)
            self.unfinished -= 1
            forget = len(self._finished_ids) >= FORGET_EVERY
            self._lock.notify_all()
        if forget:
            self._forget_finished()

    def _forget_finished(self) -> None:
        with self._lock:
            ids, self._finished_ids = self._finished_ids, []
        if ids:
            self._forget(ids)
