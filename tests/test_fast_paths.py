"""The structure fast paths must stay on: regressions here cost hundreds of microseconds per step, silently."""

import numpy as np

from distrib import values
from distrib.plan import plan_concat_split


def test_numpy_arrays_and_distributed_values_take_the_flat_fast_path():
    for cls in (np.ndarray, np.float32, np.int64, values.PerReplica, values.Mirrored):
        assert cls in values.LEAF_TYPES, cls


def test_fast_flatten_agrees_with_optree():
    import optree

    for structure in ([np.zeros(2), np.ones(3)], (np.float32(1), 2.0, "x"), [], (), {"y": np.zeros(1), "x": 1.0},
                      {"b": 1, "a": 2, "c": 3}, {}):
        leaves, spec = values.flatten(structure)
        want_leaves, want_spec = optree.tree_flatten(structure, namespace="distrib")
        assert spec == want_spec
        assert all(a is b for a, b in zip(leaves, want_leaves)) and len(leaves) == len(want_leaves)
        assert type(values.unflatten(spec, leaves)) is type(structure)


def test_structures_whose_keys_change_every_step_keep_the_spec_caches_bounded():
    for step in range(3 * values._SPECS_KEPT):
        leaves, spec = values.flatten({f"loss_{step}": np.float32(step), "lr": 0.1})
        assert values.unflatten(spec, leaves) == {f"loss_{step}": step, "lr": 0.1}
        assert values.flatten([np.float32(0)] * (step + 1))[1].num_leaves == step + 1
    assert len(values._DICT_SPECS) <= values._SPECS_KEPT and len(values._FLAT_SPECS) <= values._SPECS_KEPT


def test_buffer_size_is_computed_once():
    buffer = plan_concat_split([((3,), "float32"), ((5,), "float32")], 1).buffers[0]
    assert buffer.size == 8
    assert "size" in vars(buffer)  # cached on the instance
