"""Distributed datasets: global batches split across replicas, or per-replica pipelines from a function.

`DistributedDataset` splits each global batch of B rows into consecutive slices of ceil(B / N) rows, one per
replica, the trailing replicas short or empty (an empty batch keeps the trailing shape), exactly as TensorFlow
2.21 splits batches whose size is not known in advance. Where each worker of a multi-worker job reads whole
batches (by file, or `AutoShardPolicy.OFF`), every batch it reads is split the same way into N pieces, and each
step its replicas take the next pieces in order, as TensorFlow's rebatched dataset feeds them (a step still
holds one global batch's worth of rows). `DistributedDatasetsFromFunction` does no splitting:
each replica takes one element per step from the pipeline `dataset_fn` built. Both prepare the next
`experimental_per_replica_buffer_size` steps in a background thread, so input work overlaps the training step.
"""

from __future__ import annotations

import collections
import inspect
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from distrib.input.batches import (ArraySpec, EmptyBatches, assemble, batch_leaves, batch_rows, captured, place,
                                   split_bounds)
from distrib.input.contexts import InputContext, InputWorkers
from distrib.errors import OutOfRangeError
from distrib.input.prefetch import END, Prefetcher, stop_reading_ahead
from distrib.options import AutoShardPolicy, InputOptions, InputReplicationMode
from distrib.values import format_path, unflatten


class Optional:
    """A value that may be absent, returned by `DistributedIterator.get_next_as_optional`."""

    def __init__(self, value: Any = None, has_value: bool = False, element_spec: Callable[[], Any] | None = None):
        self._value, self._has_value, self._element_spec = value, has_value, element_spec

    def has_value(self) -> bool:
        return self._has_value

    @property
    def element_spec(self) -> Any:
        """The iterator's `element_spec`, the value's structure, known with or without a value (TensorFlow's)."""
        if self._element_spec is None:
            raise ValueError("This Optional was not made by an iterator: it has no element_spec.")
        return self._element_spec()

    def get_value(self) -> Any:
        if not self._has_value:
            raise ValueError("The optional has no value: the dataset is exhausted (check has_value() first).")
        return self._value

    def __repr__(self) -> str:
        return f"Optional(has_value={self._has_value})"



class DistributedIterator:
    """Yields one structure of PerReplica values per step (plain arrays with one replica in one process, as in
    TensorFlow); `get_next_as_optional` for the last partial step."""

    def __init__(self, produce: Callable[[], Any], options: InputOptions, element_spec: Callable[[], Any],
                 pace: dict, finish: Callable[[Any], Any] | None = None):
        self._element_spec = element_spec
        # the device buffers plus the one in use, doubled so that each side works in bursts of that size
        depth = max(4, 2 * (options.experimental_per_replica_buffer_size + 1))
        self._prefetcher = Prefetcher(produce, depth, pace, finish,
                                      read_ahead=options.experimental_per_replica_buffer_size > 0)
        weakref.finalize(self, self._prefetcher.close)

    def __iter__(self) -> "DistributedIterator":
        return self

    def __next__(self) -> Any:
        return self._prefetcher.get()

    def get_next(self) -> Any:
        """The next step's per-replica values; `distrib.errors.OutOfRangeError` at the end, as TensorFlow's
        (`next()` raises StopIteration there; this is not one, which would silently end a caller's loop)."""
        try:
            return self._prefetcher.get()
        except StopIteration:
            raise OutOfRangeError("End of sequence: the distributed dataset is exhausted.") from None

    def get_next_as_optional(self) -> Optional:
        """The next step's values wrapped in an Optional that is empty once the data runs out."""
        try:
            return Optional(self._prefetcher.get(), True, self._element_spec)
        except StopIteration:
            return Optional(element_spec=self._element_spec)

    @property
    def element_spec(self) -> Any:
        return self._element_spec()

    def close(self) -> None:
        """Ends the iteration and stops the prefetch thread; later `next` calls raise StopIteration."""
        self._prefetcher.close()


class _DatasetBase:
    """Re-iterable per epoch; one-shot iterators (generator objects) refuse a second epoch instead of yielding none;
    an iterator whose class writes its own `__iter__` is trusted to start over there."""

    def __init__(self, workers: InputWorkers, options: InputOptions | None):
        if options is None:
            options = InputOptions()
        elif not isinstance(options, InputOptions):
            raise TypeError(f"options must be a distrib.InputOptions. Received: {type(options).__name__}.")
        self._workers, self._options = workers, options
        self._spec: Any = None
        self._pace: dict = {}  # the consumer's pace, learned in one epoch and used by the next

    def _record_spec(self, spec: Any, arrays: Sequence[Any]) -> None:
        """Records the first element's spec; a later element of another structure or dtype is refused, as a
        TensorFlow dataset's elements all have its one `element_spec` (trailing shapes may vary)."""
        dtypes = [a.dtype for a in arrays]
        if self._spec is None:
            self._first = (spec, dtypes)
            self._spec = unflatten(spec, [ArraySpec((None,) + tuple(a.shape[1:]), a.dtype) for a in arrays])
        elif spec != self._first[0]:
            raise ValueError(f"Every element of a dataset must have the structure of the first (its element_spec). "
                             f"Received: {spec}, the first was {self._first[0]}.")
        elif dtypes != self._first[1]:
            k = next(k for k, (dtype, first) in enumerate(zip(dtypes, self._first[1])) if dtype != first)
            raise TypeError(f"Every element of a dataset must have the dtypes of the first (its element_spec). "
                            f"Received: {dtypes[k]} at path {format_path(spec.paths()[k])}, where the first element "
                            f"had {self._first[1][k]}.")

    @property
    def element_spec(self) -> Any:
        """The structure of a per-replica batch, leaves `ArraySpec((None, ...), dtype)`; known after the first step."""
        if self._spec is None:
            raise ValueError("element_spec is known once the first batch has been read; iterate first.")
        return self._spec

    def _element_spec(self) -> Any:
        return self.element_spec


NO_DATA = object()  # produced once this worker's data has run out
SHARD_EMPTY = ("A worker's shard of the dataset is empty while other workers have data: its replicas' empty batches "
               "would need the structure of an element it never saw. Shard the dataset so that every worker gets at "
               "least one batch.")
RAN_OUT = ("A worker's pipelines produced no element while other workers have data: its replicas' empty batches "
           "would need the structure of an element it never saw. Shard the data so that every worker's pipeline "
           "has at least one element.")


def step_or_end(workers: InputWorkers, options: InputOptions, empty: EmptyBatches, count: int,
                no_data: str) -> Callable[[Any], Any]:
    """What the consumer makes of a produced step: the end once no worker has data, else the step, or `count`
    empty batches for this worker's replicas while others still have data.

    The end-of-input check across workers runs here, once per step asked for, not where steps are produced (a
    thread may produce ahead): every worker then makes the same checks, also for an iterator left before its end.
    Until every worker has seen an element, a second check asks whether one has not: a worker without data from
    the start cannot shape empty batches, and every worker raises `no_data` at that step, not that one alone
    (the others would wait for it in their next collective).
    """
    settled = [workers.num_workers == 1]  # every worker knows the element's structure

    def finish(step: Any) -> Any:
        if not workers.any_worker_has_data(step is not NO_DATA):
            raise StopIteration
        if not settled[0]:
            mine = step is NO_DATA and not empty.known
            if workers.any_worker_has_data(mine):
                where = f"this worker (index {workers.worker_index} of {workers.num_workers})" if mine else \
                    "another worker"
                raise ValueError(f"{no_data} Received: no element on {where} before its first step.")
            settled[0] = True
        if step is not NO_DATA:
            return step
        spec, per_replica = empty.make(count, no_data)
        return assemble(spec, place(workers, options, per_replica), workers.wraps_values)

    return finish


# classes whose `__iter__`, written in Python, is the iterator protocol's identity and starts nothing over
_IDENTITY_ITER_MODULES = frozenset({"_collections_abc", "collections.abc", "typing"})


def _restarts_itself(source: Any) -> bool:
    """Whether an iterator that is its own iterable may start over in `__iter__` (a loader that resets an index
    there): its class writes `__iter__` itself. Generators, `iter(list)`, files and other built-in iterators (and
    `collections.abc.Iterator`'s inherited `__iter__`) return themselves as they are: one-shot."""
    owner = next((k for k in type(source).__mro__ if "__iter__" in vars(k)), None)
    return owner is not None and inspect.isfunction(vars(owner)["__iter__"]) and \
        owner.__module__ not in _IDENTITY_ITER_MODULES


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
    opened = [False]

    def open_epoch() -> Iterator:
        iterator = iter(source)
        if iterator is source and opened[0] and not _restarts_itself(source):
            raise ValueError(f"{kind} is a one-shot iterator (e.g. a generator object) that was already consumed; "
                             f"pass a re-iterable (a list, or an object whose __iter__ starts over) to iterate "
                             f"more than one epoch.")
        opened[0] = True
        return iterator

    return open_epoch


class DistributedDataset(_DatasetBase):
    """A dataset of global batches, split along axis 0 across the replicas; iterate it once per epoch.

    Create it with `Strategy.experimental_distribute_dataset`. With several input workers, a dataset that has a
    `shard(num_shards, index)` method is sharded by it (e.g. by file); otherwise each worker keeps its
    replicas' slices of every global batch (by data). A worker that reads whole batches (by file, or with
    `AutoShardPolicy.OFF`) rebatches them as TensorFlow does: each batch into `num_replicas_in_sync` pieces of
    ceil(B / N) rows, its replicas taking the next pieces each step.
    """

    def __init__(self, dataset: Iterable, workers: InputWorkers, options: InputOptions | None = None):
        super().__init__(workers, options)
        if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            raise NotImplementedError("InputReplicationMode.PER_REPLICA is only supported by "
                                      "distribute_datasets_from_function.")
        policy, can_shard = self._options.auto_shard_policy, callable(getattr(dataset, "shard", None))
        if policy is AutoShardPolicy.FILE and not can_shard:
            raise ValueError(f"AutoShardPolicy.FILE needs a dataset with a shard(num_shards, index) method. "
                             f"Received: {type(dataset).__name__}.")
        self._by_file = workers.num_workers > 1 and (policy is AutoShardPolicy.FILE or
                                                     (policy is AutoShardPolicy.AUTO and can_shard))
        if self._by_file:
            dataset = dataset.shard(workers.num_workers, workers.worker_index)
        # each worker reads whole batches and rebatches them into num_replicas_in_sync pieces (TensorFlow's
        # "rebatch, then shard"); with one worker that is the split by data, taken unchanged
        self._each_worker_whole = workers.num_workers > 1 and (self._by_file or policy is AutoShardPolicy.OFF)
        self._open = _reiterable(dataset, "The dataset")

    def __iter__(self) -> DistributedIterator:
        stop_reading_ahead(self._pace)  # earlier epochs' prefetch threads leave the source before it starts over
        empty = EmptyBatches()
        produce = (self._rebatched if self._each_worker_whole else self._split)(self._open(), empty)
        return DistributedIterator(produce, self._options, self._element_spec, self._pace, step_or_end(
            self._workers, self._options, empty, len(self._workers.devices), SHARD_EMPTY))

    def _split(self, batches: Iterator, empty: EmptyBatches) -> Callable[[], Any]:
        """`produce` for a worker that keeps its replicas' slices of every global batch (by data, or one worker):
        TensorFlow's split of a batch of unknown size over every replica of every worker."""
        workers, options = self._workers, self._options
        local = len(workers.devices)
        slices, first = workers.num_replicas_in_sync, workers.first_local_replica
        ended = [False]  # the source is not read past its end: an iterator that rewinds there would start over

        def produce() -> Any:
            batch = END if ended[0] else next(batches, END)
            if batch is END:
                ended[0] = True
                return NO_DATA
            arrays, spec = batch_leaves(batch, workers.backend, "dataset element")
            arrays = captured(batch, arrays, spec, workers.backend)
            bounds = split_bounds(batch_rows(arrays, spec, "dataset element"), slices)[first:first + local]
            self._record_spec(spec, arrays)
            empty.remember(spec, arrays)
            per_replica = [[a[start:stop] for a in arrays] for start, stop in bounds]
            return assemble(spec, place(workers, options, per_replica), workers.wraps_values)

        return produce

    def _rebatched(self, batches: Iterator, empty: EmptyBatches) -> Callable[[], Any]:
        """`produce` for a worker that reads whole batches: TensorFlow's legacy rebatch (batch sizes unknown in
        advance) splits each batch into num_replicas_in_sync pieces of ceil(B / N) rows, empty ones included, and
        the worker's multi-device iterator hands them to its replicas in turn, so each step takes the next `local`
        pieces, across batch boundaries where `local` does not divide N (workers of different replica counts).
        Input ending mid-step leaves the remaining replicas empty batches; NO_DATA once no piece is left."""
        workers, options = self._workers, self._options
        local, count = len(workers.devices), workers.num_replicas_in_sync
        pieces: collections.deque = collections.deque()  # (structure, leaves) of pieces not handed out yet
        ended = [False]

        def produce() -> Any:
            if pieces and not ended[0] and len(pieces) < local:
                # views of a batch held past the next read: a loader that refills one buffer would overwrite them
                for _ in range(len(pieces)):
                    spec, arrays = pieces.popleft()
                    pieces.append((spec, [a.copy() for a in arrays]))
            while len(pieces) < local and not ended[0]:
                batch = next(batches, END)
                if batch is END:
                    ended[0] = True
                    break
                arrays, spec = batch_leaves(batch, workers.backend, "dataset element")
                arrays = captured(batch, arrays, spec, workers.backend)
                rows = batch_rows(arrays, spec, "dataset element")
                self._record_spec(spec, arrays)
                empty.remember(spec, arrays)
                pieces.extend((spec, [a[start:stop] for a in arrays]) for start, stop in split_bounds(rows, count))
            if not pieces:
                return NO_DATA
            taken = [pieces.popleft() for _ in range(min(local, len(pieces)))]
            spec = taken[0][0]  # every batch's (`_record_spec` refuses another)
            per_replica = [arrays for _, arrays in taken]
            if len(per_replica) < local:  # the input ended mid-step
                per_replica += empty.make(local - len(per_replica), SHARD_EMPTY)[1]
            return assemble(spec, place(workers, options, per_replica), workers.wraps_values)

        return produce

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
        self._options.check_dataset_placement()
        count = workers.num_replicas_in_sync
        if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            first = workers.first_local_replica
            contexts = [InputContext(count, first + i, count) for i in range(len(workers.devices))]
        else:
            contexts = [InputContext(workers.num_workers, workers.worker_index, count)]
        self._opens = [_reiterable(dataset_fn(ctx), "The dataset returned by dataset_fn") for ctx in contexts]

    def __iter__(self) -> DistributedIterator:
        stop_reading_ahead(self._pace)  # earlier epochs' prefetch threads leave the sources before they start over
        pipelines = [open_epoch() for open_epoch in self._opens]
        workers, options = self._workers, self._options
        local = len(workers.devices)
        shared = len(pipelines) != local  # one pipeline per worker feeds its replicas in turn
        ended = [False] * len(pipelines)  # a pipeline is not read past its end (one that rewinds would start over)
        empty = EmptyBatches()

        def produce() -> Any:
            per_replica, spec = [], None
            for r in range(local):
                index = 0 if shared else r
                element = END if ended[index] else next(pipelines[index], END)
                if element is END:
                    ended[index] = True
                    per_replica.append(None)
                    continue
                arrays, element_spec = batch_leaves(element, workers.backend, "per-replica batch")
                arrays = captured(element, arrays, element_spec, workers.backend)
                batch_rows(arrays, element_spec, "per-replica batch")
                if spec is not None and element_spec != spec:
                    raise ValueError(f"Every replica's batch must have the same structure. Received: "
                                     f"{element_spec} vs {spec}.")
                spec = element_spec
                empty.remember(spec, arrays)
                self._record_spec(spec, arrays)
                per_replica.append(arrays)
            if spec is None:
                return NO_DATA
            if None in per_replica:  # replicas whose pipelines ran out get empty batches
                spec, blanks = empty.make(per_replica.count(None), RAN_OUT)
                blanks = iter(blanks)
                per_replica = [arrays if arrays is not None else next(blanks) for arrays in per_replica]
            return assemble(spec, place(workers, options, per_replica), workers.wraps_values)

        return DistributedIterator(produce, options, self._element_spec, self._pace,
                                   step_or_end(workers, options, empty, local, RAN_OUT))

    def __repr__(self) -> str:
        return f"<DistributedDatasetsFromFunction replicas={self._workers.num_replicas_in_sync}>"
