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


def host_empty(shape, dtype):
    """`cupy.empty` over host memory, as `host_backed`."""
    return host_backed(int(np.prod(shape)), dtype).reshape(shape)


def step(outputs, position=0, buffer=BUFFER):
    """What execute and unpack do for one replica: take the output flat, then hand out its members."""
    flat = outputs.take(buffer, position, 0, lambda: host_backed(buffer.size))
    return outputs.members(flat, buffer, host_empty)


def test_an_output_nobody_holds_is_handed_out_again_with_the_same_arrays():
    outputs = results.Outputs()
    first = step(outputs)
    assert [m.shape for m in first[-2:]] == [(1000,), (10, 100)]
    ids = [id(m) for m in first]
    del first
    again = step(outputs)
    assert [id(m) for m in again] == ids  # no array was made twice


def test_members_of_a_pack_of_several_are_arrays_of_their_own():
    outputs = results.Outputs()
    flat = outputs.take(BUFFER, 0, 0, lambda: host_backed(BUFFER.size))
    members = outputs.members(flat, BUFFER, host_empty)
    assert all(m.data.mem is not flat.data.mem for m in members)  # a kept one keeps only itself alive
    single = plan_concat_split([((10, 100), np.float32)], 1).buffers[0]
    (whole,) = step(outputs, buffer=single)
    assert whole.shape == (10, 100) and whole.base is not None  # a pack of one: its member is the whole flat


@pytest.mark.parametrize("keep", [
    lambda members: members[5],  # a member
    lambda members: members[5][2:7],  # a view of a member
    lambda members: members[5].reshape(10, 100).T,  # a transposed view
    lambda members: members[5].data,  # a pointer into its memory (as a DLPack or CUDA-array consumer holds one)
], ids=["member", "slice", "transpose", "pointer"])
def test_a_kept_result_is_never_handed_out_again(keep):
    outputs = results.Outputs()
    kept = keep(step(outputs))
    kept_memory = kept.mem if isinstance(kept, cupy.cuda.MemoryPointer) else kept.data.mem
    later = step(outputs)
    assert later[5].data.mem is not kept_memory  # the next step writes elsewhere
    del later, kept, kept_memory
    settled = [id(m) for m in step(outputs)]
    assert [id(m) for m in step(outputs)] == settled  # reused again once nothing is kept


def test_each_replica_buffer_and_gpu_has_its_own_output():
    outputs = results.Outputs()
    other = plan_concat_split([((300,), np.float32)] * 2, 1).buffers[0]
    flats = [outputs.take(BUFFER, k, 0, lambda: host_backed(BUFFER.size)) for k in range(4)]
    flats.append(outputs.take(other, 0, 0, lambda: host_backed(other.size)))
    flats.append(outputs.take(BUFFER, 0, 1, lambda: host_backed(BUFFER.size)))  # the plan on another GPU
    assert len({f.data.mem.ptr for f in flats}) == 6


def test_a_flat_from_elsewhere_is_unpacked_into_new_arrays():
    outputs = results.Outputs()
    flat = host_backed(BUFFER.size)
    first, second = outputs.members(flat, BUFFER, host_empty), outputs.members(flat, BUFFER, host_empty)
    assert first[0] is not second[0] and first[0].data.mem is not flat.data.mem


def test_the_unpack_launch_is_kept_while_every_member_array_is_reused():
    outputs = results.Outputs()
    tables = []  # the member addresses of each launch prepared

    def prepare(members):
        tables.append([m.data.ptr for m in members])
        return lambda: None

    def unpack_step():
        flat = outputs.take(BUFFER, 0, 0, lambda: host_backed(BUFFER.size))
        return outputs.unpacking(flat, BUFFER, host_empty, prepare)

    members, launch = unpack_step()
    assert tables == [[m.data.ptr for m in members]]
    del members
    members, again = unpack_step()
    assert again is launch and len(tables) == 1  # same arrays, same table: nothing rebuilt
    kept = members[3]
    del members
    members, third = unpack_step()
    assert third is not launch and len(tables) == 2  # a kept member was replaced: the table follows it
    assert tables[1][3] == members[3].data.ptr != kept.data.ptr


def test_a_flat_from_elsewhere_gets_a_launch_for_its_new_arrays():
    outputs = results.Outputs()
    flat = host_backed(BUFFER.size)
    prepared = []
    members, _ = outputs.unpacking(flat, BUFFER, host_empty, lambda arrays: prepared.append(arrays))
    assert prepared == [members]


def test_the_member_checks_read_cupys_own_attributes():
    from distrib.backends.cuda import arrays

    parts = [host_backed(8) for _ in range(3)]
    assert arrays.all_on(parts, 0) and not arrays.all_on(parts, 1)
    assert not arrays.all_on([*parts, np.zeros(8, np.float32)], 0)
    assert arrays.all_contiguous(parts) is parts
    assert not arrays.is_c_contiguous(parts[0][::2]) and arrays.is_c_contiguous(parts[0].reshape(2, 4))
