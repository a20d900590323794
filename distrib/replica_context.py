"""ReplicaContext: what a replica function may call (all_reduce, all_gather, merge_call), and their layout checks."""

from __future__ import annotations

import enum
import functools
import numbers
import operator
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from distrib import context, timeline
from distrib.errors import CollectiveMismatchError, ContextError
from distrib.options import CommunicationOptions, ReduceOp
from distrib.plan import is_inexact
from distrib.replica_threads import name_replica
from distrib.values import (LEAF_SPEC, LEAF_TYPES, DistributedValues, flatten, format_path, regroup, select_replicas,
                            structure_mismatch, unflatten)
from distrib.variables import IndexedSlices

_ARRAYS = operator.itemgetter(1)  # a collective's payload: (spec, arrays, arguments, the error it raised or None)

# Array kinds that cannot be summed: bool (NumPy's + is logical or), dates, objects, bytes, strings, void.
NOT_REDUCIBLE = "bMOSUV"


def reducible(dtype) -> bool:
    """Whether values of `dtype` can be summed: numbers, and ml_dtypes' bfloat16 (a NumPy kind 'V' dtype)."""
    return dtype.kind not in NOT_REDUCIBLE or dtype.name == "bfloat16"


class ReplicaHost(Protocol):
    """What a ReplicaContext asks of its strategy's extended object: the whole interface, nothing else.

    `options` arguments are already merged over the strategy's defaults (`merged_options`), once per collective.
    """

    @property
    def worker_devices(self) -> tuple[str, ...]: ...

    # the replica context of a run on the calling thread (one local replica), whose merges run at once
    # (`_merge_inline(kind, merge, *args)`: `merge(*args)` cross-replica); None otherwise
    _inline: Any

    def _merged_options(self, options: CommunicationOptions | None) -> CommunicationOptions:
        """The strategy's CommunicationOptions with `options` merged over them (TensorFlow's rule)."""

    def _to_replica_device(self, values: Sequence[Any], replica_id: int) -> list[Any]:
        """`values` as arrays on replica `replica_id`'s device."""

    def _rendezvous(self, replica_id: int, kind: str, merge: Callable[[list], list], payload: Any,
                    options: CommunicationOptions) -> Any:
        """Blocks replica `replica_id` until every replica arrives, then returns its share of `merge(payloads)`.

        `merge` runs once, on the thread that called `run`, in the cross-replica context; it receives one
        payload per replica in replica order and returns one result per replica. `options.timeout` bounds the wait.
        """

    def _refuse_collective(self) -> None:
        """Tells the other processes, if any, that this one will not make the collective whose values it has just
        refused (they raise there instead of waiting)."""

    def _batch_all_reduce(self, op: ReduceOp, per_replica: Sequence[Sequence[Any]],
                          options: CommunicationOptions) -> list[list[Any]]:
        """All-reduce of `per_replica[r][v]` (arrays already on replica r's device); the same layout back."""

    def _batch_all_gather(self, per_replica: Sequence[Sequence[Any]], axis: int,
                          options: CommunicationOptions) -> list[list[Any]]:
        """Concatenation along `axis` of each value over the replicas, on every replica; the same layout back."""


class ReplicaContext:
    """The APIs available inside a replica function: all_reduce, all_gather, merge_call and the replica's id.

    Get it with `distrib.get_replica_context()` inside the function passed to `Strategy.run`.

    Example:
      >>> import distrib, numpy as np
      >>> s = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
      >>> def step():
      ...     ctx = distrib.get_replica_context()
      ...     return ctx.all_reduce("SUM", np.float32(ctx.replica_id_in_sync_group + 1))
      >>> [float(x) for x in s.experimental_local_results(s.run(step))]
      [3.0, 3.0]
    """

    def __init__(self, strategy: Any, replica_id_in_sync_group: int, first_local_replica: int = 0):
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group - first_local_replica  # index among this process's replicas
        self._first_local_replica = first_local_replica  # nonzero in a multi-worker job: other processes' first

    @property
    def _host(self) -> ReplicaHost:
        return self._strategy._extended  # the attribute, not the property: one call less on every collective

    @property
    def strategy(self) -> Any:
        """The strategy this replica belongs to."""
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's id, from 0 to num_replicas_in_sync - 1 (counting every process's replicas)."""
        return self._first_local_replica + self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas are kept in sync."""
        return self._strategy.num_replicas_in_sync

    @property
    def devices(self) -> tuple[str, ...]:
        """The device this replica runs on, as a 1-tuple."""
        return (self._host.worker_devices[self._replica_id],)

    def _require_current(self, api: str) -> None:
        if context.get_replica_context() is not self:
            raise ContextError(f"ReplicaContext.{api} must be called inside the function passed to Strategy.run, "
                               f"on the replica it belongs to (replica {self._replica_id}).")

    def merge_call(self, merge_fn: Callable, args: Sequence = (), kwargs: dict | None = None) -> Any:
        """Runs `merge_fn(strategy, *args, **kwargs)` once, cross-replica, with per-replica args as PerReplica.

        Every replica must call merge_call (and every collective, which is one) the same number of times.
        Returns this replica's component of the result.
        """
        self._require_current("merge_call")
        if not callable(merge_fn):
            raise TypeError(f"merge_fn must be callable. Received: {type(merge_fn).__name__}.")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"merge_call's args must be a tuple or list. Received: {type(args).__name__}.")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"merge_call's kwargs must be a dict or None. Received: {type(kwargs).__name__}.")
        strategy = self._strategy

        def merge(payloads: list) -> list:
            merged_args = regroup([p[0] for p in payloads], rule="Every replica must pass merge_call the same "
                                  "structure of args")
            merged_kwargs = regroup([p[1] for p in payloads], rule="Every replica must pass merge_call the same "
                                    "structure of kwargs")
            result = merge_fn(strategy, *merged_args, **merged_kwargs)
            return select_replicas(result, len(payloads))

        host = self._host
        return host._rendezvous(self._replica_id, "merge_call", merge, (tuple(args), dict(kwargs or {})),
                                host._merged_options(None))

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: CommunicationOptions | None = None) -> Any:
        """Reduces `value` (a nested structure of arrays) across replicas; every replica gets the result.

        All leaves travel in one batched reduction, packed by dtype and `options.bytes_per_pack`. MEAN of
        integers gives floats (1..4 averages to 2.5).

        Raises:
          CollectiveMismatchError (a ValueError): replicas passed different structures, shapes or dtypes.
        """
        if context.get_replica_context() is not self:
            self._require_current("all_reduce")
        op = ReduceOp.from_value(reduce_op)
        host = self._strategy._extended
        if host._inline is self and type(value) in LEAF_TYPES:  # one value in a run on the calling thread:
            # `_collective`'s steps for it, without its closures and rendezvous, nor calls that change nothing for a
            # NumPy array of numbers on emulated devices (each costs a microsecond or more after a large transfer)
            options = host._options if options is None else host._merged_options(options)
            if host._host_arrays and type(value) is np.ndarray and value.dtype.kind not in NOT_REDUCIBLE:
                arrays = [value]
            else:
                try:
                    arrays = host._to_replica_device([value], self._replica_id)
                    _check_numeric(arrays, LEAF_SPEC)
                except (ValueError, TypeError) as error:
                    host._refuse_collective()
                    raise _distributed_leaf_error("all_reduce", [value], LEAF_SPEC) or error
            if timeline.recording is None:  # the cross-device op straight away: nothing it calls asks for the
                try:  # cross-replica frame that `_merge_inline` pushes (5 µs of a 1 MB step, measured)
                    return host._cross_device_ops.batch_all_reduce(host._backend, op, [arrays], host._devices,
                                                                   options)[0][0]
                except BaseException as exc:
                    host._merge_error = exc  # a merge's error: the run leaves it unnamed, as `_merge_inline` does
                    raise
            return host._merge_inline("all_reduce", host._cross_device_ops.batch_all_reduce, host._backend, op,
                                      [arrays], host._devices, options)[0][0]  # `_batch_all_reduce`, a call less
        if type(value) is IndexedSlices:
            return self._all_reduce_sparse(op, value, options)
        return self._collective("all_reduce", value, options, _check_numeric,
                                functools.partial(self._strategy._extended._batch_all_reduce, op),
                                arguments=(("reduce_op", op),))

    def _all_reduce_sparse(self, op: ReduceOp, value: IndexedSlices, options: CommunicationOptions | None) -> Any:
        """TensorFlow's reduction of IndexedSlices: every replica's rows concatenated in replica order (a row that
        several replicas hold then appears once for each, and adds up when applied), MEAN dividing the values by the
        number of replicas; the first replica's dense_shape."""
        values = self.all_gather(value.values, 0, options)
        indices = self.all_gather(value.indices, 0, options)
        if op is ReduceOp.MEAN:
            # a float divisor keeps a float dtype (bfloat16 too, NumPy kind 'V'); integers divide into floats
            values = values / np.asarray(self.num_replicas_in_sync, values.dtype if is_inexact(values.dtype) else None)
        return IndexedSlices(values, indices, value.dense_shape)

    def all_gather(self, value: Any, axis: int, options: CommunicationOptions | None = None) -> Any:
        """Concatenates `value` (a nested structure of arrays) from every replica along `axis`; shapes may differ
        along `axis` only.

        All leaves travel in one all_gather per dtype, their lengths along `axis` in one exchange before it.

        Raises:
          CollectiveMismatchError (a ValueError): replicas passed different structures, dtypes, or shapes that
            differ off `axis`.
        """
        self._require_current("all_gather")
        if type(value) is IndexedSlices:  # as TensorFlow, which gathers no sparse values
            raise NotImplementedError("all_gather of an IndexedSlices is not supported, as in TensorFlow. Received: "
                                      "IndexedSlices; gather its values and indices, or all_reduce it (which "
                                      "concatenates them).")
        host = self._strategy._extended
        if host._inline is self and type(value) is np.ndarray and host._host_arrays and timeline.recording is None:
            # one NumPy array in a run on the calling thread: `_collective`'s steps for it, as all_reduce takes
            # them (the check of its rank and axis that the merge makes; no closures, rendezvous or frame)
            options = host._options if options is None else host._merged_options(options)
            try:
                try:
                    check_gather_shapes("all_gather", [value.shape], [value.dtype], axis, ())
                    _check_gatherable(value, ())
                except (ValueError, TypeError):
                    host._refuse_collective()
                    raise
                return host._batch_all_gather([[value]], axis, options)[0][0]
            except BaseException as exc:
                host._merge_error = exc  # a merge's error: the run leaves it unnamed, as `_merge_inline` does
                raise
        return self._collective("all_gather", value, options, functools.partial(_check_gather_axis, axis),
                                lambda per_replica, merged: self._host._batch_all_gather(per_replica, axis, merged),
                                gather_axis=axis, arguments=(("axis", axis),))

    def _collective(self, kind: str, value: Any, options: CommunicationOptions | None,
                    check_leaves: Callable[[list, Any], None] | None, combine: Callable[[list, Any], list],
                    gather_axis: int | None = None, arguments: tuple = ()) -> Any:
        """The path of every collective: options merged once, the leaves placed on this replica's device, one
        rendezvous whose merge checks that every replica passed the same arguments and layout, then combines.

        Every replica takes part even with nothing to send, so that one replica's empty value is an error
        naming it rather than a rendezvous the others wait at alone.
        """
        host = self._strategy._extended  # not `_host`: a call less
        options = host._merged_options(options)
        leaves, spec = flatten(value)
        refused = None
        # a refusal is raised by the merge, once for every replica: where this replica raised alone, the others of
        # its process went on to the collective, and its peer processes made it with theirs (wrong sums, or a wait)
        if spec is not LEAF_SPEC and _holds_sparse(spec):
            arrays, refused = [], _sparse_in_structure(kind, spec)
        else:
            try:
                arrays = host._to_replica_device(leaves, self._replica_id) if leaves else []
                if check_leaves is not None and arrays:
                    check_leaves(arrays, spec)
            except (ValueError, TypeError) as error:
                arrays, refused = [], _distributed_leaf_error(kind, leaves, spec) or error

        def merge(payloads: list) -> list:
            for replica, payload in enumerate(payloads):
                if payload[3] is not None:  # a multi-worker merge refuses the collective, the peers raise there too
                    name_replica(payload[3], replica, len(payloads))
                    raise payload[3]
            if len(payloads) > 1 or gather_axis is not None:  # one replica has nothing to compare with
                check_same_arguments(kind, [p[2] for p in payloads], self._first_local_replica)
                check_same_layout(kind, [p[:2] for p in payloads], gather_axis, self._first_local_replica)
            if not payloads[0][1]:
                return [[] for _ in payloads]
            return combine(list(map(_ARRAYS, payloads)), options)

        payload = (spec, arrays, arguments + (("options", options),), refused)
        return unflatten(spec, host._rendezvous(self._replica_id, kind, merge, payload, options))

    def __repr__(self) -> str:
        return (f"<ReplicaContext replica_id_in_sync_group={self.replica_id_in_sync_group} "
                f"num_replicas_in_sync={self.num_replicas_in_sync}>")


def _check_numeric(arrays: list, spec: Any) -> None:
    if len(arrays) == 1 and arrays[0].dtype.kind not in NOT_REDUCIBLE:  # one array of numbers: the usual value
        return
    if not all(reducible(dtype) for dtype in {a.dtype for a in arrays}):  # few distinct dtypes
        k = next(k for k, a in enumerate(arrays) if not reducible(a.dtype))
        raise TypeError(f"all_reduce needs numeric values. Received: dtype {arrays[k].dtype} at path "
                        f"{format_path(spec.paths()[k])}.")


_SPARSE_IN_SPEC: dict = {}  # spec -> whether an IndexedSlices is among its nodes (seen once per structure)


def _holds_sparse(spec: Any) -> bool:
    known = _SPARSE_IN_SPEC.get(spec)
    if known is None:
        if len(_SPARSE_IN_SPEC) >= 1024:
            _SPARSE_IN_SPEC.clear()
        known = _SPARSE_IN_SPEC[spec] = f"{IndexedSlices.__name__}(" in repr(spec)
    return known


def _sparse_in_structure(kind: str, spec: Any) -> Exception:
    """The refusal of an IndexedSlices inside a collective's structure: all_gather takes none (TensorFlow's
    NotImplementedError, as for one alone); all_reduce takes one only as the whole value."""
    if kind == "all_gather":
        return NotImplementedError(f"all_gather of an IndexedSlices is not supported, as in TensorFlow. Received: "
                                   f"one inside {spec}.")
    return TypeError(f"{kind} takes an IndexedSlices only as the whole value, not inside a structure (its values, "
                     f"indices and shape would be treated as three arrays). Received: {spec}.")


def _distributed_leaf_error(kind: str, leaves: list, spec: Any) -> TypeError | None:
    """The error for a PerReplica or Mirrored among a collective's values in a replica function (one the function
    captured rather than received through `run`'s args), where NumPy would see just an object; else None."""
    found = next(((path, leaf) for path, leaf in zip(spec.paths(), leaves) if isinstance(leaf, DistributedValues)),
                 None)
    if found is None:
        return None
    path, leaf = found
    return TypeError(f"{kind} takes this replica's own values, not a distributed value holding every replica's. "
                     f"Received: a {type(leaf).__name__} at path {format_path(path)}. "
                     f"Pass it to strategy.run in args (each replica then gets its component), or reduce it first "
                     f"in the cross-replica context.")


def check_gather_axis(api: str, axis: Any) -> None:
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"{api} concatenates along one axis: axis must be an int. Received: {axis!r}.")


def _check_gather_axis(axis: Any, arrays: list, spec: Any) -> None:
    check_gather_axis("all_gather", axis)  # before the merge: there, a gather axis of None means no gather
    for k, array in enumerate(arrays):
        _check_gatherable(array, spec.paths()[k])


def _check_gatherable(array: Any, path: tuple) -> None:
    if array.dtype.kind in "SU":  # the collectives move numbers (Strategy.gather, on the host, takes strings)
        raise TypeError(f"all_gather needs arrays of numbers. Received: dtype {array.dtype} at path "
                        f"{format_path(path)}; gather strings with Strategy.gather instead.")


def normalize_axes(axis, ndim: int) -> tuple[int, ...]:
    """`axis` (an int or a sequence of ints, negative from the end) as non-negative axes of a rank-`ndim` value."""
    axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    out = []
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, numbers.Integral):
            raise TypeError(f"axis must be an int, a tuple of ints or None. Received: {axis!r}.")
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for a value of rank {ndim}.")
        out.append(int(a) % ndim)
    if len(set(out)) < len(out):  # NumPy's own error would not say which argument
        raise ValueError(f"axis names an axis more than once. Received: {axis!r} for a value of rank {ndim}.")
    return tuple(out)


def check_gather_shapes(api: str, shapes: Sequence[tuple], dtypes: Sequence, axis: int, path: tuple,
                        first: int = 0) -> int:
    """Checks that shapes agree except along `axis` and dtypes agree; returns the normalized axis. `first`: the
    global id of the replica of `shapes[0]` (nonzero on other processes than the first of a multi-worker job)."""
    ndim = len(shapes[0])
    if ndim == 0:
        raise ValueError(f"{api} needs values of rank >= 1 to concatenate along axis {axis}. Received: a scalar "
                         f"at path {format_path(path)}.")
    check_gather_axis(api, axis)
    (axis,) = normalize_axes(axis, ndim)
    for replica_id, (shape, dtype) in enumerate(zip(shapes, dtypes), start=first):
        if dtype != dtypes[0]:
            raise CollectiveMismatchError(f"{api} needs the same dtype on every replica. Received: replica "
                                          f"{replica_id}, path {format_path(path)}, dtype {dtype} vs {dtypes[0]}.")
        if len(shape) != ndim or any(a != b for i, (a, b) in enumerate(zip(shape, shapes[0])) if i != axis):
            raise CollectiveMismatchError(f"{api} needs shapes that differ only along axis {axis}. Received: "
                                          f"replica {replica_id}, path {format_path(path)}, shape {shape} vs "
                                          f"{shapes[0]}.")
    return axis


def check_same_arguments(api: str, arguments: Sequence[tuple], first_id: int = 0) -> None:
    """Every replica's (name, value) arguments must equal the first's (global id `first_id`): else the first
    mismatch, named."""
    first = arguments[0]
    for replica_id, mine in enumerate(arguments[1:], start=first_id + 1):
        if mine != first:
            name, theirs, ours = next((a[0], b[1], a[1]) for a, b in zip(first, mine) if a != b)
            raise CollectiveMismatchError(f"{api} needs the same {name} on every replica. Received: replica "
                                          f"{replica_id}, {name} {_shown(theirs)} vs {_shown(ours)}.")


def _shown(value: Any) -> str:
    return value.name if isinstance(value, enum.Enum) else repr(value)


def check_same_layout(api: str, payloads: list, gather_axis: int | None = None, first: int = 0) -> None:
    """Every replica's (spec, arrays) must match the first's (global id `first`): structure, then each leaf's shape
    and dtype."""
    if len(payloads) == 1 and gather_axis is None:  # one replica: nothing to compare with
        return
    spec0, arrays0 = payloads[0]
    for replica_id, (spec, _) in enumerate(payloads[1:], start=first + 1):  # every structure first: leaves line
        if spec != spec0:  # up after
            raise CollectiveMismatchError(structure_mismatch(f"{api} needs the same structure on every replica",
                                                              replica_id, spec0.paths(), spec.paths(), spec0, spec,
                                                              first))
    shapes0, dtypes0 = [a.shape for a in arrays0], [a.dtype for a in arrays0]
    if gather_axis is not None:
        leaves: Any = range(len(arrays0))
        if all([a.shape for a in arrays] == shapes0 and [a.dtype for a in arrays] == dtypes0
               for _, arrays in payloads[1:]):  # the common case, in bulk: what is left is each rank's axis
            first_of_rank: dict[int, int] = {}
            for k, shape in enumerate(shapes0):
                first_of_rank.setdefault(len(shape), k)
            leaves = first_of_rank.values()  # in leaf order, so the first leaf that breaks the rule is named
        paths = spec0.paths()
        for k in leaves:
            check_gather_shapes(api, [p[1][k].shape for p in payloads], [p[1][k].dtype for p in payloads],
                                 gather_axis, paths[k], first)
        return
    for replica_id, (_, arrays) in enumerate(payloads[1:], start=first + 1):
        if [a.shape for a in arrays] == shapes0 and [a.dtype for a in arrays] == dtypes0:
            continue  # the common case, checked in bulk
        for k, path in enumerate(spec0.paths()):
            for what, mine, first in (("shape", arrays[k].shape, shapes0[k]), ("dtype", arrays[k].dtype, dtypes0[k])):
                if mine != first:
                    raise CollectiveMismatchError(f"{api} needs the same {what} on every replica. Received: replica "
                                                  f"{replica_id}, path {format_path(path)}, {what} {mine} vs {first}.")
