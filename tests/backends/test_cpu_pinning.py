"""A kept result of a collective keeps only itself alive, not the pooled pack it was reduced in."""

from __future__ import annotations

import numpy as np
import pytest

import distrib

pytestmark = pytest.mark.timeout(30)


def memory_held(array: np.ndarray) -> int:
    """The bytes `array` keeps alive: its own, or its base's when it is a view."""
    return array.nbytes if array.base is None else memory_held(array.base)


def test_a_kept_loss_does_not_pin_the_gradients_pack_it_was_reduced_in():
    grads = np.ones(64_000, np.float32)  # 256 KB: the pack comes from the buffer pool

    def step():
        out = distrib.get_replica_context().all_reduce("SUM", {"loss": np.float32(1), "grads": grads})
        return out["loss"]

    with distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"]) as strategy:
        kept = [strategy.experimental_local_results(strategy.run(step)) for _ in range(20)]
    for losses in kept:
        assert [float(x) for x in losses] == [4.0] * 4
        assert all(memory_held(x) <= 1024 for x in losses)
        assert not any(x.flags.writeable for x in losses)  # results stay read-only, like tensors


def test_large_members_stay_views_of_the_reduced_pack():
    def step():
        out = distrib.get_replica_context().all_reduce("SUM", [np.ones(64_000, np.float32)] * 2)
        return out[0]

    with distrib.MirroredStrategy(["CPU:0", "CPU:1"]) as strategy:
        first, second = strategy.experimental_local_results(strategy.run(step))
    assert np.shares_memory(first, second)  # one buffer shared by the emulated devices, not copied
    np.testing.assert_array_equal(first, np.full(64_000, 2, np.float32))
