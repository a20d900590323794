"""Raw `cupy.cuda.nccl` series for `distrib bench` on GPUs: nccl-tests' calls, out of place and in place.

Unverified on hardware in this revision's tests (they run without a GPU); written against cupy.cuda.nccl's
NcclCommunicator API and the CUDA backend's NCCL type table.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from distrib.backends.cuda.dtypes import NCCL_OPS, NCCL_TYPES
from distrib.backends.cuda.watchdog import wait_for
from distrib.cli.bench.runners import Prepared, RowSpec


class NcclSeries:
    """nccl-tests' own calls through cupy.cuda.nccl, one communicator per GPU, one group call per step.

    In place follows nccl-tests' buffer offsets: all_gather sends from its slice of the receive buffer,
    reduce_scatter receives into its slice of the send buffer.

    Under mpirun the communicators span every GPU of every process: rank 0 makes the NCCL unique id, MPI
    broadcasts it, and each process joins with its GPUs as neighbouring global ranks.

    Args:
      ordinals: this process's CUDA devices, one rank each.
      in_place: time the in-place variant.
      per_array: batch_reduce only: one ncclAllReduce per array (in one group) instead of one over the buffer.
      job: the processes (distrib.cli.bench.job.Job) when the run spans several; None for one process.
    """

    def __init__(self, ordinals: Sequence[int], in_place: bool = False, per_array: bool = False, job=None):
        self.ordinals, self.in_place, self.per_array, self.job = list(ordinals), in_place, per_array, job
        self.name = "raw NCCL" + (" in-place" if in_place else "") + (" per array" if per_array else "")
        self._comms: list | None = None
        self._streams: list | None = None

    def __repr__(self) -> str:
        return f"<NcclSeries {self.name!r} GPUs {self.ordinals}>"

    def _setup(self):
        import cupy
        from cupy.cuda import nccl

        if self._comms is None and (self.job is None or self.job.comm is None):
            self._comms = nccl.NcclCommunicator.initAll(self.ordinals)
        elif self._comms is None:
            job = self.job
            unique_id = job.comm.bcast(nccl.get_unique_id() if job.chief else None, root=0)
            self._comms = []
            nccl.groupStart()  # several communicators in one thread are created inside one group
            for k, ordinal in enumerate(self.ordinals):
                with cupy.cuda.Device(ordinal):
                    self._comms.append(nccl.NcclCommunicator(job.ranks, unique_id, job.first + k))
            nccl.groupEnd()
        if self._streams is None:
            self._streams = []
            for ordinal in self.ordinals:
                with cupy.cuda.Device(ordinal):
                    self._streams.append(cupy.cuda.Stream(non_blocking=True))
        return cupy, nccl

    def prepare(self, spec: RowSpec) -> Prepared:
        cupy, nccl = self._setup()
        name, layout = spec.collective.name, spec.layout
        dtype = NCCL_TYPES[np.dtype(spec.dtype).name]
        op = NCCL_OPS["AVG" if spec.op == "avg" else "SUM"]
        host = [spec.host_input(r) for r in spec.local_ranks]
        sends, recvs, buffers = [], [], []
        for r, ordinal in enumerate(self.ordinals):
            g = spec.first_local + r  # the global rank: in place, nccl-tests' offsets follow it
            with cupy.cuda.Device(ordinal):
                if not self.in_place:
                    sends.append(cupy.asarray(host[r]))
                    recvs.append(cupy.empty(layout.recv_count, spec.dtype))
                    buffers.append(sends[-1])
                elif name == "all_gather":
                    buffer = cupy.empty(layout.recv_count, spec.dtype)
                    sends.append(buffer[g * layout.send_count:(g + 1) * layout.send_count])
                    recvs.append(buffer)
                    buffers.append(sends[-1])
                elif name == "reduce_scatter":
                    buffer = cupy.asarray(host[r])
                    sends.append(buffer)
                    recvs.append(buffer[g * layout.recv_count:(g + 1) * layout.recv_count])
                    buffers.append(buffer)
                else:
                    buffer = cupy.asarray(host[r])
                    sends.append(buffer)
                    recvs.append(buffer)
                    buffers.append(buffer)

        def settle():
            # the copies run on each device's default stream, the collectives on non-blocking streams that do not
            # wait for it: every device must be done copying before a step reads its buffers
            for ordinal in self.ordinals:
                cupy.cuda.Device(ordinal).synchronize()

        def reset():
            for r, ordinal in enumerate(self.ordinals):
                with cupy.cuda.Device(ordinal):
                    buffers[r].set(host[r])
            settle()

        settle()  # the buffers above were filled on the default streams too

        def launch(r: int, comm, stream: int) -> None:
            send, recv = sends[r].data.ptr, recvs[r].data.ptr
            if name == "all_gather":
                comm.allGather(send, recv, layout.send_count, dtype, stream)
            elif name == "reduce_scatter":
                comm.reduceScatter(send, recv, layout.recv_count, dtype, op, stream)
            elif name == "broadcast":
                comm.broadcast(send, recv, layout.send_count, dtype, spec.root, stream)
            elif name == "reduce":
                comm.reduce(send, recv, layout.send_count, dtype, op, spec.root, stream)
            elif name == "batch_reduce" and self.per_array:
                step_bytes = spec.array_elements * np.dtype(spec.dtype).itemsize
                for k, start in enumerate(range(0, layout.send_count, spec.array_elements)):
                    elements = min(spec.array_elements, layout.send_count - start)
                    comm.allReduce(send + k * step_bytes, recv + k * step_bytes, elements, dtype, op, stream)
            else:
                comm.allReduce(send, recv, layout.send_count, dtype, op, stream)

        def step():
            nccl.groupStart()
            for r, (ordinal, comm, stream) in enumerate(zip(self.ordinals, self._comms, self._streams)):
                with cupy.cuda.Device(ordinal):
                    launch(r, comm, stream.ptr)
            nccl.groupEnd()

        def sync():  # polls, as nccl-tests does (cudaStreamQuery): a blocking wait can cost milliseconds to wake
            wait_for(self._streams)

        def outputs(_):
            return [recv.get() if name != "reduce" or r == spec.local_index(spec.root) else None
                    for r, recv in enumerate(recvs)]

        return Prepared(step, sync, reset, outputs)

    def close(self) -> None:
        """Destroys the communicators."""
        for comm in self._comms or ():
            comm.destroy()
        self._comms = None
