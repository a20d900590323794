"""DistributedValues, and TensorFlow's regroup / select_replica rules between per-replica and nested values."""

from __future__ import annotations

import collections
import weakref

import numpy as np
import pytest

import distrib
from distrib import Mirrored, PerReplica
from distrib.values import regroup, select_replica

Point = collections.namedtuple("Point", "x y")


class StandInVariable(PerReplica):
    """Stands in for a MirroredVariable: a distributed value that select_replica and regroup keep whole."""

    __slots__ = ("__weakref__",)
    _is_distributed_variable = True


class Component(float):
    """Stands in for one component of a distributed variable: it knows its container through a weak reference."""


@pytest.fixture(scope="module")
def strategy():
    return distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])


# -- DistributedValues ----------------------------------------------------------------------------------------


def test_per_replica_holds_one_component_per_replica_as_a_tuple():
    value = PerReplica([np.float32(1), np.float32(2)])
    assert value.values == (1.0, 2.0)
    assert isinstance(value.values, tuple)
    assert len(value) == 2


def test_distributed_values_print_like_tensorflow():
    assert repr(PerReplica([1, 2])) == "PerReplica:{\n  0: 1,\n  1: 2\n}"
    assert repr(Mirrored(["a"])) == "Mirrored:{\n  0: 'a'\n}"


def test_distributed_values_need_a_component():
    with pytest.raises(ValueError, match="PerReplica needs at least one component"):
        PerReplica([])


def test_mirrored_converts_to_its_primary_component_cross_replica():
    mirrored = Mirrored([np.array([1.0, 2.0]), np.array([3.0, 4.0])])
    np.testing.assert_array_equal(np.asarray(mirrored), [1.0, 2.0])


def test_mirrored_converts_to_the_current_replicas_component_inside_run(strategy):
    mirrored = Mirrored([np.float32(r * 10) for r in range(4)])
    out = strategy.run(lambda: np.asarray(mirrored) + 0)
    assert [float(x) for x in strategy.experimental_local_results(out)] == [0.0, 10.0, 20.0, 30.0]


# -- select_replica -------------------------------------------------------------------------------------------


def test_select_replica_picks_each_distributed_leaf_and_keeps_the_rest():
    shared = np.ones(2)
    per_replica = PerReplica(["a0", "a1"])
    mirrored = Mirrored(["m0", "m1"])
    structure = {"x": per_replica, "y": [mirrored, shared], "z": Point(per_replica, None)}
    picked = select_replica(1, structure)
    assert picked == {"x": "a1", "y": ["m1", shared], "z": Point("a1", None)}
    assert picked["y"][1] is shared
    assert type(picked["z"]) is Point


def test_select_replica_of_a_plain_value_returns_it():
    value = np.arange(3)
    assert select_replica(2, value) is value


def test_select_replica_keeps_distributed_variables_whole():
    variable = StandInVariable([1.0, 2.0])
    assert select_replica(1, [variable])[0] is variable


def test_run_passes_each_replica_its_component_and_shares_the_rest(strategy):
    per_replica = PerReplica([10, 11, 12, 13])
    shared = object()

    def step(x, y, *, z):
        return x, y is shared, z

    xs, same, zs = strategy.run(step, args=(per_replica, shared), kwargs={"z": per_replica})
    assert strategy.experimental_local_results(xs) == (10, 11, 12, 13)
    assert same is True  # the same object from every replica comes back unwrapped
    assert strategy.experimental_local_results(zs) == (10, 11, 12, 13)


# -- regroup --------------------------------------------------------------------------------------------------


def test_regroup_wraps_values_that_differ_per_replica():
    out = regroup([np.float32(1), np.float32(2)])
    assert type(out) is PerReplica
    assert out.values == (1.0, 2.0)


def test_regroup_unwraps_the_same_object_on_every_replica():
    shared = object()
    assert regroup([shared, shared, shared]) is shared


def test_regroup_wraps_equal_but_distinct_objects():
    out = regroup([np.float32(1), np.float32(1)])
    assert isinstance(out, PerReplica)


def test_regroup_always_wrap_wraps_the_same_object_too():
    shared = object()
    out = regroup([shared, shared], always_wrap=True)
    assert type(out) is PerReplica and out.values == (shared, shared)


def test_regroup_wrap_class_mirrored():
    out = regroup([(1.0,), (2.0,)], wrap_class=Mirrored)
    assert type(out) is tuple and type(out[0]) is Mirrored


def test_regroup_keeps_the_container_types_of_replica_0():
    ordered = [collections.OrderedDict([("z", r), ("a", [r, Point(r, None)])]) for r in (1000, 1001)]
    out = regroup(ordered)
    assert type(out) is collections.OrderedDict and list(out) == ["z", "a"]
    assert type(out["a"]) is list and type(out["a"][1]) is Point
    assert out["a"][1].y is None
    assert out["z"].values == (1000, 1001)


def test_regroup_matches_dict_entries_by_key_not_by_order():
    out = regroup([{"b": 1.5, "a": "same"}, {"a": "same", "b": 2.5}])
    assert out["a"] == "same"
    assert out["b"].values == (1.5, 2.5)


def test_regroup_keeps_empty_containers_and_none():
    assert regroup([[], []]) == []
    assert regroup([{"a": None, "b": ()}, {"a": None, "b": ()}]) == {"a": None, "b": ()}


def test_regroup_then_select_replica_round_trips():
    per_replica = [{"w": np.full(2, r), "b": [r * 1.5]} for r in range(3)]
    grouped = regroup(per_replica)
    for r in range(3):
        picked = select_replica(r, grouped)
        np.testing.assert_array_equal(picked["w"], per_replica[r]["w"])
        assert picked["b"] == per_replica[r]["b"]


def test_regroup_returns_the_same_distributed_variable_even_with_always_wrap():
    variable = StandInVariable([1.0, 2.0])
    assert regroup([variable, variable]) is variable
    assert regroup([variable, variable], always_wrap=True) is variable


def test_regroup_turns_the_components_of_a_distributed_variable_back_into_it():
    components = [Component(1.0), Component(2.0)]
    variable = StandInVariable(components)
    for component in components:
        component._distributed_container = weakref.ref(variable)
    assert regroup(components) is variable
    assert type(regroup(components[::-1])) is PerReplica  # not its components in replica order


@pytest.mark.parametrize("structures, message", [
    ([{"a": 1, "b": [2]}, {"a": 1}], r"replica 1, path \['b'\]\[0\] exists only on replica 0"),
    ([[1], [1, 2], [1]], r"replica 1, path \[1\] exists only on replica 1"),
    ([[1], [1], {"k": 1}], r"replica 2, path \[0\] exists only on replica 0"),
    ([{"a": 1, "b": [2]}, {"a": 1, "b": (2,)}], r"replica 1, path \['b'\] is a tuple on replica 1 but a list on "
                                                r"replica 0"),
    ([Point(1, 2), (1, 2)], r"replica 1, path <root> is a tuple on replica 1 but a Point on replica 0"),
    ([[None], [[]]], r"replica 1, path \[0\] is a list on replica 1 but None on replica 0"),
], ids=["missing", "extra", "other-keys", "list-vs-tuple", "namedtuple-vs-tuple", "none-vs-list"])
def test_regroup_names_the_replica_and_path_where_structures_differ(structures, message):
    with pytest.raises(ValueError, match=r"^Every replica must return the same structure\. Received: " + message):
        regroup(structures)


def test_none_on_some_replicas_is_a_component_as_in_tensorflow(strategy):
    # "Every replica must return the same structure": TensorFlow's nest has None a leaf, and gives
    # PerReplica(None, ...) for a replica that returns None where the others return an array
    def step():
        r = distrib.get_replica_context().replica_id_in_sync_group
        return {"loss": None if r == 0 else np.float32(r), "nothing": None}

    out = strategy.run(step)
    assert isinstance(out["loss"], PerReplica) and out["loss"].values == (None, 1.0, 2.0, 3.0)
    assert out["nothing"] is None  # None everywhere: the same object, unwrapped
    assert [x["loss"] for x in strategy.experimental_local_results(out)] == [None, 1.0, 2.0, 3.0]
    with pytest.raises(TypeError, match=r"^Expected an array of numbers\. Received: None\.$"):
        strategy.reduce("SUM", out["loss"], axis=None)
    # structures that differ by more than None still say where
    with pytest.raises(ValueError, match=r"path \[0\] is a list on replica 1 but None on replica 0"):
        regroup([[None], [[]]])


def test_values_from_a_function_wrap_none_as_tensorflow_does(strategy):
    # None was left unwrapped (TensorFlow: PerReplica of Nones), and None on one replica only was refused
    nothing = strategy.experimental_distribute_values_from_function(lambda ctx: None)
    assert isinstance(nothing, PerReplica) and nothing.values == (None,) * 4
    pair = strategy.experimental_distribute_values_from_function(lambda ctx: (None, np.float32(1)))
    assert [type(x) for x in pair] == [PerReplica, PerReplica] and pair[0].values == (None,) * 4
    some = strategy.experimental_distribute_values_from_function(
        lambda ctx: None if ctx.replica_id_in_sync_group == 2 else np.float32(1))
    assert some.values == (1.0, 1.0, None, 1.0)
    assert strategy.run(lambda x: x, args=(some,)).values == (1.0, 1.0, None, 1.0)
    assert strategy.experimental_distribute_values_from_function(lambda ctx: ()) == ()
    # structures that differ are the ValueError run's are, not a private exception type
    with pytest.raises(ValueError, match=r"path \['a'\] exists only on replica 0"):
        strategy.experimental_distribute_values_from_function(
            lambda ctx: {"a": 1} if ctx.replica_id_in_sync_group == 0 else {"b": 1})


def test_run_results_follow_the_regroup_rules(strategy):
    shared = object()

    def step():
        r = distrib.get_replica_context().replica_id_in_sync_group
        return {"id": r, "shared": shared, "constant": 7, "nothing": None}

    out = strategy.run(step)
    assert isinstance(out["id"], PerReplica) and out["id"].values == (0, 1, 2, 3)
    assert out["shared"] is shared
    assert out["constant"] == 7
    assert out["nothing"] is None


def test_a_mirrored_value_converts_to_a_python_number_as_the_tensor_tensorflow_returns_does():
    # reduce_to onto one device returns a Mirrored of one component where TensorFlow returns the tensor itself:
    # float() of it raised TypeError
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1))
    total = strategy.extended.reduce_to("SUM", value, "/cpu:0")
    assert float(total) == 3.0 and int(total) == 3
    everywhere = strategy.extended.reduce_to("MEAN", value, value)  # a Mirrored of two equal components
    assert float(everywhere) == 1.5
