"""The packing planner: which values share a flat buffer, in which order, cut into which collective calls."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distrib.plan import (
    HIERARCHICAL,
    NATIVE,
    RING,
    all_reduce_plan,
    concat_split_bounds,
    group_by_dtype,
    group_by_size,
    hierarchical_roots,
    plan_by_size,
    plan_concat_split,
)

DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8", "complex64", "bool"]

shapes = st.lists(st.integers(0, 5), max_size=3).map(tuple)  # scalars (), empty (0, 3) and ordinary shapes
spec_lists = st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), max_size=12)
nbytes_lists = st.lists(st.integers(0, 400), max_size=15)
PROPERTY = settings(max_examples=200, deadline=None)


def indices(plan):
    """The caller's value indices in each buffer, buffers in execution order."""
    return [[m.index for m in b.members] for b in plan.buffers]


def nbytes(spec) -> int:
    shape, dtype = spec
    return math.prod(shape) * np.dtype(dtype).itemsize


def first_appearance(dtypes) -> list[str]:
    return list(dict.fromkeys(np.dtype(d).name for d in dtypes))


def assert_layout(plan, specs):
    """Every value sits in exactly one single-dtype buffer, at its offset, and the chunks cover each buffer."""
    placed = sorted(i for ids in indices(plan) for i in ids)
    assert placed == list(range(len(specs)))
    for buffer in plan.buffers:
        assert buffer.members, "a buffer is never empty of values"
        offset = 0
        for member in buffer.members:
            shape, dtype = specs[member.index]
            assert np.dtype(dtype).name == buffer.dtype  # never upcast, never mix
            assert member.shape == tuple(shape)
            assert member.size == math.prod(shape)
            assert member.offset == offset
            offset += member.size
        assert buffer.size == offset
        assert buffer.nbytes == offset * np.dtype(buffer.dtype).itemsize
        position = 0
        for start, stop in buffer.chunks:
            assert start == position and stop > start, f"chunks {buffer.chunks} must be non-empty and contiguous"
            position = stop
        assert position == buffer.size, f"chunks {buffer.chunks} must cover all {buffer.size} elements"
    assert plan.num_calls == sum(len(b.chunks) for b in plan.buffers)


def buffers_by_dtype(plan) -> dict[str, list]:
    runs = [b.dtype for i, b in enumerate(plan.buffers) if i == 0 or plan.buffers[i - 1].dtype != b.dtype]
    assert len(runs) == len(set(runs)), f"a dtype's buffers are consecutive; got {runs}"
    groups: dict[str, list] = {}
    for buffer in plan.buffers:
        groups.setdefault(buffer.dtype, []).append(buffer)
    return groups


# group_by_size: TensorFlow's rule, exactly


def test_group_by_size_documented_example():
    assert group_by_size([128, 32, 800, 4], 200) == [[0, 1, 2], [3]]


@pytest.mark.parametrize("nbytes, packs", [
    ([200, 5], [[0, 1]]),                 # exactly at the limit: the pack keeps accepting
    ([100, 100, 1], [[0, 1, 2]]),         # reaches exactly 200 after two values, still open
    ([201, 5], [[0], [1]]),               # exceeds the limit: closed
    ([100, 101, 1], [[0, 1], [2]]),
    ([500], [[0]]),                       # no value is split, however large
    ([300, 0, 0, 7], [[0], [1, 2, 3]]),   # empty values join the open pack
    ([0, 0, 0], [[0, 1, 2]]),
])
def test_group_by_size_closes_a_pack_only_after_exceeding_the_limit(nbytes, packs):
    assert group_by_size(nbytes, 200) == packs


def test_group_by_size_zero_limit_is_one_pack():
    assert group_by_size([10**9, 1, 2], 0) == [[0, 1, 2]]


def test_group_by_size_of_nothing_is_no_pack():
    assert group_by_size([], 0) == []
    assert group_by_size([], 100) == []


def test_group_by_size_rejects_negative_limit():
    with pytest.raises(ValueError, match="bytes_per_pack must be non-negative"):
        group_by_size([4], -1)


@PROPERTY
@given(nbytes_lists, st.integers(0, 500))
def test_group_by_size_properties(sizes, limit):
    packs = group_by_size(sizes, limit)
    assert [p for pack in packs for p in pack] == list(range(len(sizes)))  # order kept, nothing split
    assert all(packs)
    if limit == 0 and sizes:
        assert len(packs) == 1
    for pack in packs[:-1]:
        assert sum(sizes[p] for p in pack) > limit
    for pack in packs:  # the pack was still open when its last value arrived
        assert sum(sizes[p] for p in pack[:-1]) <= limit or limit == 0


# concat_split_bounds: NcclAllReduce's num_packs cut


def test_concat_split_bounds_puts_the_remainder_in_the_last_chunk():
    assert concat_split_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert concat_split_bounds(10, 1) == [(0, 10)]
    assert concat_split_bounds(12, 4) == [(0, 3), (3, 6), (6, 9), (9, 12)]


def test_concat_split_bounds_needs_at_least_one_pack():
    with pytest.raises(ValueError, match="num_packs must be >= 1"):
        concat_split_bounds(10, 0)


# group_by_dtype


def test_group_by_dtype_keeps_first_appearance_order_and_spellings_agree():
    dtypes = ["int32", "float32", "int32", np.float32, "f4", np.dtype("float64")]
    assert group_by_dtype(dtypes) == [[0, 2], [1, 3, 4], [5]]


# plan_by_size: the collective path (reverse order, pack by bytes)


def test_plan_by_size_documented_example():
    plan = plan_by_size([((32,), "float32"), ((8,), "float32"), ((200,), "float32"), ((1,), "float32")], 200)
    assert indices(plan) == [[3, 2], [1, 0]]
    assert [b.nbytes for b in plan.buffers] == [804, 160]
    assert [b.chunks for b in plan.buffers] == [((0, 201),), ((0, 40),)]
    assert plan.num_calls == 2


def test_plan_by_size_packs_tensorflows_example_in_reversed_order():
    # The collective path reverses values first, so values whose reverse is [128, 32, 800, 4] bytes
    # are packed as TensorFlow packs [128, 32, 800, 4]: [[128, 32, 800], [4]].
    specs = [((4,), "uint8"), ((800,), "uint8"), ((32,), "uint8"), ((128,), "uint8")]
    plan = plan_by_size(specs, 200)
    assert indices(plan) == [[3, 2, 1], [0]]
    assert [b.nbytes for b in plan.buffers] == [960, 4]


@pytest.mark.parametrize("limit, packs", [(959, [[3, 2, 1], [0]]), (960, [[3, 2, 1, 0]]), (1, [[3], [2], [1], [0]])])
def test_plan_by_size_limit_is_strict(limit, packs):
    specs = [((4,), "uint8"), ((800,), "uint8"), ((32,), "uint8"), ((128,), "uint8")]
    assert indices(plan_by_size(specs, limit)) == packs


def test_plan_by_size_zero_limit_is_one_buffer_per_dtype():
    specs = [((1000,), "float32"), ((3,), "int64"), ((2, 2), "float32")]
    plan = plan_by_size(specs, 0)
    assert indices(plan) == [[2, 0], [1]]
    assert [b.dtype for b in plan.buffers] == ["float32", "int64"]
    assert plan.num_calls == 2


def test_plan_by_size_never_upcasts():
    specs = [((4,), "float32"), ((4,), "int32"), ((4,), "float32"), ((4,), "float64"), ((4,), "float16")]
    plan = plan_by_size(specs, 0)
    # reversed: float16 (4), float64 (3), float32 (2, 0), int32 (1)
    assert [b.dtype for b in plan.buffers] == ["float16", "float64", "float32", "int32"]
    assert indices(plan) == [[4], [3], [2, 0], [1]]


def test_plan_by_size_places_members_at_their_offsets():
    plan = plan_by_size([((2, 3), "float64"), ((), "float64"), ((0,), "float64"), ((4,), "float64")], 0)
    (buffer,) = plan.buffers
    assert [(m.index, m.shape, m.offset, m.size) for m in buffer.members] == [
        (3, (4,), 0, 4), (2, (0,), 4, 0), (1, (), 4, 1), (0, (2, 3), 5, 6)]
    assert buffer.chunks == ((0, 11),)
    assert buffer.nbytes == 88


def test_plan_by_size_of_empty_values_makes_no_call_but_keeps_every_value():
    plan = plan_by_size([((0,), "float32"), ((3, 0), "float32")], 16)
    assert indices(plan) == [[1, 0]]
    assert plan.buffers[0].chunks == ()
    assert plan.num_calls == 0


@pytest.mark.parametrize("limit", [0, 1, 1 << 20])
def test_plan_by_size_of_nothing_is_an_empty_plan(limit):
    plan = plan_by_size([], limit)
    assert plan.buffers == () and plan.num_calls == 0


@pytest.mark.parametrize("specs", [[], [((4,), "float32")]])
def test_plan_by_size_rejects_negative_bytes_per_pack(specs):
    with pytest.raises(ValueError, match="bytes_per_pack must be non-negative"):
        plan_by_size(specs, -1)


@PROPERTY
@given(spec_lists, st.integers(0, 300))
def test_plan_by_size_properties(specs, limit):
    plan = plan_by_size(specs, limit)
    assert_layout(plan, specs)
    assert plan == plan_by_size([(list(s), np.dtype(d)) for s, d in specs], limit)  # every replica agrees
    groups = buffers_by_dtype(plan)
    assert list(groups) == first_appearance(d for _, d in reversed(specs))
    for dtype, buffers in groups.items():
        members = [m.index for b in buffers for m in b.members]
        assert members == [i for i in reversed(range(len(specs))) if np.dtype(specs[i][1]).name == dtype]
        if limit == 0:
            assert len(buffers) == 1
        for buffer in buffers[:-1]:
            assert buffer.nbytes > limit
        for buffer in buffers:
            assert sum(nbytes(specs[m.index]) for m in buffer.members[:-1]) <= limit or limit == 0
            assert buffer.chunks == (((0, buffer.size),) if buffer.size else ())


# plan_concat_split: NcclAllReduce(num_packs)


def test_plan_concat_split_cuts_ten_elements_in_three():
    plan = plan_concat_split([((4,), "float32"), ((6,), "float32")], 3)
    (buffer,) = plan.buffers
    assert [m.index for m in buffer.members] == [0, 1]
    assert buffer.chunks == ((0, 3), (3, 6), (6, 10))
    assert [stop - start for start, stop in buffer.chunks] == [3, 3, 4]  # cuts ignore value boundaries
    assert plan.num_calls == 3


def test_plan_concat_split_one_pack_is_one_call():
    plan = plan_concat_split([((4,), "float32"), ((6,), "float32")], 1)
    assert indices(plan) == [[0, 1]]
    assert plan.buffers[0].chunks == ((0, 10),)
    assert plan.num_calls == 1


def test_plan_concat_split_zero_packs_is_one_call_per_value():
    plan = plan_concat_split([((4,), "float32"), ((6,), "float32"), ((), "int32")], 0)
    assert indices(plan) == [[0], [1], [2]]
    assert [b.chunks for b in plan.buffers] == [((0, 4),), ((0, 6),), ((0, 1),)]
    assert plan.num_calls == 3


def test_plan_concat_split_keeps_order_and_groups_by_dtype():
    specs = [((2,), "float32"), ((3,), "int32"), ((4,), "float32"), ((1,), "float64"), ((5,), "int32")]
    plan = plan_concat_split(specs, 1)
    assert [b.dtype for b in plan.buffers] == ["float32", "int32", "float64"]
    assert indices(plan) == [[0, 2], [1, 4], [3]]
    assert [m.offset for m in plan.buffers[1].members] == [0, 3]


def test_plan_concat_split_more_packs_than_elements_makes_no_empty_call():
    plan = plan_concat_split([((2,), "float32")], 5)
    assert plan.buffers[0].chunks == ((0, 2),)


def test_plan_concat_split_of_empty_values_makes_no_call_but_keeps_every_value():
    plan = plan_concat_split([((0,), "int32"), ((), "int32"), ((0, 4), "int32")], 3)
    (buffer,) = plan.buffers
    assert [(m.index, m.offset, m.size) for m in buffer.members] == [(0, 0, 0), (1, 0, 1), (2, 1, 0)]
    assert buffer.chunks == ((0, 1),)
    assert plan_concat_split([((0,), "int32")], 0).num_calls == 0


@pytest.mark.parametrize("num_packs", [0, 1, 4])
def test_plan_concat_split_of_nothing_is_an_empty_plan(num_packs):
    plan = plan_concat_split([], num_packs)
    assert plan.buffers == () and plan.num_calls == 0


@pytest.mark.parametrize("specs", [[], [((4,), "float32")]])
def test_plan_concat_split_rejects_negative_num_packs(specs):
    with pytest.raises(ValueError, match="num_packs must be non-negative"):
        plan_concat_split(specs, -1)


@PROPERTY
@given(spec_lists, st.integers(1, 6))
def test_plan_concat_split_properties(specs, num_packs):
    plan = plan_concat_split(specs, num_packs)
    assert_layout(plan, specs)
    assert plan == plan_concat_split([(list(s), np.dtype(d)) for s, d in specs], num_packs)
    assert [b.dtype for b in plan.buffers] == first_appearance(d for _, d in specs)  # one buffer per dtype
    for buffer in plan.buffers:
        assert [m.index for m in buffer.members] == sorted(m.index for m in buffer.members)
        step = buffer.size // num_packs
        if step == 0:  # fewer elements than packs: one call, or none for an empty buffer
            assert buffer.chunks == (((0, buffer.size),) if buffer.size else ())
        else:
            lengths = [stop - start for start, stop in buffer.chunks]
            assert lengths == [step] * (num_packs - 1) + [buffer.size - step * (num_packs - 1)]


@PROPERTY
@given(spec_lists)
def test_plan_concat_split_without_packs_properties(specs):
    plan = plan_concat_split(specs, 0)
    assert_layout(plan, specs)
    assert indices(plan) == [[i] for i in range(len(specs))]
    assert plan.num_calls == sum(1 for shape, _ in specs if math.prod(shape) > 0)


# all_reduce_plan: how the packs move


@pytest.mark.parametrize("num_devices, roots", [
    (1, ((0, 0), (0, 0), (0, 0))),
    (2, ((0, 1), (1, 0), (0, 1))),
    (4, ((0, 2), (1, 3), (2, 0))),
    (5, ((0, 2), (1, 3), (2, 0), (3, 1), (4, 0), (0, 4))),
])
def test_hierarchical_roots_sum_each_chunk_in_both_halves_and_spread_over_the_devices(num_devices, roots):
    assert hierarchical_roots(len(roots), num_devices) == roots
    for m0, m1 in roots:
        if num_devices > 1:  # m0 and m1 lie in different halves
            assert (m0 < num_devices // 2) != (m1 < num_devices // 2)


def test_a_hierarchical_plan_names_the_summing_devices_of_every_chunk_across_buffers():
    packing = plan_concat_split([((4,), "float32"), ((6,), "int32"), ((2,), "float32")], 2)
    plan = all_reduce_plan(packing, HIERARCHICAL, mean=True, num_devices=4)
    assert plan.packing is packing and plan.mean and plan.num_devices == 4
    assert len(plan.roots) == packing.num_calls == 4
    assert plan.roots == hierarchical_roots(4, 4)


@pytest.mark.parametrize("method", [NATIVE, RING])
def test_other_plans_carry_no_roots(method):
    plan = all_reduce_plan(plan_concat_split([((3,), "float32")], 1), method, mean=False, num_devices=3)
    assert plan.method == method and plan.roots == ()


def test_an_unknown_method_or_no_devices_is_a_value_error():
    packing = plan_concat_split([((3,), "float32")], 1)
    with pytest.raises(ValueError, match="^method must be one of"):
        all_reduce_plan(packing, "tree", mean=False, num_devices=2)
    with pytest.raises(ValueError, match="^num_devices must be at least 1. Received: 0"):
        all_reduce_plan(packing, NATIVE, mean=False, num_devices=0)
