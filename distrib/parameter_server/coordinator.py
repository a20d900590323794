"""ClusterCoordinator: schedules closures on workers asynchronously, re-runs those whose worker died, joins them."""

from __future__ import annotations

import collections
import itertools
import threading
from typing import Any, Callable

import optree

from distrib.errors import ContextError, WorkerError
from distrib.parameter_server import ray_runtime
from distrib.parameter_server.worker import PerWorkerDataset

_FORGET_EVERY = 64  # finished closures whose write tags the servers drop in one message
MAX_ATTEMPTS = 4  # a closure whose worker dies this many times running it fails instead of killing them all


class RemoteValue:
    """The result of a scheduled closure, available once a worker has run it.

    `fetch()` (and `get()`) waits for it and returns it, or raises the closure's error as its own type.
    """

    def __init__(self, closure_id: int):
        self._closure_id = closure_id
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _set(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()

    def fetch(self) -> Any:
        """Waits for the closure and returns its result (NumPy arrays), or raises its error."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def get(self) -> Any:
        """The same as `fetch`: results are host NumPy arrays already."""
        return self.fetch()

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else ("failed" if self._error else "done")
        return f"<RemoteValue closure={self._closure_id} {state}>"


class _Closure:
    def __init__(self, closure_id: int, fn: Callable, args: tuple, kwargs: dict):
        self.id, self.fn, self.args, self.kwargs = closure_id, fn, args, kwargs
        self.result = RemoteValue(closure_id)
        self.attempts = 0


class ClusterCoordinator:
    """Schedules functions on the workers of a ParameterServerStrategy, each worker at its own pace.

    Every worker takes the next closure as soon as it is done with the last, without waiting for the others;
    a closure reads the variables it needs from the parameter servers and writes its updates back there.
    A worker that dies mid-closure is replaced (Ray restarts its process) and the closure runs again, on
    whichever worker is free first; its writes carry tags, so none is applied twice. An error raised inside a
    closure is raised again, as its own type, by `join()`, `done()` and the closure's `RemoteValue.fetch()`,
    while the other closures finish. A parameter server that dies fails the closures that use it with
    `distrib.errors.ParameterServerError`.

    Args:
      strategy: the `distrib.ParameterServerStrategy` whose workers run the closures.

    Example:
      >>> import distrib, numpy as np
      >>> resolver = distrib.cluster_resolver.RayClusterResolver(num_workers=2, num_ps=1)
      >>> strategy = distrib.ParameterServerStrategy(resolver)
      >>> with strategy.scope():
      ...     total = distrib.Variable(np.float64(0), name="total")
      >>> coordinator = distrib.coordinator.ClusterCoordinator(strategy)
      >>> def step(k):
      ...     total.assign_add(k)  # on the parameter server, from whichever worker runs this
      ...     return k * k
      >>> results = [coordinator.schedule(step, args=(k,)) for k in range(5)]
      >>> coordinator.join()
      >>> float(total.numpy()), [r.fetch() for r in results]
      (10.0, [0, 1, 4, 9, 16])
    """

    def __new__(cls, strategy: Any):
        from distrib.parameter_server.strategy import ParameterServerStrategy

        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError(f"ClusterCoordinator needs a distrib.ParameterServerStrategy. Received: "
                            f"{type(strategy).__name__}.")
        if strategy._on_worker:
            raise ContextError("A ClusterCoordinator runs on the coordinator, not inside a scheduled closure.")
        if strategy._coordinator is None:  # one per strategy, as in TensorFlow: a second call returns it
            strategy._coordinator = super().__new__(cls)
            strategy._coordinator._start(strategy)
        return strategy._coordinator

    def _start(self, strategy: Any) -> None:
        self._strategy = strategy
        self._workers = strategy._cluster.start_workers()
        self._ids = itertools.count()
        self._queue: collections.deque[_Closure | None] = collections.deque()
        self._lock = threading.Condition()
        self._unfinished = 0
        self._errors: list[BaseException] = []
        self._finished_ids: list[int] = []
        self._threads = [threading.Thread(target=self._dispatch, args=(i,), daemon=True,
                                          name=f"distrib-ps-worker-{i}") for i in range(len(self._workers))]
        for thread in self._threads:
            thread.start()

    @property
    def strategy(self) -> Any:
        return self._strategy

    # -- scheduling -------------------------------------------------------------------------------------

    def schedule(self, fn: Callable, args: Any = None, kwargs: Any = None) -> RemoteValue:
        """Queues `fn(*args, **kwargs)` for the first free worker; returns its `RemoteValue` at once.

        Per-worker values in `args`/`kwargs` (from `create_per_worker_dataset`) become the running worker's.
        """
        if not callable(fn):
            raise TypeError(f"schedule needs a callable fn. Received: {type(fn).__name__}.")
        if args is not None and not isinstance(args, (list, tuple)):
            raise TypeError(f"args must be a tuple or list. Received: {type(args).__name__}.")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs must be a dict. Received: {type(kwargs).__name__}.")
        closure = _Closure(next(self._ids), fn, tuple(args or ()), dict(kwargs or {}))
        with self._lock:
            self._unfinished += 1
            self._queue.append(closure)
            self._lock.notify_all()
        return closure.result

    def join(self) -> None:
        """Waits until every scheduled closure has finished; raises the first error one of them raised."""
        with self._lock:
            self._lock.wait_for(lambda: self._unfinished == 0)
        self._forget_finished()
        self._raise_error()

    def done(self) -> bool:
        """Whether every scheduled closure has finished; raises the first error one of them raised."""
        with self._lock:
            finished = self._unfinished == 0
        if finished:
            self._raise_error()
        return finished

    def fetch(self, val: Any) -> Any:
        """`val` with every RemoteValue in it replaced by its result (waiting for it)."""
        return optree.tree_map(lambda leaf: leaf.fetch() if isinstance(leaf, RemoteValue) else leaf, val,
                               none_is_leaf=True)

    def create_per_worker_dataset(self, dataset_fn: Callable[[], Any]) -> PerWorkerDataset:
        """A dataset made on each worker by `dataset_fn()`; `iter()` of it gives per-worker iterators.

        Pass the iterator to `schedule`; inside the closure it is the running worker's own iterator.
        """
        if not callable(dataset_fn):
            raise TypeError(f"create_per_worker_dataset needs a function returning a dataset (any iterable). "
                            f"Received: {type(dataset_fn).__name__}.")
        return PerWorkerDataset(dataset_fn)

    def __repr__(self) -> str:
        return f"<ClusterCoordinator workers={len(self._workers)} unfinished={self._unfinished}>"

    # -- the dispatcher threads, one per worker ---------------------------------------------------------

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
                status, value = ray_runtime.get(self._workers[index].run.remote(closure.id, closure.fn,
                                                                                closure.args, closure.kwargs))
            except died as exc:  # the worker's process died mid-closure: Ray restarts it; the closure runs again
                if closure.attempts < MAX_ATTEMPTS:
                    with self._lock:
                        self._queue.appendleft(closure)
                        self._lock.notify_all()
                    continue
                status, value = "error", WorkerError(
                    f"A scheduled closure's worker died each of the {closure.attempts} times it ran it (a crash, "
                    f"out of memory, or a kill, not an exception). Received: closure {closure.id}, "
                    f"{getattr(closure.fn, '__name__', closure.fn)!r}; last: {type(exc).__name__}.")
            except Exception as exc:  # noqa: BLE001 - e.g. a closure that cannot be pickled
                status, value = "error", exc
            self._finish(closure, value if status == "ok" else None, value if status == "error" else None)

    def _finish(self, closure: _Closure, value: Any, error: BaseException | None) -> None:
        closure.result._set(value, error)
        with self._lock:
            if error is not None:
                self._errors.append(error)
            self._finished_ids.append(closure.id)
            self._unfinished -= 1
            forget = len(self._finished_ids) >= _FORGET_EVERY
            self._lock.notify_all()
        if forget:
            self._forget_finished()

    def _forget_finished(self) -> None:
        with self._lock:
            ids, self._finished_ids = self._finished_ids, []
        if ids:
            self._strategy._cluster.forget(ids)

    def _raise_error(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def _shutdown(self) -> None:
        with self._lock:
            self._queue.extend([None] * len(self._threads))
            self._lock.notify_all()
