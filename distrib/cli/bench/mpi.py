"""Raw mpi4py series for `distrib bench` across processes: MPI's own collectives on the very buffers distrib gets.

Each process first sums its own devices' inputs in order (as the emulator over MPI does; a copy-free send with
one device per process), then makes one blocking MPI call on NumPy buffers: `Allreduce`, `Allgather`,
`Reduce_scatter_block`, `Bcast` or `Reduce`. MPI has no average: `-o avg` divides after the sum. MPI has no
16-bit float type, so half and bfloat16 reductions print N/A (their gathers and broadcasts move bytes).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from distrib.backends.mpi import mpi_datatype
from distrib.cli.bench.runners import Prepared, RowSpec, sum_in_order


class MpiSeries:
    """nccl-tests' calls through mpi4py, one process per MPI rank, out of place or in place.

    In place follows nccl-tests' buffer offsets where MPI allows: all_gather gathers into the buffer that holds
    this process's inputs at their own offsets; reduce_scatter and the reductions sum into the inputs.

    Args:
      comm: the job's communicator (one process per rank, each driving `spec.local` devices).
      in_place: time the in-place variant.
      per_array: batch_reduce only: one Allreduce per array instead of one over the packed buffer.
    """

    def __init__(self, comm: Any, in_place: bool = False, per_array: bool = False):
        from mpi4py import MPI

        self.MPI, self.comm, self.in_place, self.per_array = MPI, comm, in_place, per_array
        self.name = "raw mpi4py" + (" in-place" if in_place else "") + (" per array" if per_array else "")

    def __repr__(self) -> str:
        return f"<MpiSeries {self.name!r} on {self.comm.Get_size()} processes>"

    def prepare(self, spec: RowSpec) -> Prepared | None:
        MPI, comm, name = self.MPI, self.comm, spec.collective.name
        kind = mpi_datatype(MPI, spec.dtype)
        if kind is None and spec.collective.reduces:
            return None
        local, count = list(spec.local_ranks), spec.layout.send_count
        here = len(local)
        host = [spec.host_input(r) for r in local]
        if self.in_place and name == "all_gather":
            gathered = np.empty(count * spec.ranks, spec.dtype)
            ins = [gathered[r * count:(r + 1) * count] for r in local]
        else:
            ins = [h.copy() for h in host]

        def reset():
            for target, source in zip(ins, host):
                np.copyto(target, source)

        def buf(array):  # a type MPI lacks moves as bytes (gathers and broadcasts only)
            return [array, kind] if kind is not None else [array.view(np.uint8), MPI.BYTE]

        def local_sum(out):  # this process's devices summed in order; one device sends its input as it is
            if here == 1:
                return ins[0]
            return sum_in_order(out, ins)

        def average(out):
            if spec.op == "avg":
                np.true_divide(out, spec.ranks, out=out)
            return out

        if name == "all_gather":
            if self.in_place:
                step = lambda: [comm.Allgather(MPI.IN_PLACE, buf(gathered)) or gathered] * here  # noqa: E731
            else:
                mine, out = np.empty(count * here, spec.dtype), np.empty(count * spec.ranks, spec.dtype)

                def step():
                    send = ins[0] if here == 1 else np.concatenate(ins, out=mine)
                    comm.Allgather(buf(send), buf(out))
                    return [out] * here
            return Prepared(step, _nothing, reset, list)
        if name == "broadcast":
            owner, root = divmod(spec.root, here)
            out = ins[root if comm.Get_rank() == owner else 0] if self.in_place else np.empty(count, spec.dtype)

            def step():
                if not self.in_place and comm.Get_rank() == owner:
                    np.copyto(out, ins[root])
                comm.Bcast(buf(out), root=owner)
                return [out] * here
            return Prepared(step, _nothing, reset, list)
        if name == "reduce_scatter":
            part = spec.layout.recv_count
            total, out = np.empty(count, spec.dtype), np.empty(part * here, spec.dtype)

            def step():
                if self.in_place:  # MPI's in-place reduce-scatter leaves this process's block at the start
                    if here > 1:
                        sum_in_order(ins[0], ins)
                    comm.Reduce_scatter_block(MPI.IN_PLACE, buf(ins[0]), MPI.SUM)
                    block = ins[0]
                else:
                    comm.Reduce_scatter_block(buf(local_sum(total)), buf(out), MPI.SUM)
                    block = out
                return [block[i * part:(i + 1) * part] for i in range(here)]
            return Prepared(step, _nothing, reset, list)
        if name == "reduce":
            owner, root = divmod(spec.root, here)
            mine = comm.Get_rank() == owner
            total, out = np.empty(count, spec.dtype), np.empty(count, spec.dtype)

            def step():
                if self.in_place and mine:
                    if here > 1:
                        sum_in_order(ins[root], [ins[root]] + ins[:root] + ins[root + 1:])
                    comm.Reduce(MPI.IN_PLACE, buf(ins[root]), MPI.SUM, root=owner)
                    result = average(ins[root])
                else:
                    comm.Reduce(buf(local_sum(total)), buf(out) if mine else None, MPI.SUM, root=owner)
                    result = average(out) if mine else None
                return [result if i == root and mine else None for i in range(here)]
            return Prepared(step, _nothing, reset, list)
        # all_reduce and batch_reduce
        out = ins[0] if self.in_place else np.empty(count, spec.dtype)
        total = out if here > 1 else None  # one device: MPI reads its input (or sums in place) directly
        cuts = [(c, min(c + spec.array_elements, count)) for c in range(0, count, spec.array_elements)] \
            if self.per_array else [(0, count)]

        def step():
            if total is not None:
                sum_in_order(total, ins)
            for a, b in cuts:
                source = MPI.IN_PLACE if total is not None or self.in_place else buf(ins[0][a:b])
                comm.Allreduce(source, buf(out[a:b]), MPI.SUM)
            return [average(out)] * here
        return Prepared(step, _nothing, reset, list)


def _nothing() -> None:
    """An MPI call has finished with its buffers when it returns: nothing to wait for."""
