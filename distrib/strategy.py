"""Strategy and the default strategy: the API contract every strategy keeps, whatever the backend."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from distrib import context, timeline
from distrib.backends import Backend, get_backend
from distrib.backends.cpu import all_ndarrays
from distrib.cross_device_ops import NcclAllReduce
from distrib.distributed_variables import DistributedVariable
from distrib.errors import ContextError
from distrib.extended import NOT_NOW, StrategyExtended
from distrib.input import DistributedDataset, DistributedDatasetsFromFunction, InputContext, ValueContext
from distrib.options import CommunicationOptions, InputOptions, ReduceOp, RunOptions
from distrib.replica_context import ReplicaContext, check_gather_shapes
from distrib.values import (PerReplica, flatten, holds_none, local_components, map_structure, regroup, select_replica,
                            unflatten)
from distrib.variables import Variable


class Strategy:
    """Distributes computation over replicas; the base of MirroredStrategy and of the default strategy.

    Use `scope()` to make it current, `run(fn)` to call `fn` once per replica, and `reduce`, `gather` and
    `experimental_local_results` to bring per-replica results back.
    """

    def __init__(self, extended: StrategyExtended):
        self._extended = extended

    @property
    def extended(self) -> StrategyExtended:
        """Additional APIs for algorithms that need to be distribution-aware."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas are kept in sync."""
        return len(self._extended.worker_devices)

    @property
    def cluster_resolver(self):
        """The cluster resolver of a multi-worker strategy; None on one machine."""
        return None

    def scope(self) -> "_Scope":
        """Makes this the current strategy, in a cross-replica context, for the duration of the block.

        The object it returns may be entered again, nested or after it exited, as TensorFlow's may.

        Example:
          >>> import distrib
          >>> strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
          >>> with strategy.scope():
          ...     distrib.get_strategy() is strategy
          True
        """
        return _Scope(self)

    def _enter_scope(self) -> context.frame:
        """The frame that `scope()` pushes: this strategy, keeping the replica context if it is already current."""
        return context.frame(self, self._scope_replica_context(context.current()))

    def _scope_replica_context(self, top: context.Frame) -> Any:
        """The replica context of the frame `scope()` pushes over `top`: top's if this strategy is current already,
        else None (cross-replica)."""
        if top.strategy is self:
            return top.replica_context
        if not context.is_default(top.strategy):
            raise ContextError(f"Mixing different distrib strategies is not allowed: {self!r} was entered inside "
                             f"{top.strategy!r}.")
        return None

    # -- running replicas -------------------------------------------------------------------------------

    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None,
            options: RunOptions | None = None) -> Any:
        """Calls `fn(*args, **kwargs)` once per replica, each in its own thread and replica context.

        A strategy with a single local replica (one device; one per process under mpirun) calls `fn` on the
        calling thread instead, unless `options` set a timeout: nothing would run beside it.

        `PerReplica` leaves of `args`/`kwargs` are unwrapped to the replica's component. Results are regrouped:
        values that differ per replica become `PerReplica`, the same object everywhere is returned as is.

        Raises:
          Whatever `fn` raised in a replica, as itself, with the replica id added to its message.
        """
        if options is None and type(args) is tuple and (kwargs is None or type(kwargs) is dict) and callable(fn):
            # a run that may need no more than `_run_at_once` (one local replica: one GPU; one process per device
            # under mpirun): tried before the checks below and `context.current`, which it makes in fewer calls
            result = self._extended._run_at_once(fn, args, kwargs)
            if result is not NOT_NOW:
                return result
        if not callable(fn):
            raise TypeError(f"run() needs a callable fn. Received: {type(fn).__name__}.")
        if options is not None and not isinstance(options, RunOptions):
            raise TypeError(f"options must be a distrib.RunOptions. Received: {type(options).__name__}.")
        if type(args) is not tuple and (isinstance(args, (str, bytes)) or not isinstance(args, (list, tuple))):
            raise TypeError(f"args must be a tuple or list. Received: {type(args).__name__}.")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs must be a dict. Received: {type(kwargs).__name__}.")
        top = context.current()
        # `context.is_default(s)` is `s is _DEFAULT_STRATEGY` once this module is imported: a call less each time
        if top.strategy is self and top.replica_context is not None and self is not _DEFAULT_STRATEGY:
            raise ContextError("Strategy.run cannot be called inside a replica function of the same strategy "
                               "(nested run). Call it from the cross-replica context.")
        # `with self._enter_scope()` in fewer calls: outside any scope the frame is cross-replica
        outside = top.strategy is not self and top.strategy is _DEFAULT_STRATEGY
        stack, depth = context.push(self, None if outside else self._scope_replica_context(top))
        try:
            return self._extended._call_for_each_replica(fn, tuple(args), dict(kwargs or {}), options)
        finally:
            del stack[depth:]  # with any frame a Ctrl-C left above it: else this strategy would stay current

    def close(self) -> None:
        """Ends the strategy's replica threads; `run` raises ContextError afterwards. Closing twice is fine.

        Dropping the last reference to a strategy closes it too. A strategy is also a context manager that
        closes it on exit (entering it does not make it current: that is `scope()`).

        Example:
          >>> import distrib
          >>> with distrib.MirroredStrategy(["CPU:0", "CPU:1"]) as strategy:
          ...     strategy.num_replicas_in_sync
          2
          >>> strategy
          <MirroredStrategy devices=('CPU:0', 'CPU:1') closed>
        """
        self._extended._close()

    def __enter__(self) -> "Strategy":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- bringing results back ------------------------------------------------------------------------

    def experimental_local_results(self, value: Any) -> tuple:
        """The per-replica components of `value`, as a tuple; a plain value gives a 1-tuple.

        Nested structures are split leaf by leaf, so a dict of PerReplica gives one dict per replica; a nested
        structure with no distributed leaves gives one copy per replica, as in TensorFlow.
        """
        leaves, spec = flatten(value)
        components = [local_components(leaf) for leaf in leaves]
        counts = {len(c) for c in components if c is not None}
        if not counts and (spec.is_leaf() or value is None):  # None too, as TensorFlow's nest takes it for a leaf
            return (value,)
        if not counts:
            return (value,) * len(self._extended.worker_devices)
        if len(counts) > 1:
            raise ValueError(f"experimental_local_results needs distributed values of one length. Received lengths "
                             f"{sorted(counts)}.")
        (count,) = counts
        return tuple(unflatten(spec, [leaf if c is None else c[i] for leaf, c in zip(leaves, components)])
                     for i in range(count))

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | Sequence[int] | None = None) -> Any:
        """Reduces a per-replica value across replicas to one host NumPy array (a nested structure works too).

        With `axis`, each replica's value is also reduced along that axis first; MEAN then divides by the
        *global* number of elements along it, so a partial batch split 4/2 divides by 6. The leaves of a nested
        structure travel in one batched reduction (one buffer per dtype), summed in device order as one alone.

        Example:
          >>> import distrib, numpy as np
          >>> s = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
          >>> v = s.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group))
          >>> float(s.reduce("SUM", v, axis=None))
          1.0
        """
        self._extended._require_cross_replica("Strategy.reduce")
        op = ReduceOp.from_value(reduce_op)
        if op is ReduceOp.SUM and holds_none(value):  # TensorFlow fails to convert it to a tensor; MEAN passes it on
            raise ValueError(f"Strategy.reduce cannot sum None (did the replica function return nothing?). Received: "
                             f"{value!r}. Reduce arrays, or leave None out of the structure.")
        with self._enter_scope():  # `with self.scope()` without the re-enterable object it makes (a thread-local)
            leaves, spec = flatten(value)
            return unflatten(spec, self._extended._reduce_to_host(op, leaves, axis))

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates the per-replica components of `value` along `axis` into one host NumPy array.

        Shapes may differ along `axis` only. In a replica context use `ReplicaContext.all_gather` instead.
        """
        self._extended._require_cross_replica("Strategy.gather", hint="inside a replica function use "
                                              "distrib.get_replica_context().all_gather(value, axis)")
        backend = self._extended.backend

        def gather_leaf(leaf):
            arrays = [backend.to_host(c) for c in self.experimental_local_results(leaf)]
            check_gather_shapes("Strategy.gather", [a.shape for a in arrays], [a.dtype for a in arrays],
                                 axis, path=())
            return np.concatenate(arrays, axis=axis)

        return map_structure(gather_leaf, value)

    # -- input --------------------------------------------------------------------------------------------

    def experimental_distribute_dataset(self, dataset: Iterable, options: InputOptions | None = None
                                        ) -> DistributedDataset:
        """Splits each global batch of `dataset` along axis 0 across the replicas; iterate once per epoch.

        `dataset` is any iterable of global batches: arrays or nested structures of them (NumPy, or any array
        with `__dlpack__` or `__array__`). A batch of B rows gives each replica ceil(B / N) consecutive rows, the
        last replicas fewer or none (empty batches keep the trailing shape), so a partial last batch, or one
        smaller than the number of replicas, is fine. Each step yields the batch's structure with PerReplica
        leaves placed on the replicas' devices; the next steps are prepared in a background thread.

        Example:
          >>> import distrib, numpy as np
          >>> s = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
          >>> data = np.arange(6, dtype=np.float32)
          >>> [s.experimental_local_results(b) for b in s.experimental_distribute_dataset([data[:4], data[4:]])]
          [(array([0., 1.], dtype=float32), array([2., 3.], dtype=float32)), (array([4.], dtype=float32), array([5.], dtype=float32))]
        """
        self._extended._require_cross_replica("experimental_distribute_dataset")
        return DistributedDataset(dataset, self._extended._input_workers(), options)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Iterable],
                                          options: InputOptions | None = None) -> DistributedDatasetsFromFunction:
        """Builds the input pipeline(s) with `dataset_fn(InputContext)`; each replica takes one element per step.

        `dataset_fn` batches per replica (`ctx.get_per_replica_batch_size(global_batch_size)`) and shards by
        `ctx.input_pipeline_id` of `ctx.num_input_pipelines`. With `InputOptions(experimental_replication_mode=
        InputReplicationMode.PER_REPLICA)` it is called once per replica instead of once per worker.
        """
        self._extended._require_cross_replica("distribute_datasets_from_function")
        return DistributedDatasetsFromFunction(dataset_fn, self._extended._input_workers(), options)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Builds a `PerReplica` from `value_fn(ValueContext(i, n))`, called once per replica.

        `value_fn` runs with replica i's device current, so arrays it creates land there; values it returns
        are not moved (a GPU array on the wrong device is copied when a collective uses it).
        """
        if not callable(value_fn):
            raise TypeError(f"value_fn must be callable. Received: {type(value_fn).__name__}.")
        self._extended._require_cross_replica("experimental_distribute_values_from_function")
        extended = self._extended
        count = self.num_replicas_in_sync
        results = []
        for replica_id, device in enumerate(extended.worker_devices, start=extended._first_local_replica):
            with extended.backend.device_scope(device):
                results.append(value_fn(ValueContext(replica_id, count)))
        return regroup(results, PerReplica, always_wrap=True)

    # -- the collective timeline ------------------------------------------------------------------------

    def start_timeline(self, file_path: str) -> None:
        """Records every run, merge_call, collective, pack and unpack of this process to `file_path`.

        The file is a Chrome trace (JSON) that Perfetto opens, written by `stop_timeline()`; see
        `distrib.timeline`. `DISTRIB_TIMELINE=trace.json` records a whole program instead. Under `mpirun -np N`
        (N > 1) each rank writes its own file, `trace.rank1.json` for rank 1.

        Raises:
          RuntimeError: a timeline is already recording.
          OSError: `file_path` cannot be written.
        """
        timeline.start(file_path)

    def stop_timeline(self) -> str | None:
        """Stops the timeline and writes it; returns the file's path (None if none was recording)."""
        return timeline.stop()

    def __repr__(self) -> str:
        closed = " closed" if getattr(self._extended, "_closed", False) else ""
        return f"<{type(self).__name__} devices={self._extended.worker_devices}{closed}>"


class _Scope:
    """What `strategy.scope()` returns: a context manager that may be entered again, nested or later."""

    def __init__(self, strategy: Strategy):
        self._strategy = strategy
        self._entered = threading.local()  # each thread's stack of entries of this object

    def __enter__(self) -> Strategy:
        top = context.current()
        if top.strategy is self._strategy and top.replica_context is not None:
            # TensorFlow's scope requires the cross-replica context too: a replica function runs in the strategy
            # (the default strategy's scope is not this object, so its always-present replica context is not met)
            raise ContextError(f"strategy.scope() cannot be entered inside a replica function of the same strategy "
                               f"(a replica context): the function runs in {self._strategy!r} already. Create "
                               f"variables before strategy.run, or from the cross-replica context of a merge_call.")
        entry = self._strategy._enter_scope()
        entry.__enter__()
        self._entered.__dict__.setdefault("stack", []).append(entry)
        return self._strategy

    def __exit__(self, *exc_info) -> bool | None:
        return self._entered.stack.pop().__exit__(*exc_info)

    def __repr__(self) -> str:
        return f"<scope of {self._strategy!r}>"


class _DefaultExtended(StrategyExtended):
    """The default strategy: one replica, the calling thread, no communication."""

    def __init__(self, container_strategy: Strategy):
        self._container_strategy = container_strategy
        self._devices = ("CPU:0",)
        self._cross_device_ops = NcclAllReduce(num_packs=1)
        self._options = CommunicationOptions()
        self._colocation = threading.local()
        self._backend_instance: Backend | None = None
        self._host_arrays = True  # its backend is the CPU emulator
        self._placed = all_ndarrays

    @property
    def _backend(self) -> Backend:  # created on first use so that importing distrib probes no GPU
        if self._backend_instance is None:
            self._backend_instance = get_backend("cpu")
        return self._backend_instance

    def _call_for_each_replica(self, fn, args, kwargs, options=None):
        return fn(*select_replica(0, args), **select_replica(0, kwargs))

    def variable_created_in_scope(self, v):
        """Whether `v` is a variable of no strategy (created outside every strategy's scope), as TensorFlow's."""
        return isinstance(v, Variable) and not isinstance(v, DistributedVariable)

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable):
        """Nothing to colocate on one device: any variable is accepted, as TensorFlow's default strategy does."""
        if not isinstance(colocate_with_variable, (Variable, DistributedVariable)):
            raise ValueError(f"colocate_vars_with needs a variable. Received: {colocate_with_variable!r}.")
        yield

    def _rendezvous(self, replica_id, kind, merge, payload, options):
        if kind == "all_reduce":  # one replica: nothing to reduce, the value comes back as it went in
            if payload[3] is not None:  # values all_reduce refuses (strings): its error, as `merge` raises it
                raise payload[3]
            return payload[1]
        with context.frame(self._container_strategy, None):
            return merge([payload])[0]


class _DefaultStrategy(Strategy):
    """The strategy in effect outside any scope: one replica, no distribution."""

    def __init__(self):
        super().__init__(_DefaultExtended(self))

    def scope(self):
        return contextlib.nullcontext(self)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """`value_fn(ValueContext())` as it is: no distribution, as TensorFlow's default strategy does."""
        if not callable(value_fn):
            raise TypeError(f"value_fn must be callable. Received: {type(value_fn).__name__}.")
        self._extended._require_cross_replica("experimental_distribute_values_from_function")
        return value_fn(ValueContext())

    def experimental_distribute_dataset(self, dataset: Iterable, options: InputOptions | None = None
                                        ) -> DistributedDataset:
        """`dataset`'s batches whole, on the one replica; `options` are ignored, as TensorFlow's default strategy
        ignores them (its PER_REPLICA mode included)."""
        return super().experimental_distribute_dataset(dataset)

    def __repr__(self) -> str:
        return "<DefaultStrategy>"


_DEFAULT_STRATEGY = _DefaultStrategy()
_DEFAULT_REPLICA_CONTEXT = ReplicaContext(_DEFAULT_STRATEGY, 0)
context.set_default_frame(context.Frame(_DEFAULT_STRATEGY, _DEFAULT_REPLICA_CONTEXT))
