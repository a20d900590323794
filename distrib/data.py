"""Distributed input: global batches split across replicas, per-replica pipelines, and background prefetch.

`DistributedDataset` splits each global batch of B rows into consecutive slices of ceil(B / N) rows, one per
replica, the trailing replicas short or empty (an empty batch keeps the trailing shape), exactly as TensorFlow
2.21 splits batches whose size is not known in advance. `DistributedDatasetsFromFunction` does no splitting:
each replica takes one element per step from the pipeline `dataset_fn` built. Both prepare the next
`experimental_per_replica_buffer_size` steps in a background thread, so input work overlaps the training step.
"""

from __future__ import annotations

import _thread
import atexit
import collections
import functools
import math
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from distrib.backends.base import Backend
from distrib.options import InputOptions, InputReplicationMode
from distrib.values import PerReplica, flatten, format_path, unflatten


class ValueContext:
    """What `experimental_distribute_values_from_function` tells `value_fn`: which replica, out of how many."""

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"ValueContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


class InputContext:
    """What `distribute_datasets_from_function` tells `dataset_fn`: which pipeline it builds, out of how many.

    Example:
      >>> InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=4).get_per_replica_batch_size(8)
      2
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1):
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """`global_batch_size // num_replicas_in_sync`; ValueError unless it divides evenly."""
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(f"The global batch size ({global_batch_size}) must be divisible by the number of "
                             f"replicas in sync ({self.num_replicas_in_sync}).")
        return global_batch_size // self.num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"InputContext(num_input_pipelines={self.num_input_pipelines}, input_pipeline_id="
                f"{self.input_pipeline_id}, num_replicas_in_sync={self.num_replicas_in_sync})")


@dataclass(frozen=True)
class InputWorkers:
    """Where this process's input goes: its replicas' devices, and its place among the input workers.

    A multi-worker strategy sets `num_workers`/`worker_index` and `any_worker_has_data`, which must return True
    while any worker still has data, so that every worker stops on the same step.
    """

    backend: Backend
    devices: tuple[str, ...]  # this worker's replicas
    num_workers: int = 1
    worker_index: int = 0
    any_worker_has_data: Callable[[bool], bool] = field(default=lambda local: local)

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self.devices) * self.num_workers


class ArraySpec(NamedTuple):
    """Shape and dtype of one leaf of a per-replica batch; the batch dimension is None (it varies)."""

    shape: tuple
    dtype: np.dtype


class Optional:
    """A value that may be absent, returned by `DistributedIterator.get_next_as_optional`."""

    def __init__(self, value: Any = None, has_value: bool = False):
        self._value, self._has_value = value, has_value

    def has_value(self) -> bool:
        return self._has_value

    def get_value(self) -> Any:
        if not self._has_value:
            raise ValueError("The optional has no value: the dataset is exhausted (check has_value() first).")
        return self._value

    def __repr__(self) -> str:
        return f"Optional(has_value={self._has_value})"


# -- turning a dataset element into arrays ----------------------------------------------------------------

def _batch_leaves(element: Any, backend: Backend, what: str) -> tuple[list, Any]:
    """Leaves of one dataset element as arrays with a batch dimension, and the structure's spec."""
    leaves, spec = flatten(element)
    if not leaves:
        raise ValueError(f"A {what} must hold at least one array. Received: {element!r}.")
    native = (np.ndarray, backend.xp.ndarray)
    arrays = []
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, native) and leaf.ndim and leaf.dtype.kind not in "OSU":
            arrays.append(leaf)  # the common case, checked in one line
            continue
        try:
            array = leaf if isinstance(leaf, native) else backend.to_host(leaf)
        except TypeError as exc:
            raise TypeError(f"Every leaf of a {what} must be an array. Received: {type(leaf).__name__} at path "
                            f"{format_path(spec.paths()[k])}.") from exc
        if array.ndim == 0:
            hint = " (a Python list is a structure, not an array: use np.asarray)" if spec.paths()[k] and \
                isinstance(spec.paths()[k][-1], int) else ""
            raise ValueError(f"Every leaf of a {what} needs a leading batch dimension to split across replicas. "
                             f"Received: a scalar at path {format_path(spec.paths()[k])}{hint}.")
        if array.dtype.kind in "OSU":
            raise TypeError(f"Every leaf of a {what} must be a numeric array. Received: dtype {array.dtype} at "
                            f"path {format_path(spec.paths()[k])}.")
        arrays.append(array)
    return arrays, spec


def _rows(arrays: Sequence[Any], spec: Any, what: str) -> int:
    """The batch size shared by every leaf; ValueError naming the paths when they disagree."""
    rows = arrays[0].shape[0]
    for k, array in enumerate(arrays[1:], start=1):
        if array.shape[0] != rows:
            paths = spec.paths()
            raise ValueError(f"Every leaf of a {what} must have the same batch size. Received: path "
                             f"{format_path(paths[k])} has {array.shape[0]} rows, path {format_path(paths[0])} has "
                             f"{rows}.")
    return rows


@functools.lru_cache(maxsize=256)
def split_bounds(rows: int, num_slices: int) -> tuple[tuple[int, int], ...]:
    """Row ranges of TensorFlow's split of a batch of unknown size: slices of ceil(rows / n), the last short.

    Example:
      >>> split_bounds(7, 4), split_bounds(5, 4)
      (((0, 2), (2, 4), (4, 6), (6, 7)), ((0, 2), (2, 4), (4, 5), (5, 5)))
    """
    size = math.ceil(rows / num_slices) if rows else 0
    return tuple((min(i * size, rows), min((i + 1) * size, rows)) for i in range(num_slices))


def _place(workers: InputWorkers, options: InputOptions, per_replica: list[list[Any]]) -> list[list[Any]]:
    if not options.experimental_fetch_to_device:
        return [[workers.backend.to_host(a) for a in arrays] for arrays in per_replica]
    return [workers.backend.prefetch_to_device(arrays, device) for arrays, device in zip(per_replica, workers.devices)]


class _EmptyBatches:
    """Empty batches shaped like the latest real one, for replicas that get no rows in a step.

    Only the structure, trailing shapes and dtypes are kept: holding arrays (even empty views) would pin the
    whole batch they came from.
    """

    def __init__(self):
        self._spec: Any = None
        self._leaves: list[tuple[tuple, np.dtype]] = []

    def remember(self, spec: Any, arrays: Sequence[Any]) -> None:
        self._spec, self._leaves = spec, [(a.shape[1:], a.dtype) for a in arrays]

    def make(self, count: int, no_data: str) -> tuple[Any, list[list[np.ndarray]]]:
        """`count` empty batches (host arrays, placed later) and their structure; ValueError(no_data) if no
        batch has been seen yet to take the shapes from."""
        if self._spec is None:
            raise ValueError(no_data)
        return self._spec, [[np.empty((0,) + shape, dtype) for shape, dtype in self._leaves] for _ in range(count)]


def _assemble(spec: Any, per_replica: list[list[Any]]) -> Any:
    """One structure whose leaves are PerReplica values, from each replica's list of leaves."""
    return unflatten(spec, [PerReplica._wrap(tuple(column)) for column in zip(*per_replica)])


# -- prefetching --------------------------------------------------------------------------------------------

_END = object()


class _Signal:
    """A wake-up call between two threads: `wait` returns once `notify` was called since the last wait."""

    def __init__(self):
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def notify(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # already notified and not yet consumed
            pass

    def wait(self, timeout: float) -> None:
        self._lock.acquire(timeout=timeout)


class _Prefetcher:
    """Prepares up to `depth` steps ahead in a daemon thread while the consumer is busy; exceptions keep order.

    Handing a step from one thread to the other costs GIL handoffs (~20 us on two cores), which only pays when
    the consumer spends longer than that away between steps (a training step). So steps are produced inline
    until the consumer's measured time away per step exceeds `AHEAD_AFTER_SECONDS`; from then on a thread
    runs ahead. The choice is remembered in `pace` (shared by a dataset's epochs). Both sides work in bursts of
    half the buffer to wake each other rarely. The thread holds no reference to the iterator that owns it, so
    dropping the iterator stops the thread.
    """

    AHEAD_AFTER_SECONDS = 30e-6

    def __init__(self, produce: Callable[[], Any], depth: int, pace: dict):
        self._produce, self._depth, self._pace = produce, depth, pace
        self._half = max(1, depth // 2)
        self._items: collections.deque = collections.deque()
        self._filled, self._drained = _Signal(), _Signal()
        self._state = {"waiting": False, "stopped": False}
        self._thread: threading.Thread | None = None
        self._returned_at: float | None = None
        self._done = False
        if pace.get("ahead"):
            self._start_thread()

    def _start_thread(self) -> None:
        self._pace["ahead"] = True
        self._thread = threading.Thread(
            target=self._fill, args=(self._produce, self._depth, self._half, self._items, self._filled,
                                     self._drained, self._state),
            daemon=True, name="distrib-input-prefetch")
        self._thread.start()
        _LIVE.add(self)

    @staticmethod
    def _fill(produce, depth, half, items, filled, drained, state) -> None:
        while not state["stopped"]:
            if len(items) >= depth:
                filled.notify()
                while len(items) > half and not state["stopped"]:
                    drained.wait(timeout=0.1)
                continue
            item = _produce_one(produce)
            items.append(item)
            final = item is _END or isinstance(item, BaseException)
            if final or (state["waiting"] and len(items) >= half):
                filled.notify()
            if final:
                return

    def get(self) -> Any:
        if self._done:
            raise StopIteration
        if self._thread is None:
            if self._returned_at is not None and self._consumer_is_busy(time.perf_counter() - self._returned_at):
                self._start_thread()
            item = _produce_one(self._produce) if self._thread is None else self._pop()
        else:
            item = self._pop()
        if item is _END or isinstance(item, BaseException):
            self.close()
            if item is not _END:
                raise item
            raise StopIteration
        if self._thread is None:
            self._returned_at = time.perf_counter()
        return item

    def _consumer_is_busy(self, away: float) -> bool:
        """Whether the consumer's time away per step (median of the first 8, then a moving average) is long."""
        samples = self._pace.setdefault("samples", [])
        if len(samples) < 8:  # a median, so that one garbage collection does not decide
            samples.append(away)
            if len(samples) < 8:
                return False
            self._pace["away"] = sorted(samples)[4]
        else:
            self._pace["away"] = 0.95 * self._pace["away"] + 0.05 * away
        return self._pace["away"] > self.AHEAD_AFTER_SECONDS

    def _pop(self) -> Any:
        while True:
            try:
                item = self._items.popleft()
            except IndexError:
                self._state["waiting"] = True
                self._filled.wait(timeout=0.05)
                self._state["waiting"] = False
                continue
            if len(self._items) <= self._half:
                self._drained.notify()
            return item

    def close(self) -> None:
        """Ends the iteration: the thread, if any, stops and later calls raise StopIteration."""
        self._done = True
        self._state["stopped"] = True
        self._drained.notify()


_LIVE: "weakref.WeakSet[_Prefetcher]" = weakref.WeakSet()


@atexit.register
def _stop_prefetch_threads() -> None:
    """Stops running prefetch threads before the interpreter finalizes: a daemon thread still inside NumPy or
    optree when the interpreter tears down aborts the process."""
    prefetchers = list(_LIVE)
    for prefetcher in prefetchers:
        prefetcher.close()
    for prefetcher in prefetchers:
        if prefetcher._thread is not None:
            prefetcher._thread.join(timeout=2.0)


def _produce_one(produce: Callable[[], Any]) -> Any:
    """One step, or _END, or the exception producing it raised (delivered in order)."""
    try:
        return produce()
    except StopIteration:
        return _END
    except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer, at the step it belongs to
        return exc


# -- iterators ------------------------------------------------------------------------------------------------

class DistributedIterator:
    """Yields one structure of PerReplica values per step; `get_next_as_optional` for the last partial step."""

    def __init__(self, produce: Callable[[], Any], options: InputOptions, element_spec: Callable[[], Any],
                 pace: dict):
        self._element_spec = element_spec
        # the device buffers plus the one in use, doubled so that each side works in bursts of that size
        depth = max(4, 2 * (options.experimental_per_replica_buffer_size + 1))
        self._prefetcher = _Prefetcher(produce, depth, pace)
        weakref.finalize(self, self._prefetcher.close)

    def __iter__(self) -> "DistributedIterator":
        return self

    def __next__(self) -> Any:
        return self._prefetcher.get()

    def get_next(self) -> Any:
        """The next step's per-replica values; StopIteration (OutOfRange in TensorFlow) at the end."""
        return self._prefetcher.get()

    def get_next_as_optional(self) -> Optional:
        """The next step's values wrapped in an Optional that is empty once the data runs out."""
        try:
            return Optional(self._prefetcher.get(), True)
        except StopIteration:
            return Optional()

    @property
    def element_spec(self) -> Any:
        return self._element_spec()

    def close(self) -> None:
        """Ends the iteration and stops the prefetch thread; later `next` calls raise StopIteration."""
        self._prefetcher.close()


class _DatasetBase:
    """Re-iterable per epoch; one-shot iterables (generator objects) refuse a second epoch instead of yielding none."""

    def __init__(self, workers: InputWorkers, options: InputOptions | None):
        if options is None:
            options = InputOptions()
        elif not isinstance(options, InputOptions):
            raise TypeError(f"options must be a distrib.InputOptions. Received: {type(options).__name__}.")
        self._workers, self._options = workers, options
        self._spec: Any = None
        self._pace: dict = {}  # the consumer's pace, learned in one epoch and used by the next

    def _record_spec(self, spec: Any, arrays: Sequence[Any]) -> None:
        if self._spec is None:
            self._spec = unflatten(spec, [ArraySpec((None,) + tuple(a.shape[1:]), a.dtype) for a in arrays])

    @property
    def element_spec(self) -> Any:
        """The structure of a per-replica batch, leaves `ArraySpec((None, ...), dtype)`; known after the first step."""
        if self._spec is None:
            raise ValueError("element_spec is known once the first batch has been read; iterate first.")
        return self._spec

    def _element_spec(self) -> Any:
        return self.element_spec


def _reiterable(source: Iterable, kind: str) -> Callable[[], Iterator]:
    """A function that opens a fresh iterator per epoch, refusing to silently restart a one-shot iterator."""
    if not hasattr(source, "__iter__") or isinstance(source, (str, bytes)):
        raise TypeError(f"{kind} must be iterable (a list, a generator, a dataset object). Received: "
                        f"{type(source).__name__}.")
    if isinstance(source, Mapping) or hasattr(source, "__array__") or hasattr(source, "__dlpack__"):
        unit = "key" if isinstance(source, Mapping) else "row"
        raise TypeError(f"{kind} must be an iterable of batches, not a single {type(source).__name__} (which "
                        f"would be read {unit} by {unit}). Pass a list of batches, e.g. "
                        f"[x[i:i + 64] for i in range(0, len(x), 64)].")
    opened = []

    def open_epoch() -> Iterator:
        iterator = iter(source)
        if iterator is source and opened:
            raise ValueError(f"{kind} is a one-shot iterator (e.g. a generator object) that was already consumed; "
                             f"pass a re-iterable (a list, or an object whose __iter__ starts over) to iterate "
                             f"more than one epoch.")
        opened.append(True)
        return iterator

    return open_epoch


class DistributedDataset(_DatasetBase):
    """A dataset of global batches, split along axis 0 across the replicas; iterate it once per epoch.

    Create it with `Strategy.experimental_distribute_dataset`. With several input workers, a dataset that has a
    `shard(num_shards, index)` method is sharded by it (e.g. by file); otherwise each worker keeps its
    replicas' slices of every global batch (by data).
    """

    def __init__(self, dataset: Iterable, workers: InputWorkers, options: InputOptions | None = None):
        super().__init__(workers, options)
        if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            raise NotImplementedError("InputReplicationMode.PER_REPLICA is only supported by "
                                      "distribute_datasets_from_function.")
        self._by_file = workers.num_workers > 1 and callable(getattr(dataset, "shard", None))
        if self._by_file:
            dataset = dataset.shard(workers.num_workers, workers.worker_index)
        self._open = _reiterable(dataset, "The dataset")

    def __iter__(self) -> DistributedIterator:
        batches = self._open()
        workers, options = self._workers, self._options
        local = len(workers.devices)
        slices = local if self._by_file else workers.num_replicas_in_sync
        first = 0 if self._by_file else workers.worker_index * local
        empty = _EmptyBatches()

        def produce() -> Any:
            batch = next(batches, _END)
            has_data = batch is not _END
            if not workers.any_worker_has_data(has_data):
                raise StopIteration
            if not has_data:  # other workers still have data: this worker's replicas get empty batches
                spec, per_replica = empty.make(local, "This worker's shard of the dataset is empty while other "
                                                      "workers have data; shard the dataset so that every worker "
                                                      "has some.")
                return _assemble(spec, _place(workers, options, per_replica))
            arrays, spec = _batch_leaves(batch, workers.backend, "dataset element")
            bounds = split_bounds(_rows(arrays, spec, "dataset element"), slices)[first:first + local]
            self._record_spec(spec, arrays)
            empty.remember(spec, arrays)
            per_replica = [[a[start:stop] for a in arrays] for start, stop in bounds]
            return _assemble(spec, _place(workers, options, per_replica))

        return DistributedIterator(produce, options, self._element_spec, self._pace)

    def __repr__(self) -> str:
        return f"<DistributedDataset replicas={self._workers.num_replicas_in_sync}>"


class DistributedDatasetsFromFunction(_DatasetBase):
    """Per-replica batches from `dataset_fn(InputContext)` pipelines; each replica takes one element per step.

    Create it with `Strategy.distribute_datasets_from_function`. Nothing is re-batched or sharded: `dataset_fn`
    batches with `ctx.get_per_replica_batch_size(global_batch)` and shards by `ctx.input_pipeline_id`.
    """

    def __init__(self, dataset_fn: Callable[[InputContext], Iterable], workers: InputWorkers,
                 options: InputOptions | None = None):
        super().__init__(workers, options)
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn must be callable. Received: {type(dataset_fn).__name__}.")
        count = workers.num_replicas_in_sync
        if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            first = workers.worker_index * len(workers.devices)
            contexts = [InputContext(count, first + i, count) for i in range(len(workers.devices))]
        else:
            contexts = [InputContext(workers.num_workers, workers.worker_index, count)]
        self._opens = [_reiterable(dataset_fn(ctx), "The dataset returned by dataset_fn") for ctx in contexts]

    def __iter__(self) -> DistributedIterator:
        pipelines = [open_epoch() for open_epoch in self._opens]
        workers, options = self._workers, self._options
        local = len(workers.devices)
        pick = ((lambda r: pipelines[r]) if len(pipelines) == local else (lambda r: pipelines[0]))
        empty = _EmptyBatches()

        def produce() -> Any:
            elements = [next(pick(r), _END) for r in range(local)]
            has_data = any(e is not _END for e in elements)
            if not workers.any_worker_has_data(has_data):
                raise StopIteration
            per_replica, spec = [], None
            for element in elements:
                if element is _END:
                    per_replica.append(None)
                    continue
                arrays, element_spec = _batch_leaves(element, workers.backend, "per-replica batch")
                _rows(arrays, element_spec, "per-replica batch")
                if spec is not None and element_spec != spec:
                    raise ValueError(f"Every replica's batch must have the same structure. Received: "
                                     f"{element_spec} vs {spec}.")
                spec = element_spec
                empty.remember(spec, arrays)
                self._record_spec(spec, arrays)
                per_replica.append(arrays)
            if None in per_replica:  # replicas whose pipelines ran out get empty batches
                spec, blanks = empty.make(per_replica.count(None), "This worker's pipelines produced no element "
                                          "while other workers still have data; shard the data so that every "
                                          "worker has some.")
                blanks = iter(blanks)
                per_replica = [arrays if arrays is not None else next(blanks) for arrays in per_replica]
            return _assemble(spec, _place(workers, options, per_replica))

        return DistributedIterator(produce, options, self._element_spec, self._pace)

    def __repr__(self) -> str:
        return f"<DistributedDatasetsFromFunction replicas={self._workers.num_replicas_in_sync}>"
