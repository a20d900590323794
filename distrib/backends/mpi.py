"""The CPU emulator across processes: each process sums its replicas in order, then MPI sums the processes.

Bytes move through mpi4py's buffer interface (`Allreduce`, `Allgatherv`, `Bcast` on NumPy buffers, in place
where MPI allows), never pickled. The same plans and packing as one process run here: each buffer is packed per
replica, summed over this process's replicas in replica order, and every chunk is one MPI call, made once every
rank has reached the collective (see process_group.py). Float results equal one process's up to rounding (the
sum is grouped by process); integer results are exact. float16 and bfloat16, which MPI has no type for, travel
as float32.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from distrib import timeline
from distrib.backends.cpu import CpuBackend, native_order, _shared as shared_views
from distrib.backends.packed import FLOAT_PREFIXES, unpack_into
from distrib.backends.process_group import ProcessGroup
from distrib.backends.signatures import signature
from distrib.errors import BackendUnavailableError
from distrib.plan import NCCL, AllReducePlan, dtype_name, integer_mean

# elements per MPI call (read at each call): MPI-3 counts are C ints, and Open MPI 4.1 refuses a larger one with
# "MPI_ERR_ARG: invalid argument of some other kind", so larger arrays travel in several calls
MAX_COUNT = 2**31 - 1


def pieces(bounds: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """`bounds` with every (start, stop) longer than MAX_COUNT cut into consecutive pieces no longer.

    Example:
      >>> pieces([(0, 2**32), (2**32, 2**32)])
      [(0, 2147483647), (2147483647, 4294967294), (4294967294, 4294967296), (4294967296, 4294967296)]
    """
    limit = MAX_COUNT
    return [piece for start, stop in bounds
            for piece in ([(a, min(a + limit, stop)) for a in range(start, stop, limit)] or [(start, stop)])]


# dtype name -> (mpi4py datatype name, reduction op name); the others travel as float32
_MPI_TYPES = {
    "float32": ("FLOAT", "SUM"), "float64": ("DOUBLE", "SUM"),
    "complex64": ("C_FLOAT_COMPLEX", "SUM"), "complex128": ("C_DOUBLE_COMPLEX", "SUM"),
    "int8": ("INT8_T", "SUM"), "int16": ("INT16_T", "SUM"), "int32": ("INT32_T", "SUM"), "int64": ("INT64_T", "SUM"),
    "uint8": ("UINT8_T", "SUM"), "uint16": ("UINT16_T", "SUM"), "uint32": ("UINT32_T", "SUM"),
    "uint64": ("UINT64_T", "SUM"), "bool": ("C_BOOL", "LOR"),  # NumPy's bool sum is a logical or
}


def mpi_datatype(MPI: Any, dtype: Any) -> Any | None:
    """MPI's predefined datatype for `dtype` (mpi4py's module `MPI`), or None where MPI has none (float16, bfloat16).

    Example:
      >>> import types
      >>> MPI = types.SimpleNamespace(INT32_T="MPI_INT32_T")  # stands in for mpi4py.MPI
      >>> mpi_datatype(MPI, np.int32), mpi_datatype(MPI, np.float16)
      ('MPI_INT32_T', None)
    """
    entry = _MPI_TYPES.get(dtype_name(dtype))
    return None if entry is None else getattr(MPI, entry[0])


class MpiBackend(CpuBackend):
    """NumPy arrays on this process's emulated devices; collectives span every replica of every MPI rank.

    Devices are this process's replicas, 'CPU:0'..'CPU:n-1' ($DISTRIB_CPU_REPLICAS, default 2); the group's
    `first_replica` is the global id of 'CPU:0'. Creating one joins the MPI job (every rank must).

    Args:
      num_local_replicas: this process's replicas (default: $DISTRIB_CPU_REPLICAS, else 2).
    """

    name = "mpi"

    def __init__(self, num_local_replicas: int | None = None):
        super().__init__(num_local_replicas)
        self.group = ProcessGroup(len(self.default_devices()))
        self._wires: dict[np.dtype, tuple[Any, Any, np.dtype | None]] = {}

    def _wire(self, dtype: np.dtype) -> tuple[Any, Any, np.dtype | None]:
        """(the MPI datatype `dtype` travels as, or None where it is converted first; the reduction op; the dtype it
        is converted to: float32 for float16 and bfloat16, native byte order for a byte-swapped array), memoized.

        MPI's datatypes describe values in this host's byte order: a byte-swapped float32 summed as MPI_FLOAT
        would add its bytes as if they were native."""
        entry = self._wires.get(dtype)
        if entry is None:
            MPI = self.group.MPI
            op = getattr(MPI, _MPI_TYPES.get(dtype_name(dtype), (None, "SUM"))[1])
            native = native_order(dtype)
            mpi_type = mpi_datatype(MPI, native)
            if mpi_type is None:
                entry = (None, op, np.dtype(np.float32))
            else:
                entry = (mpi_type, op, None) if native is dtype else (None, op, native)
            self._wires[dtype] = entry
        return entry

    def _buffer(self, array: np.ndarray) -> tuple[np.ndarray, list]:
        """The array as MPI sends it (float16/bfloat16 as float32, byte-swapped values in native order), and its
        [buffer, datatype] spec."""
        mpi_type, _, converted = self._wire(array.dtype)
        if mpi_type is None:
            wire = array.astype(converted)
            return wire, [wire, self._wire(converted)[0]]
        return array, [array, mpi_type]

    def _reduction(self, flats: Sequence[np.ndarray], bounds: Sequence[tuple[int, int]]) -> tuple:
        """This process's part of summing `flats` across processes: (the MPI calls, (send, receive, op) each, one
        per chunk; the new writable buffer the sum lands in; its float32 stand-in to copy back from, or None).

        One replica sends its own buffer, which MPI copies as it sums; several are summed here in replica order,
        and reduced in place. Lean on purpose: it runs right after the previous transfer has evicted the
        interpreter's working set from the caches, where each step costs several times what it costs in a loop.
        """
        first = flats[0]
        total = self._pool.empty(first.shape, first.dtype)
        mpi_type, op, _ = self._wire(first.dtype)
        if first.size > MAX_COUNT:
            bounds = pieces(bounds)
        whole = len(bounds) == 1 and bounds[0][1] - bounds[0][0] == first.size
        if len(flats) == 1 and whole and mpi_type is not None and first.flags.c_contiguous:
            return [([first, mpi_type], [total, mpi_type], op)], total, None  # one buffer of a batch: sent as it is
        send = None
        if len(flats) > 1:
            np.add(first, flats[1], out=total)
            for flat in flats[2:]:
                np.add(total, flat, out=total)
        elif mpi_type is not None and first.flags.c_contiguous:
            send = first
        else:
            np.copyto(total, first)
        wire, (_, mpi_type) = self._buffer(total)  # float16, bfloat16 summed as float32; byte-swapped as native
        in_place = self.group.MPI.IN_PLACE
        if whole:
            calls = [(in_place if send is None else [send, mpi_type], [wire, mpi_type], op)]
        else:
            calls = [(in_place if send is None else [send[a:b], mpi_type], [wire[a:b], mpi_type], op)
                     for a, b in bounds]
        return calls, total, None if wire is total else wire

    def _sum_whole(self, flat: np.ndarray, what: str, timeout: float | None, key: int = 0) -> np.ndarray | None:
        """One local replica's `flat` (any shape) summed across processes by one MPI call, straight from it into a
        new writable 1-D pooled buffer; None where MPI cannot send it as it is in one call (float16, bfloat16,
        byte-swapped, not contiguous, more than MAX_COUNT elements).

        The usual multi-worker call (one replica per process, one array or pack), kept lean: it runs right after
        the previous transfer has evicted the interpreter's working set from the caches, where every step costs
        several times what it costs in a loop (the general route took 8 to 15 µs more, 4 to 7 % of a 1 MB call).
        """
        wire = self._wires.get(flat.dtype) or self._wire(flat.dtype)
        mpi_type = wire[0]
        if mpi_type is None or flat.size > MAX_COUNT or not flat.flags.c_contiguous:
            return None
        total = self._pool.take(flat.nbytes).view(flat.dtype)  # 1-D, no shape arithmetic: `empty` does more
        self.group.collectives.run(what, self.group.comm.Allreduce, timeout,
                                   signature(what, ((flat.size, flat.dtype),), key), [flat, mpi_type],
                                   [total, mpi_type], wire[1])
        return total

    def _summed(self, flats: Sequence[np.ndarray], bounds: Sequence[tuple[int, int]], what: str,
                timeout: float | None, key: int = 0) -> np.ndarray:
        """`flats` summed over every replica of every process, into a new writable buffer (`key`: for the
        signature, see `signature`)."""
        if len(flats) == 1 and len(bounds) == 1 and bounds[0][0] == 0 and bounds[0][1] == flats[0].size:
            total = self._sum_whole(flats[0], what, timeout, key)
            if total is not None:
                return total
        reduction = self._reduction(flats, bounds)
        self._sum_across((reduction,), what, timeout, key)
        return reduction[1]

    def _sum_across(self, reductions: Sequence[tuple], what: str, timeout: float | None, key: int = 0) -> None:
        """Makes the MPI calls of `reductions` (from `_reduction`) once every process has reached them."""
        comm = self.group.comm
        calls = [call for reduction in reductions for call in reduction[0]]
        check = signature(what, [(total.size, total.dtype) for _, total, _ in reductions], key)
        if len(calls) == 1:
            self.group.run(what, comm.Allreduce, timeout, *calls[0], signature=check)
        else:
            self.group.run(what, lambda: [comm.Allreduce(*call) for call in calls], timeout, signature=check)
        for _, total, wire in reductions:
            if wire is not None:
                np.copyto(total, wire, casting="unsafe")

    def execute(self, plan: AllReducePlan, per_device, devices, *, timeout=None):
        if plan.method == NCCL:
            self._refuse_nccl(devices)
        count = self.group.num_replicas
        single = plan.single
        recording = timeline.recording  # these routes sum through MPI, not through the timed all_reduce: while a
        # timeline records, each records its span (one local replica's value takes `_one_value`'s: the same MPI call)
        if single is not None and len(per_device) == 1 and recording is None:  # one array of one local replica: the
            value = per_device[0][0]  # usual multi-worker call, straight from the array into the result
            # the plan's dtype by name, from the memo: `dtype == "float32"` parses the string every time (2-3 µs
            # of a 1 MB call, right after a transfer has left the caches cold)
            total = self._sum_whole(value, "all_reduce", timeout, plan.identity) if type(value) is np.ndarray and \
                dtype_name(value.dtype) == single[0] else None
            if total is not None:
                _, shape, float_mean = single
                if float_mean:
                    np.true_divide(total, count, out=total)
                total.setflags(write=False)  # read-only, as TensorFlow's tensors are
                result = total if shape is None else total.reshape(shape)
                return [[integer_mean(result, count) if plan.mean and not float_mean else result]]
        if single is not None:  # one value of several local replicas (or, recording, one): summed here, then across,
            # without packing
            reduced = self._one_value(single, [values[0] for values in per_device], plan, devices, timeout, count)
            if reduced is not None:
                return [[value] for value in reduced]
        buffers = plan.packing.buffers
        reductions = [self._reduction([self.pack([values[m.index] for m in buffer.members], buffer, device)
                                       for values, device in zip(per_device, devices)], buffer.chunks)
                      for buffer in buffers]
        # every route of a plan announces its identity (`_plan_all_reduce` too): processes whose replicas take
        # different routes to the same plan agree, and another shape or op is told apart
        if recording is None:
            self._sum_across(reductions, "all_reduce", timeout, plan.identity)
        else:
            with timeline.span("all_reduce", "collective", tuple(devices),
                               {"bytes": sum(total.nbytes for _, total, _ in reductions)}):
                self._sum_across(reductions, "all_reduce", timeout, plan.identity)
        results: list[list[Any]] = [[None] * len(per_device[0]) for _ in devices]
        for buffer, (_, total, _) in zip(buffers, reductions):
            float_mean = plan.mean and buffer.dtype.startswith(FLOAT_PREFIXES)
            if float_mean:
                np.true_divide(total, count, out=total)
            # one result for every local replica, read-only as TensorFlow's tensors are: its members are copied
            # out once, into copies reused from step to step, and each replica gets views of its own
            unpack_into(results, self, plan, buffer, shared_views(total, len(devices)), devices, count)
        return results

    def _refuse_nccl(self, devices) -> None:
        raise BackendUnavailableError(
            f"CommunicationImplementation.NCCL needs NCCL between GPUs, but this job runs on the CPU emulator "
            f"over MPI. Received: devices {list(devices)}. Use implementation AUTO or RING, or GPU devices.")

    def all_reduce(self, flats, chunks, devices, mean, *, timeout=None):
        return self._all_reduce(flats, chunks, devices, mean, timeout, int(mean))

    def _plan_all_reduce(self, plan, flats, chunks, devices, mean, timeout):
        if timeline.recording is None:
            return self._all_reduce(flats, chunks, devices, mean, timeout, plan.identity)
        with timeline.span("all_reduce", "collective", tuple(devices), {"bytes": flats[0].nbytes}):  # as the timed
            return self._all_reduce(flats, chunks, devices, mean, timeout, plan.identity)  # all_reduce records one

    def _all_reduce(self, flats, chunks, devices, mean: bool, timeout: float | None, key: int) -> list[np.ndarray]:
        total = self._summed(flats, chunks, "all_reduce", timeout, key)
        if mean:
            np.true_divide(total, self.group.num_replicas, out=total)
        return shared_views(total, len(devices))

    def all_gather(self, flats, devices, *, timeout=None):
        """Every replica's flat array (all of one length), of every process, in global replica order.

        This process's replicas are copied once, into their place in the result, which MPI then gathers in place:
        the out-of-place form copies them there itself, and so took a second copy (1.8x raw at 16 MB).
        """
        group = self.group
        first, per_replica = flats[0], flats[0].size
        # in native byte order, whatever order each process's flats come in (a padded pack of a byte-swapped value
        # is native, its lone member may not be): MPI moves the bytes as they are
        dtype = native_order(first.dtype)
        gathered = self._pool.take(first.itemsize * per_replica * group.num_replicas).view(dtype)
        start = group.first_replica * per_replica
        mine = gathered[start:start + per_replica * len(flats)]
        if len(flats) == 1:
            np.copyto(mine, first.reshape(-1))
        else:
            np.concatenate([flat.reshape(-1) for flat in flats], out=mine)
        spec = self._gather_spec(per_replica, dtype)
        (counts, starts), mpi_type = spec
        check = signature("all_gather", ((per_replica, dtype),))
        if sum(counts) <= MAX_COUNT:
            group.run("all_gather", group.comm.Allgatherv, timeout, group.MPI.IN_PLACE, [gathered, *spec],
                      signature=check)
        else:  # displacements past a C int: each rank's block broadcast from it, in pieces (the same bytes moved)
            units = gathered.view(np.uint8) if mpi_type is group.MPI.BYTE else gathered
            blocks = [(rank, a, b) for rank, (count, start) in enumerate(zip(counts, starts))
                      for a, b in pieces(((start, start + count),))]
            group.run("all_gather", lambda: [group.comm.Bcast([units[a:b], mpi_type], root=rank)
                                             for rank, a, b in blocks], timeout, signature=check)
        return shared_views(gathered, len(devices))

    def _gather_spec(self, per_replica: int, dtype: np.dtype) -> tuple[tuple[list[int], list[int]], Any]:
        """((counts, displacements), datatype) of an all-gather of `per_replica` elements per replica: bytes where
        MPI has no type for `dtype` as it is (float16, bfloat16, byte-swapped)."""
        mpi_type = self._wire(dtype)[0]
        if mpi_type is None:
            mpi_type, per_replica = self.group.MPI.BYTE, per_replica * dtype.itemsize
        return self.group.gather_counts(per_replica), mpi_type

    def gather_rows(self, rows, *, timeout=None):
        return self.group.gather_rows(rows, timeout)

    def reduce_scatter(self, flats, devices, *, timeout=None):
        """Local replica i gets global slice `first_replica + i` of the sum over every replica."""
        n = self.group.num_replicas
        if flats[0].size % n:
            raise ValueError(f"reduce_scatter needs a length divisible by {n} replicas. Received: {flats[0].size}.")
        total = self._summed(flats, ((0, flats[0].size),), "reduce_scatter", timeout)
        part, first = total.size // n, self.group.first_replica
        return [self.copy(total[(first + i) * part:(first + i + 1) * part], d) for i, d in enumerate(devices)]

    def broadcast(self, array, devices, *, timeout=None):
        """Rank 0's `array` on every device of every process (each rank passes an array of the same shape)."""
        group = self.group
        out = self.copy(array, devices[0])
        wire, (_, mpi_type) = self._buffer(out)
        flat = wire.reshape(-1)
        # the shape signed too, so that (2, 3) against (3, 2) is told apart: a tuple of ints hashes alike in every
        # process (a str would not)
        check = signature("broadcast", ((flat.size, flat.dtype),), hash(array.shape))
        group.run("broadcast", lambda: [group.comm.Bcast([flat[a:b], mpi_type], root=0)
                                        for a, b in pieces(((0, flat.size),))], timeout, signature=check)
        if wire is not out:
            np.copyto(out, wire, casting="unsafe")
        return shared_views(out, len(devices))

    def __repr__(self) -> str:
        return f"<MpiBackend rank={self.group.rank} of {self.group.size}, replicas={self.group.replica_counts}>"


# the host exchange of an all-gather's sizes is a collective across the processes too (wrapped only while recording)
timeline.instrument(MpiBackend, {"gather_rows": "collective"})
