"""Cross-device ops: NcclAllReduce, HierarchicalCopyAllReduce and ReductionToOneDevice, executed on any backend.

They work on plain arrays, one per device (`components[r]` lives on `devices[r]`); the strategy layer handles
distributed values. Packing follows `plan.py`; `CommunicationOptions.bytes_per_pack`, when set,
bounds every pack of every op (TensorFlow ignores it for NCCL, which led to out-of-memory packs).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import numpy as np

from distrib.backends.base import Backend
from distrib.backends.packed import member_views
from distrib.batched_gather import batch_all_gather
from distrib import plan as planner
from distrib import timeline
from distrib.devices import HOST, canonical_name
from distrib.options import CommunicationImplementation, CommunicationOptions, ReduceOp


_SPEC = operator.attrgetter("shape", "dtype")  # a value's (shape, dtype), for plan look-ups


class CrossDeviceOps:
    """Base class: reductions, broadcasts and gathers of per-device arrays."""

    def batch_all_reduce(self, backend: Backend, op: ReduceOp, per_replica: Sequence[Sequence[Any]],
                         devices: Sequence[str], options: CommunicationOptions) -> list[list[Any]]:
        """`per_replica[r][v]` is value v on replica r; returns the reduced values in the same layout."""
        raise NotImplementedError

    def reduce_to(self, backend: Backend, op: ReduceOp, components: Sequence[Any], devices: Sequence[str],
                  destinations: Sequence[str], timeout: float | None = None) -> list[Any]:
        """Reduces one array per device onto `destinations` (device names, or ('host',) for NumPy); a collective
        across processes waits for the others up to `timeout` seconds (None: the default timeout)."""
        total = _reduce_on(backend, op, components, devices[0] if destinations[0] == HOST else destinations[0])
        if tuple(destinations) == (HOST,):
            return [backend.to_host(total)]
        return [total] + [backend.copy(total, d) for d in destinations[1:]]

    def batch_reduce_to_host(self, backend: Backend, op: ReduceOp, per_replica: Sequence[Sequence[Any]],
                             devices: Sequence[str], timeout: float | None = None) -> list[np.ndarray]:
        """`reduce_to(..., ('host',), timeout)` of every value `per_replica[r][v]` at once, as host NumPy arrays.

        Each dtype's values are packed into one buffer per device and the buffers summed on the first device in
        device order, as `reduce_to` sums one value: element for element the same additions, so the same bits.
        """
        if len(per_replica[0]) == 1:  # one value (a step's loss): its sum alone, the same additions unpacked
            return [backend.to_host(_reduce_on(backend, op, [values[0] for values in per_replica], devices[0]))]
        packing = planner.one_buffer_per_dtype(tuple((value.shape, value.dtype) for value in per_replica[0]))
        results: list[Any] = [None] * len(per_replica[0])
        for buffer in packing.buffers:
            flats = [backend.pack([values[m.index] for m in buffer.members], buffer, device)
                     for values, device in zip(per_replica, devices)]
            total = backend.to_host(_reduce_on(backend, op, flats, devices[0]))
            views = member_views(total, buffer)
            for member, view in zip(buffer.members, views):  # copies: a kept result keeps only itself alive
                results[member.index] = view if len(views) == 1 else view.copy()
        return results

    def broadcast(self, backend: Backend, array: Any, destinations: Sequence[str],
                  timeout: float | None = None) -> list[Any]:
        return backend.broadcast(array, list(destinations), timeout=timeout)

    def all_gather(self, backend: Backend, components: Sequence[Any], devices: Sequence[str],
                   axis: int) -> list[Any]:
        """Concatenation of the components along `axis` on every device; lengths along `axis` may differ."""
        return [values[0] for values in self.batch_all_gather(backend, [[c] for c in components], devices, axis)]

    def batch_all_gather(self, backend: Backend, per_replica: Sequence[Sequence[Any]], devices: Sequence[str],
                         axis: int, options: CommunicationOptions | None = None) -> list[list[Any]]:
        """`per_replica[r][v]` is value v on replica r; each value concatenated along `axis` over the replicas, on
        every device, in the same layout. One backend all_gather per dtype (see distrib/batched_gather.py)."""
        if not per_replica[0]:
            return [[] for _ in devices]
        timeout = None if options is None else options.timeout
        return batch_all_gather(backend, per_replica, devices, axis,
                                lambda layouts: self._gathered_layouts(backend, layouts, devices, timeout), timeout)

    def _gathered_layouts(self, backend: Backend, layouts: list[list[tuple]], devices: Sequence[str],
                          timeout: float | None) -> list[list[tuple]]:
        """`layouts[r][v]` (value v's length along the gather axis, shape and dtype on local replica r, as ints) of
        every replica taking part (here: the local ones)."""
        return layouts


def _reduce_on(backend: Backend, op: ReduceOp, components: Sequence[Any], target: str,
               accumulation_fn: Callable | None = None) -> Any:
    """The SUM or MEAN of same-shaped per-device arrays, computed on `target` (integer MEAN: a float result, but
    for one array, whose MEAN is itself: TensorFlow's shortcut for one replica)."""
    if op is ReduceOp.MEAN and len(components) == 1:
        op = ReduceOp.SUM
    if accumulation_fn is not None:  # the sum in add_n's place, on the timeline as add_n's is
        with timeline.span("add_n", "collective", (target,), {"bytes": int(getattr(components[0], "nbytes", 0))}):
            total = accumulation_fn([backend.copy(c, target) for c in components])
    else:
        total = backend.add_n(list(components), target)
    if op is ReduceOp.MEAN:
        with backend.device_scope(target):
            if not planner.is_inexact(total.dtype):  # float32 or float64, as TensorFlow's true division
                total = planner.integer_mean(backend.xp.asarray(total), len(components))
            elif accumulation_fn is None:
                total /= len(components)  # add_n's fresh buffer: divide in place
            else:
                total = backend.xp.asarray(total / len(components))  # NumPy makes 0-d / int a scalar
    return total


class ReductionToOneDevice(CrossDeviceOps):
    """Sums every value on one device, then copies the result to each destination.

    Args:
      reduce_to_device: where the sum is computed; default: the first destination.
      accumulation_fn: sums a list of same-device arrays; default: the backend's in-order add_n.

    Example:
      >>> import distrib
      >>> s = distrib.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=distrib.ReductionToOneDevice())
    """

    def __init__(self, reduce_to_device: str | None = None, accumulation_fn: Callable | None = None):
        if reduce_to_device is not None:
            try:
                reduce_to_device = canonical_name(reduce_to_device)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"ReductionToOneDevice's reduce_to_device must name a device such as 'GPU:0' or "
                                f"'CPU:0'. Received: {reduce_to_device!r}.") from None
        if accumulation_fn is not None and not callable(accumulation_fn):
            raise TypeError(f"ReductionToOneDevice's accumulation_fn must be callable. Received: "
                            f"{type(accumulation_fn).__name__}.")
        self.reduce_to_device = reduce_to_device
        self.accumulation_fn = accumulation_fn

    def batch_all_reduce(self, backend, op, per_replica, devices, options):
        if op is ReduceOp.MEAN and len(devices) == 1:  # one replica in all: its value, as `_PackedAllReduce`'s
            op = ReduceOp.SUM
        out = []
        for components in zip(*per_replica):
            total = _reduce_on(backend, op, components, self.reduce_to_device or devices[0], self.accumulation_fn)
            out.append(backend.broadcast(total, list(devices), timeout=options.timeout))
        return [list(values) for values in zip(*out)] if out else [[] for _ in devices]

    def reduce_to(self, backend, op, components, devices, destinations, timeout=None):
        # summed on reduce_to_device (else the first destination, or the first replica's device for the host) with
        # accumulation_fn, whatever the destinations, as TensorFlow's reduce_implementation
        target = self.reduce_to_device or (devices[0] if destinations[0] == HOST else destinations[0])
        total = _reduce_on(backend, op, components, target, self.accumulation_fn)
        if tuple(destinations) == (HOST,):
            return [backend.to_host(total)]
        return [total if d == target else backend.copy(total, d) for d in destinations]

    def batch_reduce_to_host(self, backend, op, per_replica, devices, timeout=None):
        return [self.reduce_to(backend, op, [values[v] for values in per_replica], devices, (HOST,), timeout)[0]
                for v in range(len(per_replica[0]))]

    def __repr__(self) -> str:
        return f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device!r})"


class _PackedAllReduce(CrossDeviceOps):
    """Shared by the all-reduce ops: plan the packs and how they move, and hand the whole plan to the backend."""

    def __init__(self, num_packs: int = 1):
        if isinstance(num_packs, bool) or not isinstance(num_packs, int):
            raise TypeError(f"num_packs must be an int. Received: {num_packs!r}.")
        if num_packs < 0:
            raise ValueError(f"num_packs must be non-negative. Received: {num_packs}.")
        self.num_packs = num_packs
        self._plans: dict[tuple, planner.AllReducePlan] = {}  # a training step asks for the same plan every time
        # (options, op, dtype, shape, device count, plan) of the last one-value batch, matched without hashing
        self._last_one: tuple = (None,) * 6

    _MAX_CACHED_PLANS = 256

    def plan(self, specs: Sequence[tuple], options: CommunicationOptions) -> planner.Plan:
        """The packing plan: by bytes when `options.bytes_per_pack` is set, else concat-and-split by num_packs."""
        if options.bytes_per_pack > 0:
            return planner.plan_by_size(specs, options.bytes_per_pack)
        return planner.plan_concat_split(specs, self.num_packs)

    def _method(self, implementation: CommunicationImplementation) -> str:
        """How this op moves each chunk, given the requested implementation."""
        raise NotImplementedError

    def all_reduce_plan(self, specs: Sequence[tuple], op: ReduceOp, num_devices: int,
                        options: CommunicationOptions) -> planner.AllReducePlan:
        """The whole plan a backend executes for values of these (shape, dtype) specs; cached per request."""
        key = (tuple(specs), op, num_devices, options.bytes_per_pack, options.implementation)
        plan = self._plans.get(key)
        if plan is None:
            plan = planner.all_reduce_plan(self.plan(specs, options), self._method(options.implementation),
                                           op is ReduceOp.MEAN, num_devices)
            if len(self._plans) >= self._MAX_CACHED_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    _one_process = True  # devices are every replica: one device means one replica in all

    def batch_all_reduce(self, backend, op, per_replica, devices, options):
        if op is ReduceOp.MEAN and len(devices) == 1 and self._one_process:
            op = ReduceOp.SUM  # the MEAN of one replica's value is the value, integers staying integers (TensorFlow's
            # shortcut for one value per PerReplica; a float divided by 1 is unchanged anyway)
        values = per_replica[0]
        if len(values) == 1:  # one value, as the last time (a step's usual all-reduce): the same plan, found by
            # identities and a shape comparison rather than by building and hashing a key (a dtype's hash walks its
            # fields each time); the options are frozen, so the same object means the same packing
            value, last = values[0], self._last_one
            if last[0] is options and last[1] is op and last[2] is value.dtype and last[3] == value.shape and \
                    last[4] == len(devices):
                return backend.execute(last[5], per_replica, list(devices), timeout=options.timeout_seconds or None)
        specs = tuple(map(_SPEC, values))
        plan = self._plans.get((specs, op, len(devices), options.bytes_per_pack, options.implementation))  # as
        if plan is None:  # all_reduce_plan looks it up, without its call: every step asks for the same plan
            plan = self.all_reduce_plan(specs, op, len(devices), options)
        if len(specs) == 1:
            self._last_one = (options, op, specs[0][1], specs[0][0], len(devices), plan)
        return backend.execute(plan, per_replica, list(devices), timeout=options.timeout_seconds or None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_packs={self.num_packs})"


_METHODS = {CommunicationImplementation.AUTO: planner.NATIVE, CommunicationImplementation.RING: planner.RING,
            CommunicationImplementation.NCCL: planner.NCCL}


class NcclAllReduce(_PackedAllReduce):
    """All-reduce through the backend's collective: NCCL on GPUs, in-order sums on the CPU emulator.

    `CommunicationOptions.implementation` picks how each pack moves: AUTO the backend's all-reduce; RING a
    reduce-scatter then an all-gather; NCCL requires NCCL, so on the CPU emulator the first collective raises
    `BackendUnavailableError` (TensorFlow also fails at collective time on a machine without GPUs).

    Args:
      num_packs: with `bytes_per_pack` unset, each dtype's values are concatenated and cut into this many
        calls (0: one call per value).

    Example:
      >>> import distrib
      >>> s = distrib.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=distrib.NcclAllReduce(num_packs=2))
    """

    def _method(self, implementation):
        return _METHODS[implementation]


class HierarchicalCopyAllReduce(_PackedAllReduce):
    """TensorFlow's DGX-1 scheme: each half of the devices sums on one member, the halves swap, then copy out.

    For pack i the sum is built on device `m0 = i % n` (its half) and on `m1` in the other half, so packs
    spread the work over devices. Works for any device count; with one device it is a copy. It always copies,
    whatever `CommunicationOptions.implementation` asks, as in TensorFlow.

    Args:
      num_packs: with `bytes_per_pack` unset, each dtype's values are concatenated and cut into this many packs.

    Example:
      >>> import distrib
      >>> s = distrib.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=distrib.HierarchicalCopyAllReduce())
    """

    def _method(self, implementation):
        return planner.HIERARCHICAL


class CollectiveAllReduce(NcclAllReduce):
    """MultiWorkerMirroredStrategy's cross-device ops: every reduction is an all-reduce over every replica of
    every process (other processes' values are not here to be summed on one device), as in TensorFlow.

    Args:
      num_packs: as for `NcclAllReduce`.
    """

    _one_process = False  # other processes' replicas take part too

    def reduce_to(self, backend, op, components, devices, destinations, timeout=None):
        plan = self.all_reduce_plan([(components[0].shape, components[0].dtype)], op, len(devices), _DEFAULTS)
        total = backend.execute(plan, [[c] for c in components], list(devices), timeout=timeout)[0][0]
        if tuple(destinations) == (HOST,):
            return [backend.to_host(total)]
        # the sum is a new array on the first device already: a destination there takes it without a copy
        return [total if k == 0 and d == devices[0] else backend.copy(total, d) for k, d in enumerate(destinations)]

    def batch_reduce_to_host(self, backend, op, per_replica, devices, timeout=None):
        plan = self.all_reduce_plan([(value.shape, value.dtype) for value in per_replica[0]], op, len(devices),
                                    _DEFAULTS)
        return [backend.to_host(total) for total in backend.execute(plan, per_replica, list(devices),
                                                                    timeout=timeout)[0]]

    def _gathered_layouts(self, backend, layouts, devices, timeout):
        # every process's, in one host exchange: no device copies, and on GPUs no wait for them
        rows = backend.gather_rows(np.array(layouts, np.int64).reshape(len(layouts), -1), timeout=timeout)
        return [[tuple(layout) for layout in replica]
                for replica in rows.reshape(-1, len(layouts[0]), len(layouts[0][0])).tolist()]


_DEFAULTS = CommunicationOptions()  # the packing of reductions made outside a run: one buffer per dtype


def default_cross_device_ops(backend: Backend) -> CrossDeviceOps:
    """NcclAllReduce(num_packs=1) on every backend: one packed all-reduce per dtype."""
    return NcclAllReduce(num_packs=1)
