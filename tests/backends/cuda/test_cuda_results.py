"""Reused all-reduce outputs without a GPU: CuPy arrays over host memory stand in for device memory (no kernel runs,
only the views and reference counts that decide reuse)."""

from __future__ import annotations

import numpy as np
import pytest

from distrib.plan import plan_concat_split

cupy = pytest.importorskip("cupy", reason="CuPy comes with distrib[test]")
results = pytest.importorskip("distrib.backends.cuda.results")

BUFFER = plan_concat_split([((1000,), np.float32)] * 199 + [((10, 100), np.float32)], 1).buffers[0]


def host_backed(size: int, dtype=np.float32):
    """A CuPy array whose memory is a host NumPy array: enough for views, never for a kernel."""
    host = np.zeros(size, dtype)
    memory = cupy.cuda.memory.UnownedMemory(host.ctypes.data, host.nbytes, host, device_id=0)
    return cupy.ndarray((size,), dtype, memptr=cupy.cuda.memory.MemoryPointer(memory, 0))


def step(outputs, position=0, buffer=BUFFER):
    """What execute and unpack do for one replica: take the output flat, then hand out its members."""
    flat = outputs.take(buffer, position, lambda: host_backed(buffer.size))
    return outputs.members(flat, buffer)


def test_an_output_nobody_holds_is_handed_out_again_with_the_same_views():
    outputs = results.Outputs()
    first = step(outputs)
    assert [m.shape for m in first[-2:]] == [(1000,), (10, 100)]
    ids = [id(m) for m in first]
    del first
    again = step(outputs)
    assert [id(m) for m in again] == ids  # no view was built twice


@pytest.mark.parametrize("keep", [
    lambda members: members[5],  # a member
    lambda members: members[5][2:7],  # a view of a member
    lambda members: members[-1].T,  # a transposed view
    lambda members: members[5].base,  # the whole flat
    lambda members: members[5].data,  # a pointer into its memory (as a DLPack or CUDA-array consumer holds one)
], ids=["member", "slice", "transpose", "flat", "pointer"])
def test_a_kept_result_is_never_handed_out_again(keep):
    outputs = results.Outputs()
    kept = keep(step(outputs))
    kept_memory = kept.mem if isinstance(kept, cupy.cuda.MemoryPointer) else kept.data.mem
    assert step(outputs)[0].data.mem is not kept_memory  # the next step writes elsewhere
    del kept, kept_memory
    settled = [id(m) for m in step(outputs)]
    assert [id(m) for m in step(outputs)] == settled  # reused again once nothing is kept


def test_each_replica_and_each_buffer_has_its_own_output():
    outputs = results.Outputs()
    other = plan_concat_split([((300,), np.float32)] * 2, 1).buffers[0]
    flats = [outputs.take(BUFFER, k, lambda: host_backed(BUFFER.size)) for k in range(4)]
    flats.append(outputs.take(other, 0, lambda: host_backed(other.size)))
    assert len({f.data.mem.ptr for f in flats}) == 5


def test_a_flat_from_elsewhere_is_unpacked_into_new_views():
    outputs = results.Outputs()
    flat = host_backed(BUFFER.size)
    first, second = outputs.members(flat, BUFFER), outputs.members(flat, BUFFER)
    assert first[0] is not second[0] and first[0].base is flat and first[0].data.ptr == flat.data.ptr


@pytest.mark.parametrize("sizes, copied", [
    ([20_000, 3, 256, 257], [1, 2]),  # 1 KB and less, of a pack of 64 KB or more
    ([3, 256], []),  # a small pack pinned by a kept member costs little
    ([20_000], []),  # a pack of one member is that member
])
def test_small_members_of_large_packs_are_handed_out_as_copies(sizes, copied):
    buffer = plan_concat_split([((n,), np.float32) for n in sizes], 1).buffers[0]
    assert results.copied_members(buffer, 4) == copied
