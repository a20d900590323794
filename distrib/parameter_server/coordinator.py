"""ClusterCoordinator: schedules closures on workers asynchronously, re-runs those whose worker died, joins them."""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from typing import Any, Callable

import optree

from distrib.errors import ContextError
from distrib.parameter_server.closures import function_name, pack
from distrib.parameter_server.dispatch import Closure, ClosureQueue
from distrib.parameter_server.worker import PerWorkerDataset



class RemoteValue:
    """The result of a scheduled closure, available once a worker has run it.

    `fetch()` (and `get()`) waits for it and returns it, or raises the closure's error as its own type.

    Args:
      closure_id: the scheduled closure's number, in scheduling order.

    Example:
      >>> import distrib
      >>> strategy = distrib.ParameterServerStrategy(distrib.cluster_resolver.RayClusterResolver(1, 1))
      >>> coordinator = distrib.coordinator.ClusterCoordinator(strategy)
      >>> result = coordinator.schedule(lambda: {"loss": 0.25})
      >>> result.fetch()
      {'loss': 0.25}
      >>> failed = coordinator.schedule(lambda: 1 / 0)
      >>> failed.fetch()
      Traceback (most recent call last):
      ZeroDivisionError: division by zero
      >>> coordinator.join()
      Traceback (most recent call last):
      ZeroDivisionError: division by zero
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
        self._worker_strategy = strategy._worker_factory()  # what each closure enters on its worker
        self._ids = itertools.count()
        self._queue = ClosureQueue(strategy._cluster.start_workers(), strategy._cluster.forget)
        weakref.finalize(self, self._queue.stop)  # a coordinator dropped with its strategy ends its threads

    @property
    def strategy(self) -> Any:
        return self._strategy

    # -- scheduling -------------------------------------------------------------------------------------

    def schedule(self, fn: Callable, args: Any = None, kwargs: Any = None) -> RemoteValue:
        """Queues `fn(*args, **kwargs)` for the first free worker; returns its `RemoteValue` at once.

        Per-worker values in `args`/`kwargs` (from `create_per_worker_dataset`) become the running worker's; a
        `RemoteValue` becomes its result (TensorFlow resolves it on the worker), so the closure waits for it.

        Raises:
          TypeError: fn or its arguments cannot travel to a worker (not picklable), such as a variable created
            outside `strategy.scope()`; the message names the object.
        """
        if not callable(fn):
            raise TypeError(f"schedule needs a callable fn. Received: {type(fn).__name__}.")
        if args is not None and not isinstance(args, (list, tuple)):
            raise TypeError(f"args must be a tuple or list. Received: {type(args).__name__}.")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs must be a dict. Received: {type(kwargs).__name__}.")
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        make_payload = functools.partial(_pack, self._worker_strategy, fn, args, kwargs)
        inputs = [leaf for leaf in optree.tree_leaves((args, kwargs), none_is_leaf=True)
                  if isinstance(leaf, RemoteValue)]
        ready = all(value._done.is_set() and value._error is None for value in inputs)
        # Pickled now when it can be, so what cannot travel fails here; a closure waiting for other closures'
        # results is pickled by its dispatcher, once they are done (their errors are then its own).
        closure = Closure(next(self._ids), function_name(fn), make_payload() if ready else make_payload,
                          RemoteValue)
        self._queue.put(closure)
        return closure.result

    def join(self) -> None:
        """Waits until every scheduled closure has finished; raises the first error one of them raised."""
        self._queue.wait_until_finished()
        self._queue.raise_error()

    def done(self) -> bool:
        """Whether every scheduled closure has finished; raises the first error one of them raised."""
        finished = self._queue.finished()
        if finished:
            self._queue.raise_error()
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
        return f"<ClusterCoordinator workers={self._queue.num_workers} unfinished={self._queue.unfinished}>"


def _pack(scope: Callable[[], Any], fn: Callable, args: tuple, kwargs: dict) -> bytes:
    """The closure pickled, each RemoteValue in its arguments replaced by its result (raising its error)."""
    args, kwargs = optree.tree_map(lambda leaf: leaf.fetch() if isinstance(leaf, RemoteValue) else leaf,
                                   (args, kwargs), none_is_leaf=True)
    return pack(scope, fn, args, kwargs)
