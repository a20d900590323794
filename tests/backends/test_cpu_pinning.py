"""A kept result of a collective keeps only itself alive, not the pack it was reduced in."""

from __future__ import annotations

import numpy as np
import pytest

import distrib
from distrib import CommunicationOptions
from distrib.backends.member_copies import MemberCopies
from distrib.cross_device_ops import HierarchicalCopyAllReduce
from distrib.plan import Buffer, Member

pytestmark = pytest.mark.timeout(60)

DEVICES = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
GRADIENT = 64_000  # float32 elements: 256 KB, large enough for the buffer pool and for copies on threads

MIRRORED = [pytest.param(dict(), id="batched"),
            pytest.param(dict(communication_options=CommunicationOptions(implementation="RING")), id="ring"),
            pytest.param(dict(cross_device_ops=HierarchicalCopyAllReduce(num_packs=1)), id="hierarchical")]


def memory_held(array: np.ndarray) -> int:
    """The bytes `array` keeps alive: its own, or its base's when it is a view (a pooled base maps memory)."""
    base = array.base
    if base is None:
        return array.nbytes
    return memory_held(base) if isinstance(base, np.ndarray) else memoryview(base).nbytes


def keep_one_member(strategy, values, keep: int, steps: int) -> list[list[np.ndarray]]:
    """Runs `steps` all-reduces of `values` (replica r adds r + 1, step s adds s), keeping member `keep`."""
    def step(s):
        ctx = distrib.get_replica_context()
        offset = np.float32(ctx.replica_id_in_sync_group + 1 + s)
        return ctx.all_reduce("SUM", [value + offset for value in values])[keep]

    return [list(strategy.experimental_local_results(strategy.run(step, args=(s,)))) for s in range(steps)]


def test_a_kept_loss_does_not_pin_the_gradients_pack_it_was_reduced_in():
    grads = np.ones(GRADIENT, np.float32)

    def step(s):
        out = distrib.get_replica_context().all_reduce("SUM", {"loss": np.float32(s), "grads": grads})
        return out["loss"]

    with distrib.MirroredStrategy(DEVICES) as strategy:
        kept = [strategy.experimental_local_results(strategy.run(step, args=(s,))) for s in range(20)]
    for s, losses in enumerate(kept):
        assert [float(x) for x in losses] == [4.0 * s] * 4  # each step's own loss, not an earlier step's
        assert all(memory_held(x) == 4 for x in losses)
        assert not any(x.flags.writeable for x in losses)  # results stay read-only, like tensors


@pytest.mark.parametrize("kwargs", MIRRORED)
def test_kept_members_of_large_packs_hold_their_own_size(kwargs):
    values = [np.zeros(GRADIENT, np.float32) for _ in range(4)]  # a 1 MB pack of four 256 KB members
    with distrib.MirroredStrategy(DEVICES, **kwargs) as strategy:
        kept = keep_one_member(strategy, values, keep=2, steps=8)
    for s, per_replica in enumerate(kept):
        for member in per_replica:
            np.testing.assert_array_equal(member, np.full(GRADIENT, 10 + 4 * s, np.float32))
            assert memory_held(member) == GRADIENT * 4


def test_members_of_a_batch_of_small_arrays_hold_their_own_size():
    values = [np.zeros(1_000, np.float32) for _ in range(200)]  # 200 arrays of 4 KB in one 800 KB pack
    with distrib.MirroredStrategy(DEVICES) as strategy:
        kept = keep_one_member(strategy, values, keep=150, steps=8)
    assert all(memory_held(member) == 4_000 for per_replica in kept for member in per_replica)


def test_replicas_share_one_read_only_copy_of_each_member():
    values = [np.zeros(GRADIENT, np.float32) for _ in range(2)]
    with distrib.MirroredStrategy(["CPU:0", "CPU:1"]) as strategy:
        ((first, second),) = keep_one_member(strategy, values, keep=1, steps=1)
    assert np.shares_memory(first, second)  # the emulated devices share host memory: one copy, not two
    assert not first.flags.writeable and not second.flags.writeable
    np.testing.assert_array_equal(first, np.full(GRADIENT, 3, np.float32))


@pytest.mark.parametrize("keep", [
    lambda member: member,
    lambda member: member[10:20],  # a view of it
    lambda member: member.reshape(8, -1).T,  # a transposed view
    lambda member: member.base,  # the copy it views
], ids=["member", "slice", "transpose", "base"])
def test_later_steps_never_overwrite_a_kept_result(keep):
    values = [np.zeros(1_000, np.float32) for _ in range(200)]

    def step(s):
        ctx = distrib.get_replica_context()
        return ctx.all_reduce("SUM", [value + np.float32(s) for value in values])

    with distrib.MirroredStrategy(DEVICES) as strategy:
        first = strategy.experimental_local_results(strategy.run(step, args=(1,)))
        kept = keep(first[3][7])
        del first
        later = [strategy.experimental_local_results(strategy.run(step, args=(s,)))[0][7] for s in range(2, 6)]
    assert (np.asarray(kept) == 4).all()  # step 1's sum, whatever later steps wrote
    assert [float(x[0]) for x in later] == [8.0, 12.0, 16.0, 20.0]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8, np.bool_, np.complex64])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_member_copies_are_the_packs_slices_in_their_shapes(dtype, strided):
    shapes = [(3, 4), (), (0,), (5,), (2, 1, 3)]
    sizes = [int(np.prod(shape)) for shape in shapes]
    offsets = np.cumsum([0] + sizes).tolist()
    buffer = Buffer(np.dtype(dtype).name, tuple(Member(i, shape, offsets[i], sizes[i])
                                                for i, shape in enumerate(shapes)), ((0, offsets[-1]),))
    source = (np.arange(2 * offsets[-1]) % 7).astype(dtype)
    flat = source[::2] if strided else source[:offsets[-1]]
    flat.flags.writeable = False
    copies = MemberCopies()
    for _ in range(2):  # made, then refilled
        per_device = copies.unpack(flat, buffer, 3, run_split=None, on_threads=False)
        for members in per_device:
            for member, shape, start, size in zip(members, shapes, offsets, sizes):
                assert member.shape == shape and member.dtype == dtype and not member.flags.writeable
                np.testing.assert_array_equal(member.reshape(-1), flat[start:start + size])
