"""The worker: a Ray actor that runs scheduled closures, and the per-worker values (datasets, iterators) it resolves."""

from __future__ import annotations

import itertools
import os
from typing import Any, Callable

import optree

from distrib.errors import OutOfRangeError
from distrib.parameter_server.write_tags import closure_writes

_ids = itertools.count()


class PerWorkerValues:
    """One value per worker, made on the worker by `make()` the first time a closure there uses it.

    Passed to `ClusterCoordinator.schedule`, each closure receives the value of the worker it runs on. A worker
    that is replaced makes its value again.
    """

    def __init__(self, make: Callable[[], Any]):
        self._make = make
        self._key = next(_ids)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} key={self._key}>"


class PerWorkerDataset(PerWorkerValues):
    """A dataset made on each worker (`ClusterCoordinator.create_per_worker_dataset`); `iter()` gives per-worker
    iterators.

    Args:
      make: called with no arguments on each worker, the first time a closure there uses the dataset.

    Example:
      >>> import distrib
      >>> strategy = distrib.ParameterServerStrategy(distrib.cluster_resolver.RayClusterResolver(1, 1))
      >>> coordinator = distrib.coordinator.ClusterCoordinator(strategy)
      >>> iterator = iter(coordinator.create_per_worker_dataset(lambda: range(100, 200)))
      >>> [coordinator.schedule(next, args=(iterator,)).fetch() for _ in range(3)]  # one worker: its own order
      [100, 101, 102]
    """

    def __iter__(self) -> "PerWorkerIterator":
        make = self._make
        return PerWorkerIterator(lambda: iter(make()))


class PerWorkerIterator(PerWorkerValues):
    """One iterator per worker: pass it to `schedule` and call `next()` on it inside the closure."""

    def __next__(self) -> Any:
        raise TypeError("A per-worker iterator is read inside a scheduled closure, where it is the worker's own: "
                        "pass it to coordinator.schedule(fn, args=(iterator,)) and call next() in fn.")


class Worker:
    """Runs closures one at a time; a closure's error comes back as a value, so only a dead process fails a call.

    Args:
      index: the worker's task index in the cluster (`/job:worker/task:<index>`).
    """

    def __init__(self, index: int):
        self.index = index
        self._values: dict[int, Any] = {}  # PerWorkerValues key -> this worker's value

    def run(self, closure_id: int, name: str, payload: bytes) -> tuple[str, Any]:
        """("ok", fn's result) or ("error", the exception fn raised), for `payload`: fn, args and kwargs pickled by
        the coordinator (closures.pack); `name` is fn's, for messages."""
        from ray import cloudpickle  # a worker is a Ray actor: Ray is there

        try:
            fn, args, kwargs = cloudpickle.loads(payload)
            args, kwargs = optree.tree_map(self._resolve, (tuple(args), dict(kwargs)), none_is_leaf=True)
            with closure_writes(closure_id):
                return "ok", fn(*args, **kwargs)
        except StopIteration:  # TensorFlow's OutOfRangeError: a bare StopIteration would end the caller's loops
            return "error", OutOfRangeError(f"Scheduled function {name!r} ran out of input: next() on an exhausted "
                                            f"iterator (a per-worker dataset's end) raised StopIteration. Received: "
                                            f"closure {closure_id}.")
        except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - every error of user code goes back (Ray would
            return "error", _picklable(exc)  # report a KeyboardInterrupt as its own TaskCancelledError)

    def pid(self) -> int:
        return os.getpid()

    def _resolve(self, leaf: Any) -> Any:
        if isinstance(leaf, PerWorkerValues):
            if leaf._key not in self._values:
                self._values[leaf._key] = leaf._make()
            return self._values[leaf._key]
        return leaf


def run_in_scope(make_strategy: Callable[[], Any], fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` under the scope of the strategy `make_strategy()` gives on this worker: a closure
    runs in its strategy's cross-replica context, as TensorFlow traces a scheduled function under the
    strategy's scope (so optimizers and `get_strategy()` see the strategy)."""
    with make_strategy().scope():
        return fn(*args, **kwargs)


def _picklable(exc: BaseException) -> Any:
    """`exc` itself when it survives pickling, else its class rebuilt without calling `__init__` (an exception whose
    `__init__` takes other arguments than its `args`), else a RuntimeError carrying its type and message.

    Pickled as Ray pickles the result, by cloudpickle: a class defined in the program's `__main__` (shipped to this
    worker by value, with the closure) survives too, and the coordinator gets its own class back, so its `except`
    catches it; plain pickle could not find that class by name here."""
    from ray import cloudpickle  # a worker is a Ray actor: Ray is there

    for candidate in (exc, _Rebuilt(exc)):
        try:
            if isinstance(cloudpickle.loads(cloudpickle.dumps(candidate)), type(exc)):
                return candidate
        except Exception:  # noqa: BLE001
            pass
    return RuntimeError(f"{type(exc).__name__}: {exc}")


class _Rebuilt:
    """Pickles as its exception's class, `args` and attributes, and unpickles as that exception, rebuilt with
    `__new__`: pickle's default calls `cls(*args)`, which fails for `BadErr(message, code)` storing only message."""

    def __init__(self, exc: BaseException):
        self._exc = exc

    def __reduce__(self):
        return _rebuild, (type(self._exc), self._exc.args, dict(vars(self._exc)))


def _rebuild(cls: type, args: tuple, attributes: dict) -> BaseException:
    exc = cls.__new__(cls, *args)
    exc.args = args
    vars(exc).update(attributes)
    return exc
