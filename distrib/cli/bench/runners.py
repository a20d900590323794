"""The series a benchmark row times: distrib's collectives through the strategy, and raw NumPy on the emulator.

A series prepares one row (a collective at one size) and hands back a `Prepared`: a step to time, a way to
wait for it, a way to reset its inputs, and the last result per rank on the host for the check. Inputs are
small integers, few enough that every partial sum is exact in the dtype, so `#wrong` counts every mismatch
against the host's answer (`expected`), as nccl-tests does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from distrib.cli.bench.table import Collective, Layout

OPS = {"sum": "SUM", "avg": "MEAN"}


@dataclass(frozen=True)
class RowSpec:
    """One row: the collective, its buffers, dtype, op ("sum" or "avg"), root, ranks, and batch array size.

    `ranks` counts every rank of the job; `first_local` and `local` name the ones this process drives (under
    mpirun a contiguous slice; alone, all of them).
    """

    collective: Collective
    layout: Layout
    dtype: np.dtype
    op: str
    root: int
    ranks: int
    array_elements: int = 0  # batch_reduce: elements per array
    first_local: int = 0
    local: int = 0  # 0: every rank is here

    @property
    def local_ranks(self) -> range:
        """The global ranks this process drives, in order."""
        return range(self.first_local, self.first_local + (self.local or self.ranks))

    def local_index(self, rank: int) -> int | None:
        """Where global rank `rank` sits among this process's ranks (None if another process drives it)."""
        return rank - self.first_local if rank in self.local_ranks else None

    @property
    def input_top(self) -> int:
        """The largest input: 7, or less where a sum of 7 per rank would overflow the dtype or need rounding
        (bfloat16 holds every integer to 256 only, so 32 ranks get 1..7 but 64 get 1..4)."""
        return max(1, min(7, exact_limit(self.dtype) // self.ranks))

    @property
    def tolerance(self) -> float:
        """The relative error `#wrong` forgives: none where the answer is exact, as in nccl-tests.

        Sums of these inputs are exact (see `input_top`) and gathers move bits. avg's division rounds, and where
        distrib divides (before or after the sum, in which precision) is its own: 2 units in the last place, as
        nccl-tests allows for avg. Past the ranks a type sums exactly (bfloat16 beyond 256), each add can round.
        """
        if not _is_float(self.dtype) or self.collective.name in ("all_gather", "broadcast"):
            return 0.0
        eps = float(_finfo(self.dtype).eps)
        if self.input_top * self.ranks > exact_limit(self.dtype):
            return self.ranks * eps
        return 2 * eps if self.op == "avg" else 0.0

    def host_input(self, rank: int) -> np.ndarray:
        """Rank `rank`'s send buffer: 1..input_top in a pattern that differs per rank, so a swapped rank is caught."""
        return ((np.arange(self.layout.send_count) + 3 * rank) % self.input_top + 1).astype(self.dtype)

    def expected(self) -> list[np.ndarray | None]:
        """The correct result per rank, computed on the host (None where a rank receives nothing)."""
        name, n = self.collective.name, self.ranks
        if name == "all_gather":
            return [np.concatenate([self.host_input(r) for r in range(n)])] * n
        if name == "broadcast":
            return [self.host_input(self.root)] * n
        # summed one rank at a time: a stack of every rank's input would hold n copies of the largest buffer
        wide = np.float64 if _is_float(self.dtype) else np.uint64 if self.dtype.kind == "u" else np.int64
        total = np.zeros(self.layout.send_count, wide)
        for r in range(n):
            total += self.host_input(r)
        if self.op == "avg":
            total /= n
        total = total.astype(self.dtype)  # integers wrap on overflow, as NCCL's do
        if name == "reduce_scatter":
            part = self.layout.recv_count
            return [total[r * part:(r + 1) * part] for r in range(n)]
        if name == "reduce":
            return [total if r == self.root else None for r in range(n)]
        return [total] * n

    def expected_here(self) -> list[np.ndarray | None]:
        """`expected()` for this process's ranks only."""
        expected = self.expected()
        return [expected[r] for r in self.local_ranks]


@dataclass
class Prepared:
    """One row of one series, ready to time."""

    step: Callable[[], Any]
    sync: Callable[[], None]
    reset: Callable[[], None]
    outputs: Callable[[Any], list[np.ndarray | None]]  # the step's result -> host arrays per rank


def count_wrong(outputs: Sequence[np.ndarray | None], expected: Sequence[np.ndarray | None],
                tolerance: float = 0.0) -> int:
    """Elements that differ from the host's answer, over every rank that receives a result.

    Args:
      tolerance: the relative error forgiven (RowSpec.tolerance); 0 compares exactly.
    """
    wrong = 0
    for got, want in zip(outputs, expected):
        if want is None:
            continue
        if got is None or got.shape != want.shape:
            wrong += want.size
            continue
        if tolerance:
            close = np.isclose(got.astype(np.float64), want.astype(np.float64), rtol=tolerance, atol=0)
            wrong += int(want.size - np.count_nonzero(close))
        else:
            wrong += int(np.count_nonzero(got != want))
    return wrong


def exact_limit(dtype: np.dtype) -> int:
    """The largest integer up to which `dtype` holds every integer (and sums of them stay exact)."""
    if not _is_float(dtype):
        return int(np.iinfo(dtype).max)
    return 2 ** (int(_finfo(dtype).nmant) + 1)


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype.name == "bfloat16"  # ml_dtypes' bfloat16 is of kind "V"


def _finfo(dtype: np.dtype):
    if dtype.name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.finfo(dtype)
    return np.finfo(dtype)


class DistribSeries:
    """distrib's own path for each collective, on whichever backend the strategy runs.

    all_reduce: `extended.reduce_to(op, value, destinations=value)`; reduce: `reduce_to` onto the root's device;
    broadcast: `extended.broadcast_to`; all_gather: the cross-replica all-gather a replica's `all_gather` runs
    once the replicas have met; reduce_scatter: the backend's reduce-scatter (distrib, like TensorFlow, has no
    user-level one); batch_reduce: `extended.batch_reduce_to` of one (value, value) pair per array. The values
    (PerReplica, pairs) are made before the clock starts.

    Args:
      name: the column group's title.
      strategy: a MirroredStrategy over the benchmarked devices.
      options: CommunicationOptions for batch_reduce_to (bytes_per_pack).
      one_call_per_array: batch_reduce only: one `reduce_to` per array instead of one `batch_reduce_to`.
    """

    in_place = False

    def __init__(self, name: str, strategy: Any, options: Any = None, one_call_per_array: bool = False):
        self.name, self.strategy, self.options = name, strategy, options
        self.one_call_per_array = one_call_per_array

    def __repr__(self) -> str:
        return f"<DistribSeries {self.name!r}>"

    def prepare(self, spec: RowSpec) -> Prepared:
        from distrib.values import PerReplica

        ext = self.strategy.extended
        backend, devices = ext.backend, list(ext.worker_devices)
        op = OPS[spec.op]
        host = [spec.host_input(r) for r in spec.local_ranks]
        root = spec.local_index(spec.root)  # None when another process drives the root
        arrays: list = []
        # what a step passes, made from `arrays` off the clock: a training step's values exist before it reduces
        # them, as the baselines' buffers do
        made: list = []
        name = spec.collective.name
        if name == "batch_reduce":  # one (value, value) pair per array; cutting 1,024 values took 2 ms
            cuts = list(range(0, spec.layout.send_count, spec.array_elements))
            make = lambda: [(v, v) for v in _split(arrays, cuts, spec)]  # noqa: E731
        elif name == "all_gather":
            make = lambda: [[a] for a in arrays]  # noqa: E731
        else:
            make = lambda: [PerReplica(arrays)]  # noqa: E731

        def reset():
            arrays[:] = [backend.to_device(h, d) for h, d in zip(host, devices)]
            made[:] = make()
            backend.synchronize()

        def hosts(values):
            return [backend.to_host(v) for v in values]

        reset()
        if name == "all_reduce":
            step = lambda: ext.reduce_to(op, made[0], made[0])  # noqa: E731
            outputs = lambda result: hosts(result.values)  # noqa: E731
        elif name == "reduce":
            step = lambda: ext.reduce_to(op, made[0], devices[root or 0])  # noqa: E731
            outputs = lambda result: [backend.to_host(result.values[0]) if i == root else None  # noqa: E731
                                      for i in range(len(devices))]
        elif name == "broadcast":  # across processes the root is on rank 0's process (see check_arguments)
            step = lambda: ext.broadcast_to(arrays[root or 0], made[0])  # noqa: E731
            outputs = lambda result: hosts(result.values)  # noqa: E731
        elif name == "all_gather":
            options = ext._merged_options(None)
            step = lambda: ext._batch_all_gather(made, 0, options)  # noqa: E731
            outputs = lambda result: [backend.to_host(r[0]) for r in result]  # noqa: E731
        elif name == "reduce_scatter":
            step = lambda: backend.reduce_scatter(arrays, devices)  # noqa: E731
            outputs = hosts
        else:  # batch_reduce
            if self.one_call_per_array:
                step = lambda: [ext.reduce_to(op, v, v) for v, _ in made]  # noqa: E731
            else:
                step = lambda: ext.batch_reduce_to(op, made, self.options)  # noqa: E731
            outputs = lambda result: [np.concatenate([backend.to_host(m.values[i]) for m in result])  # noqa: E731
                                      for i in range(len(devices))]
        return Prepared(step, backend.synchronize, reset, outputs)


def _split(arrays: Sequence[Any], cuts: Sequence[int], spec: RowSpec) -> list:
    from distrib.values import PerReplica

    return [PerReplica([a[c:c + spec.array_elements] for a in arrays]) for c in cuts]


class NumpySeries:
    """Raw NumPy on the host: the floor of the CPU emulator, which holds every emulated device in one memory.

    Out of place, each rank's result is one preallocated buffer every rank reads (as the emulator hands out
    read-only views of one buffer); in place, the result goes into the root's (or rank 0's, or each rank's own
    slice's) input buffer. An in-place all_gather or broadcast has nothing to move in shared memory: N/A.

    Args:
      in_place: time the in-place variant.
      per_array: batch_reduce only: one reduction per array instead of one over the packed buffer.
    """

    def __init__(self, in_place: bool = False, per_array: bool = False):
        self.in_place, self.per_array = in_place, per_array
        self.name = "raw NumPy" + (" in-place" if in_place else "") + (" per array" if per_array else "")

    def __repr__(self) -> str:
        return f"<NumpySeries {self.name!r}>"

    def prepare(self, spec: RowSpec) -> Prepared | None:
        name, n, count = spec.collective.name, spec.ranks, spec.layout.send_count
        if self.in_place and name in ("all_gather", "broadcast"):
            return None
        host = [spec.host_input(r) for r in range(n)]
        ins = [h.copy() for h in host]

        def reset():
            for target, source in zip(ins, host):
                np.copyto(target, source)

        def sum_into(out, parts):
            sum_in_order(out, parts)
            if spec.op == "avg":
                np.true_divide(out, n, out=out)
            return out

        if name == "all_gather":
            out = np.empty(count * n, spec.dtype)
            return Prepared(lambda: [np.concatenate(ins, out=out)] * n, _nothing, reset, list)
        if name == "broadcast":
            out = np.empty(count, spec.dtype)
            return Prepared(lambda: [np.copyto(out, ins[spec.root]) or out] * n, _nothing, reset, list)
        if name == "reduce_scatter":
            part = spec.layout.recv_count
            outs = [ins[r][r * part:(r + 1) * part] if self.in_place else np.empty(part, spec.dtype) for r in range(n)]
            return Prepared(lambda: [sum_into(outs[r], [x[r * part:(r + 1) * part] for x in _home_first(ins, r)])
                                     for r in range(n)], _nothing, reset, list)
        home = spec.root if name == "reduce" else 0
        out = ins[home] if self.in_place else np.empty(count, spec.dtype)
        ins = _home_first(ins, home)  # in place, the home buffer is summed into first, before it is overwritten
        if name == "batch_reduce" and self.per_array:
            size = spec.array_elements
            cuts = range(0, count, size)
            step = lambda: [[sum_into(out[c:c + size], [x[c:c + size] for x in ins]) for c in cuts] and out] * n  # noqa: E731
        else:
            step = lambda: [sum_into(out, ins)] * n  # noqa: E731
        if name == "reduce":
            return Prepared(lambda: [step()[0] if r == spec.root else None for r in range(n)], _nothing, reset, list)
        return Prepared(step, _nothing, reset, list)


def sum_in_order(out: np.ndarray, parts: Sequence[np.ndarray]) -> np.ndarray:
    """The floor of a reduction: `parts` summed into `out` in order, n-1 in-place adds (a copy for one part)."""
    if len(parts) == 1:
        np.copyto(out, parts[0])
    else:
        np.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            np.add(out, part, out=out)
    return out


def _home_first(arrays: list, home: int) -> list:
    return [arrays[home]] + arrays[:home] + arrays[home + 1:]


def _nothing() -> None:
    """NumPy's work is done when its call returns: nothing to wait for."""
