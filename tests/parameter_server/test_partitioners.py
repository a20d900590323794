"""Partitioners and div placement against hand-computed tables, TensorFlow's own examples among them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

from distrib.experimental.partitioners import FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner
from distrib.parameter_server.partitioners import div_offsets, locate_rows


@pytest.mark.parametrize("num_shards, shape, expected", [
    (2, [10, 3], [2, 1]), (3, [10], [3]), (8, [5], [5]), (1, [7, 2, 2], [1, 1, 1]), (4, [0, 3], [1, 1])])
def test_fixed_shards_partitioner_caps_at_the_row_count(num_shards, shape, expected):
    assert FixedShardsPartitioner(num_shards)(shape, np.float32) == expected


@pytest.mark.parametrize("min_bytes, max_shards, shape, dtype, expected", [
    (4, 2, [6, 1], np.float32, [2, 1]),        # TensorFlow's examples
    (4, 10, [6, 1], np.float32, [6, 1]),
    (256 << 10, 1, [1000, 1000], np.float32, [1, 1]),  # the default max_shards is 1
    (256 << 10, 8, [1000, 1000], np.float32, [8, 1]),  # 4 MB: ceil(4e6 / 262144) = 16, capped at 8
    (256 << 10, 8, [1000, 100], np.float32, [2, 1]),   # 400 kB: ceil(400000 / 262144) = 2
    (100, 10, [10, 10], np.float64, [8, 1]),           # 800 bytes: 8 shards of >= 100
    (16, 10, [3], np.str_, [3]),                       # strings count bytes_per_string each
    (1, 4, [0, 5], np.float32, [1, 1]),                # no rows: one shard
])
def test_min_size_partitioner(min_bytes, max_shards, shape, dtype, expected):
    assert MinSizePartitioner(min_bytes, max_shards)(shape, dtype) == expected


@pytest.mark.parametrize("max_bytes, max_shards, shape, expected", [
    (4, None, [6, 1], [6, 1]), (4, 2, [6, 1], [2, 1]), (1024, None, [6, 1], [1, 1]),  # TensorFlow's examples
    (40, None, [10, 3], [4, 1]),      # 12-byte rows, 3 per shard: ceil(10 / 3) = 4
    (1, None, [5, 4], [5, 1]),        # rows larger than the limit still get one per shard
    (8, None, [4, 0], [1, 1]),        # empty rows: one shard
])
def test_max_size_partitioner(max_bytes, max_shards, shape, expected):
    assert MaxSizePartitioner(max_bytes, max_shards)(shape, np.float32) == expected


def test_strings_count_bytes_per_string():
    assert MaxSizePartitioner(max_shard_bytes=32, bytes_per_string=8)([8, 2], np.object_) == [4, 1]
    assert MinSizePartitioner(min_shard_bytes=32, max_shards=99, bytes_per_string=8)([8, 2], np.object_) == [4, 1]


@pytest.mark.parametrize("make, message", [
    (lambda: FixedShardsPartitioner(0), "num_shards must be at least 1. Received: 0"),
    (lambda: MinSizePartitioner(min_shard_bytes=0), "min_shard_bytes must be at least 1"),
    (lambda: MinSizePartitioner(max_shards=0), "max_shards must be at least 1"),
    (lambda: MinSizePartitioner(bytes_per_string=-1), "bytes_per_string must be at least 1"),
    (lambda: MaxSizePartitioner(0), "max_shard_bytes must be at least 1"),
    (lambda: MaxSizePartitioner(4, max_shards=0), "max_shards must be at least 1"),
])
def test_arguments_below_one_are_rejected(make, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        make()


def test_wrong_kinds_and_shapes_are_rejected():
    with pytest.raises(TypeError, match="^num_shards must be an integer"):
        FixedShardsPartitioner(2.5)
    with pytest.raises(ValueError, match="^A partitioner splits a variable along an axis; a scalar has none"):
        FixedShardsPartitioner(2)([], np.float32)
    with pytest.raises(TypeError, match="^A partitioner needs a fully defined shape"):
        FixedShardsPartitioner(2)([None, 3], np.float32)
    with pytest.raises(ValueError, match="^axis must index the shape"):
        FixedShardsPartitioner(2)([4, 3], np.float32, axis=2)


def test_div_placement_of_13_rows_over_5_shards():
    offsets = div_offsets(13, 5)
    assert [list(range(a, b)) for a, b in zip(offsets, offsets[1:])] == \
        [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10], [11, 12]]
    assert np.diff(div_offsets(10, 4)).tolist() == [3, 3, 2, 2]
    assert div_offsets(3, 5) == [0, 1, 2, 3]  # never an empty shard


@given(rows=st.integers(1, 200), parts=st.integers(1, 20), data=st.data())
def test_row_location_matches_the_div_formula(rows, parts, data):
    offsets = div_offsets(rows, parts)
    n = len(offsets) - 1
    base, extra = divmod(rows, n)
    ids = np.asarray(data.draw(st.lists(st.integers(0, rows - 1), max_size=20)), dtype=np.int64)
    shard, local = locate_rows(ids, offsets)
    for i, p, k in zip(ids.tolist(), shard.tolist(), local.tolist()):
        assert p == (max(i // (base + 1), (i - extra) // base) if base else i // (base + 1))
        assert k == (i % (base + 1) if p < extra else (i - extra) % base)
        assert offsets[p] + k == i


def test_row_ids_out_of_range_are_rejected_with_their_positions():
    with pytest.raises(ValueError, match=r"^Row ids must lie in \[0, 13\). Received: \[13, -1\] \(at positions "
                                         r"\[1, 3\]\)"):
        locate_rows([0, 13, 2, -1], div_offsets(13, 5))
    with pytest.raises(TypeError, match="^Row ids must be integers"):
        locate_rows([0.5], div_offsets(13, 5))
