"""Distributed input: splitting global batches, structures, epochs, iterators, pipelines per replica, prefetch."""

from __future__ import annotations

import collections
import collections.abc
import gc
import itertools
import threading
import time

import numpy as np
import pytest

import distrib
from distrib import AutoShardPolicy, InputOptions, InputReplicationMode, PerReplica
from distrib.backends import get_backend
from distrib.input import ArraySpec, DistributedDataset, DistributedDatasetsFromFunction, InputWorkers, split_bounds
from support import DLPackOnly

pytestmark = pytest.mark.timeout(30)

Example = collections.namedtuple("Example", "features label")


@pytest.fixture(scope="module")
def strategy():
    return distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])


def steps(strategy, dataset, options=None):
    """Every step of one epoch, as one tuple of per-replica values per step."""
    dist = strategy.experimental_distribute_dataset(dataset, options)
    return [strategy.experimental_local_results(batch) for batch in dist]


def sizes(step):
    return [len(x) for x in step]


def train_on(iterator, num_steps):
    """Takes `num_steps` steps, each followed by a short "training step", and returns the prefetch threads started."""
    before = set(threading.enumerate())
    for _ in range(num_steps):
        next(iterator)
        time.sleep(0.002)
    return [t for t in set(threading.enumerate()) - before if t.name == "distrib-input-prefetch"]


def assert_stops(threads, timeout=2.0):
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive()


# -- splitting a global batch along axis 0 ---------------------------------------------------------------------


@pytest.mark.parametrize("rows, slices, expected", [
    (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
    (7, 4, [(0, 2), (2, 4), (4, 6), (6, 7)]),
    (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)]),
    (6, 4, [(0, 2), (2, 4), (4, 6), (6, 6)]),
    (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),
    (0, 3, [(0, 0), (0, 0), (0, 0)]),
    (5, 1, [(0, 5)]),
])
def test_split_bounds_cuts_slices_of_ceil_rows_over_n(rows, slices, expected):
    assert list(split_bounds(rows, slices)) == expected


@pytest.mark.parametrize("rows, expected", [(8, [2, 2, 2, 2]), (7, [2, 2, 2, 1]), (5, [2, 2, 1, 0]),
                                            (6, [2, 2, 2, 0])])
def test_a_global_batch_is_split_into_consecutive_slices_of_ceil_b_over_n(strategy, rows, expected):
    (step,) = steps(strategy, [np.arange(rows, dtype=np.float32)])
    assert sizes(step) == expected
    np.testing.assert_array_equal(np.concatenate(step), np.arange(rows))


def test_a_batch_smaller_than_the_replica_count_gives_the_last_replicas_empty_batches(strategy):
    batch = np.arange(6, dtype=np.int16).reshape(2, 3)
    (step,) = steps(strategy, [batch])
    np.testing.assert_array_equal(step[0], [[0, 1, 2]])
    np.testing.assert_array_equal(step[1], [[3, 4, 5]])
    for empty in step[2:]:
        assert empty.shape == (0, 3) and empty.dtype == np.int16


def test_each_global_batch_is_split_on_its_own(strategy):
    data = np.arange(12, dtype=np.float32)
    epoch = steps(strategy, [data[0:6], data[6:12]])
    assert [sizes(step) for step in epoch] == [[2, 2, 2, 0], [2, 2, 2, 0]]  # nothing carries over between batches


def test_a_short_last_batch_leaves_trailing_replicas_empty_and_then_the_epoch_ends(strategy):
    data = np.arange(9 * 2, dtype=np.float64).reshape(9, 2)
    epoch = steps(strategy, [data[0:8], data[8:9]])
    assert [sizes(step) for step in epoch] == [[2, 2, 2, 2], [1, 0, 0, 0]]
    assert all(x.shape[1:] == (2,) and x.dtype == np.float64 for x in epoch[1])


def test_one_replica_gets_every_global_batch_whole():
    strategy = distrib.MirroredStrategy(["CPU:0"])
    data = np.arange(5, dtype=np.float32)
    epoch = steps(strategy, [data[:3], data[3:]])
    assert [sizes(step) for step in epoch] == [[3], [2]]
    np.testing.assert_array_equal(epoch[1][0], [3, 4])


@pytest.mark.parametrize("make", [distrib.get_strategy, lambda: distrib.MirroredStrategy(["CPU:0"])],
                         ids=["default", "mirrored-one-device"])
@pytest.mark.parametrize("from_function", [False, True])
def test_one_replica_in_one_process_gets_plain_arrays_that_run_and_local_results_take(make, from_function):
    # TensorFlow wraps steps in PerReplica only with several devices or workers (input_lib's _always_wrap)
    strategy, data = make(), {"x": np.arange(4, dtype=np.float32)}
    dist = strategy.distribute_datasets_from_function(lambda ctx: [data]) if from_function else \
        strategy.experimental_distribute_dataset([data])
    (batch,) = list(dist)
    assert type(batch) is dict and type(batch["x"]) is np.ndarray
    np.testing.assert_array_equal(batch["x"] * 2, [0, 2, 4, 6])
    np.testing.assert_array_equal(strategy.run(lambda b: b["x"] + 1, args=(batch,)), [1, 2, 3, 4])
    np.testing.assert_array_equal(strategy.experimental_local_results(batch)[0]["x"], data["x"])
    assert float(strategy.reduce("SUM", batch["x"], axis=0)) == 6.0


def test_two_workers_of_one_replica_each_still_get_per_replica_values():
    one = InputWorkers(get_backend("cpu"), ("CPU:0",), num_workers=2, worker_index=0)
    (batch,) = list(DistributedDataset([np.arange(4)], one))
    assert isinstance(batch, PerReplica)


# -- nested structures -----------------------------------------------------------------------------------------


def test_every_leaf_of_a_dict_is_split_the_same_way(strategy):
    batch = {"x": np.arange(14, dtype=np.float32).reshape(7, 2), "y": np.arange(7, dtype=np.int64)}
    (step,) = steps(strategy, [batch])
    assert [set(replica) for replica in step] == [{"x", "y"}] * 4
    assert [len(replica["x"]) for replica in step] == [len(replica["y"]) for replica in step] == [2, 2, 2, 1]
    for replica in step:
        np.testing.assert_array_equal(replica["x"][:, 0] // 2, replica["y"])  # rows stay paired


def test_each_step_keeps_the_structure_with_per_replica_leaves(strategy):
    batch = (Example(features={"a": np.zeros((4, 3)), "b": [np.ones(4), np.ones((4, 2))]}, label=np.arange(4)),)
    (out,) = strategy.experimental_distribute_dataset([batch])
    assert isinstance(out, tuple) and isinstance(out[0], Example)
    assert isinstance(out[0].features["b"], list) and len(out[0].features["b"]) == 2
    for leaf in (out[0].features["a"], out[0].features["b"][0], out[0].features["b"][1], out[0].label):
        assert isinstance(leaf, PerReplica) and len(leaf.values) == 4


def test_local_results_of_a_step_are_one_structure_per_replica(strategy):
    batch = Example(features=[np.arange(8), np.arange(8) * 10], label=np.arange(8) % 2)
    (step,) = steps(strategy, [batch])
    assert all(isinstance(replica, Example) for replica in step)
    replica_2 = step[2]
    np.testing.assert_array_equal(replica_2.features[0], [4, 5])
    np.testing.assert_array_equal(replica_2.features[1], [40, 50])
    np.testing.assert_array_equal(replica_2.label, [0, 1])


def test_a_step_can_be_passed_to_run_and_each_replica_sees_its_slice(strategy):
    batch = {"x": np.arange(7, dtype=np.float32), "w": np.ones(7, np.float32)}
    (dist_batch,) = strategy.experimental_distribute_dataset([batch])

    def step_fn(inputs):
        replica = distrib.get_replica_context().replica_id_in_sync_group
        return replica, inputs["x"] * inputs["w"]

    replicas, rows = strategy.run(step_fn, args=(dist_batch,))
    assert strategy.experimental_local_results(replicas) == (0, 1, 2, 3)
    assert [list(x) for x in strategy.experimental_local_results(rows)] == [[0, 1], [2, 3], [4, 5], [6]]
    assert float(strategy.reduce("SUM", rows, axis=0)) == 21.0


# -- epochs: re-iterables and one-shot generators --------------------------------------------------------------


def test_a_list_gives_the_same_data_every_epoch(strategy):
    dist = strategy.experimental_distribute_dataset([np.arange(4), np.arange(4, 8)])
    epochs = [[np.concatenate(strategy.experimental_local_results(b)).tolist() for b in dist] for _ in range(3)]
    assert epochs == [[[0, 1, 2, 3], [4, 5, 6, 7]]] * 3


def test_an_object_whose_iter_starts_over_gives_the_same_data_every_epoch(strategy):
    class Batches:
        def __init__(self):
            self.epochs = 0

        def __iter__(self):
            self.epochs += 1
            return (np.arange(i, i + 4) for i in range(0, 12, 4))

    source = Batches()
    dist = strategy.experimental_distribute_dataset(source)
    first, second = [[np.concatenate(strategy.experimental_local_results(b)) for b in dist] for _ in range(2)]
    assert source.epochs == 2
    np.testing.assert_array_equal(np.concatenate(first), np.arange(12))
    np.testing.assert_array_equal(np.concatenate(second), np.arange(12))


def test_a_generator_object_works_for_one_epoch_and_refuses_a_second(strategy):
    dist = strategy.experimental_distribute_dataset(np.arange(i, i + 4) for i in range(0, 8, 4))
    assert len(list(dist)) == 2
    with pytest.raises(ValueError, match="The dataset is a one-shot iterator"):
        iter(dist)


class RestartingLoader:
    """A hand-written loader that is its own iterator and starts over in __iter__."""

    def __init__(self, data, size):
        self.data, self.size, self.start = data, size, 0

    def __iter__(self):
        self.start = 0
        return self

    def __next__(self):
        if self.start >= len(self.data):
            raise StopIteration
        self.start += self.size
        return self.data[self.start - self.size:self.start]


def test_a_loader_that_returns_itself_and_starts_over_in_iter_gives_every_epoch(strategy):
    dist = strategy.experimental_distribute_dataset(RestartingLoader(np.arange(8), 4))
    epochs = [[np.concatenate(strategy.experimental_local_results(b)).tolist() for b in dist] for _ in range(2)]
    assert epochs == [[[0, 1, 2, 3], [4, 5, 6, 7]]] * 2


@pytest.mark.parametrize("one_shot", [
    lambda batches: iter(batches), lambda batches: map(np.asarray, batches),
    lambda batches: type("Batches", (collections.abc.Iterator,), {"__next__": lambda self: next(self.rest),
                                                                    "rest": iter(batches)})()],
    ids=["list-iterator", "map", "abc-iterator"])
def test_built_in_and_inherited_one_shot_iterators_refuse_a_second_epoch(strategy, one_shot):
    dist = strategy.experimental_distribute_dataset(one_shot([np.arange(4), np.arange(4, 8)]))
    assert len(list(dist)) == 2
    with pytest.raises(ValueError, match="The dataset is a one-shot iterator"):
        iter(dist)


def test_iterators_of_one_dataset_are_independent(strategy):
    dist = strategy.experimental_distribute_dataset([np.full(4, i) for i in range(3)])
    a, b = iter(dist), iter(dist)

    def first_row(iterator):
        return int(strategy.experimental_local_results(next(iterator))[0][0])

    assert [first_row(a), first_row(a)] == [0, 1]
    assert [first_row(b), first_row(a), first_row(b)] == [0, 2, 1]


# -- DistributedIterator ---------------------------------------------------------------------------------------


def test_next_and_get_next_step_through_the_same_sequence(strategy):
    iterator = iter(strategy.experimental_distribute_dataset([np.full(4, i) for i in range(3)]))
    values = [next(iterator), iterator.get_next(), next(iterator)]
    assert [int(strategy.experimental_local_results(v)[3][0]) for v in values] == [0, 1, 2]


def test_the_end_raises_out_of_range_from_get_next_and_stop_iteration_from_next_again_and_again(strategy):
    iterator = iter(strategy.experimental_distribute_dataset([np.zeros(4)]))
    iterator.get_next()
    for _ in range(3):  # TensorFlow's get_next raises OutOfRangeError, which no loop mistakes for its end
        with pytest.raises(distrib.errors.OutOfRangeError, match="End of sequence"):
            iterator.get_next()
        with pytest.raises(StopIteration):
            next(iterator)
    iterator = iter(strategy.experimental_distribute_dataset([np.zeros(4)]))
    with pytest.raises(distrib.errors.OutOfRangeError):  # not a silently shorter list
        list(map(lambda _: iterator.get_next(), range(2)))


def test_get_next_as_optional_is_empty_at_the_end(strategy):
    iterator = iter(strategy.experimental_distribute_dataset([np.arange(4.0), np.arange(4.0, 7.0)]))
    optionals = [iterator.get_next_as_optional() for _ in range(4)]
    assert [o.has_value() for o in optionals] == [True, True, False, False]
    last = strategy.experimental_local_results(optionals[1].get_value())
    assert sizes(last) == [1, 1, 1, 0]
    with pytest.raises(ValueError, match="The optional has no value"):
        optionals[2].get_value()
    # the iterator's element_spec, with a value or without, as TensorFlow's Optional has (it had none)
    assert all(o.element_spec == iterator.element_spec for o in optionals)


def test_element_spec_is_the_structure_with_an_unknown_batch_dimension(strategy):
    batch = {"image": np.zeros((8, 2, 3), np.float32), "label": np.zeros(8, np.int32)}
    dist = strategy.experimental_distribute_dataset([batch])
    with pytest.raises(ValueError, match="element_spec is known once the first batch has been read"):
        dist.element_spec
    iterator = iter(dist)
    next(iterator)
    expected = {"image": ArraySpec((None, 2, 3), np.dtype(np.float32)),
                "label": ArraySpec((None,), np.dtype(np.int32))}
    assert iterator.element_spec == dist.element_spec == expected


def test_close_stops_the_iterator(strategy):
    iterator = iter(strategy.experimental_distribute_dataset(np.zeros(4) for _ in itertools.count()))
    started = train_on(iterator, 12)
    assert len(started) == 1  # a consumer busy between steps gets its input prepared in the background
    iterator.close()
    assert_stops(started)
    with pytest.raises(StopIteration):  # whatever was prepared before close may still come, then the end
        for _ in range(20):
            next(iterator)


# -- inputs from other libraries -------------------------------------------------------------------------------


class ArrayInterfaceOnly:
    """An array-like that only knows `__array__`."""

    def __init__(self, rows):
        self._rows = rows

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self._rows, dtype=dtype)


def test_leaves_with_dlpack_are_accepted(strategy):
    assert not hasattr(DLPackOnly(np.zeros(1)), "__array__")
    batch = {"x": DLPackOnly(np.arange(6, dtype=np.float32)), "y": np.arange(6)}
    (step,) = steps(strategy, [batch])
    assert all(isinstance(replica["x"], np.ndarray) for replica in step)
    assert [replica["x"].tolist() for replica in step] == [[0, 1], [2, 3], [4, 5], []]
    assert step[3]["x"].dtype == np.float32


def test_leaves_with_only_array_interface_are_accepted(strategy):
    (step,) = steps(strategy, [(ArrayInterfaceOnly([[1, 2], [3, 4], [5, 6]]),)])
    assert [replica[0].tolist() for replica in step] == [[[1, 2]], [[3, 4]], [[5, 6]], []]
    assert step[3][0].shape == (0, 2)


def test_a_python_list_of_numbers_is_a_structure_not_an_array(strategy):
    dist = strategy.experimental_distribute_dataset([{"x": [1.0, 2.0, 3.0, 4.0]}])
    with pytest.raises(ValueError, match=r"Every leaf of a dataset element needs a leading batch dimension .*"
                                         r"a scalar at path \['x'\]\[0\]"):
        next(iter(dist))


# -- bad input -------------------------------------------------------------------------------------------------


def first_step(strategy, batch):
    return next(iter(strategy.experimental_distribute_dataset([batch])))


def test_leaves_with_different_batch_sizes_name_both_paths(strategy):
    batch = {"a": np.zeros(4), "b": [np.zeros(4), np.zeros(5)]}
    with pytest.raises(ValueError, match=r"Every leaf of a dataset element must have the same batch size. "
                                         r"Received: path \['b'\]\[1\] has 5 rows, path \['a'\] has 4"):
        first_step(strategy, batch)


@pytest.mark.parametrize("scalar", [np.float32(1), np.array(2.0), 3])
def test_a_scalar_leaf_has_no_batch_dimension_to_split(strategy, scalar):
    with pytest.raises(ValueError, match=r"Every leaf of a dataset element needs a leading batch dimension .*"
                                         r"path \['y'\]"):
        first_step(strategy, {"x": np.zeros(4), "y": scalar})


@pytest.mark.parametrize("leaf, message", [
    (np.array(["a", "b", "c", "d"]), r"Every leaf of a dataset element must be a numeric array. Received: dtype <U1"),
    (np.array([object()] * 4), r"Every leaf of a dataset element must be a numeric array. Received: dtype object"),
    ("text", r"Every leaf of a dataset element must be an array. Received: str at path \['s'\]"),
])
def test_a_non_numeric_leaf_is_a_type_error(strategy, leaf, message):
    with pytest.raises(TypeError, match=message):
        first_step(strategy, {"x": np.zeros(4), "s": leaf})


@pytest.mark.parametrize("element", [{}, (), None])
def test_an_element_without_arrays_is_refused(strategy, element):
    with pytest.raises(ValueError, match="A dataset element must hold at least one array"):
        first_step(strategy, element)


def test_a_dataset_must_be_iterable(strategy):
    with pytest.raises(TypeError, match="The dataset must be iterable"):
        strategy.experimental_distribute_dataset(42)


def test_an_error_in_the_users_generator_arrives_at_its_step_then_the_iterator_ends(strategy):
    failure = KeyError("corrupt record 3")

    def records():
        yield np.zeros(4)
        yield np.ones(4)
        raise failure

    iterator = iter(strategy.experimental_distribute_dataset(records()))
    assert [float(strategy.experimental_local_results(next(iterator))[0][0]) for _ in range(2)] == [0.0, 1.0]
    with pytest.raises(KeyError) as raised:
        next(iterator)
    assert raised.value is failure
    with pytest.raises(StopIteration):
        next(iterator)


def test_an_error_raised_while_prefetching_in_the_background_arrives_at_its_step(strategy):
    failure = OSError("disk gone")

    def records():
        yield from (np.full(4, i) for i in range(16))
        raise failure

    iterator = iter(strategy.experimental_distribute_dataset(records()))
    assert len(train_on(iterator, 12)) == 1
    assert [int(strategy.experimental_local_results(next(iterator))[0][0]) for _ in range(4)] == [12, 13, 14, 15]
    with pytest.raises(OSError) as raised:
        next(iterator)
    assert raised.value is failure
    with pytest.raises(StopIteration):
        next(iterator)


def test_an_invalid_batch_raises_at_its_own_step(strategy):
    iterator = iter(strategy.experimental_distribute_dataset([np.zeros(4), np.float32(1), np.zeros(4)]))
    next(iterator)
    with pytest.raises(ValueError, match="Every leaf of a dataset element needs a leading batch dimension"):
        next(iterator)


# -- distribute_datasets_from_function ------------------------------------------------------------------------


def test_per_worker_mode_calls_dataset_fn_once_with_one_pipeline(strategy):
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return [np.zeros(2)]

    strategy.distribute_datasets_from_function(dataset_fn)
    assert [(c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync) for c in contexts] == [(1, 0, 4)]


def test_per_replica_mode_calls_dataset_fn_once_per_replica(strategy):
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return [np.full(2, 10 * ctx.input_pipeline_id + step) for step in range(2)]

    options = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    dist = strategy.distribute_datasets_from_function(dataset_fn, options)
    assert [(c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync) for c in contexts] == [
        (4, 0, 4), (4, 1, 4), (4, 2, 4), (4, 3, 4)]
    epoch = [[int(x[0]) for x in strategy.experimental_local_results(batch)] for batch in dist]
    assert epoch == [[0, 10, 20, 30], [1, 11, 21, 31]]  # replica r reads pipeline r


def test_replicas_take_consecutive_elements_of_the_pipeline(strategy):
    dist = strategy.distribute_datasets_from_function(lambda ctx: [np.full(3, i) for i in range(8)])
    epoch = [[int(x[0]) for x in strategy.experimental_local_results(batch)] for batch in dist]
    assert epoch == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_when_the_pipeline_runs_out_mid_step_the_other_replicas_get_empty_batches(strategy):
    elements = [np.full((2, 3), i, np.float32) for i in range(5)] + [np.full((1, 3), 5, np.float32)]
    dist = strategy.distribute_datasets_from_function(lambda ctx: elements)
    iterator = iter(dist)
    next(iterator)
    last = strategy.experimental_local_results(next(iterator))
    assert [x.shape for x in last] == [(2, 3), (1, 3), (0, 3), (0, 3)]
    assert all(x.dtype == np.float32 for x in last)
    with pytest.raises(StopIteration):
        next(iterator)


def test_get_per_replica_batch_size_needs_a_divisible_global_batch(strategy):
    def dataset_fn(ctx):
        return [np.zeros(ctx.get_per_replica_batch_size(6))]

    with pytest.raises(ValueError, match=r"The global batch size \(6\) must be divisible by the number of replicas "
                                         r"in sync \(4\)"):
        strategy.distribute_datasets_from_function(dataset_fn)
    assert distrib.InputContext(1, 0, 4).get_per_replica_batch_size(8) == 2
    with pytest.raises(TypeError, match="The global batch size must be an int. Received: '8'"):
        distrib.InputContext(1, 0, 4).get_per_replica_batch_size("8")  # before: a str formatting error


def test_per_replica_mode_is_only_for_datasets_from_function(strategy):
    options = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    with pytest.raises(NotImplementedError, match="InputReplicationMode.PER_REPLICA is only supported by "
                                                  "distribute_datasets_from_function"):
        strategy.experimental_distribute_dataset([np.zeros(4)], options)


# -- InputOptions and the prefetch thread ----------------------------------------------------------------------


def test_fetch_to_device_false_gives_host_numpy_arrays(strategy):
    data = np.arange(8, dtype=np.float32)
    epoch = steps(strategy, [data], InputOptions(experimental_fetch_to_device=False))
    assert all(type(x) is np.ndarray for x in epoch[0])
    np.testing.assert_array_equal(np.concatenate(epoch[0]), data)


def test_the_buffer_size_does_not_change_the_data(strategy):
    data = [{"x": np.arange(i, i + 5, dtype=np.float32)} for i in range(0, 50, 5)]

    def epoch(buffer_size):
        options = InputOptions(experimental_per_replica_buffer_size=buffer_size)
        return [[replica["x"].tolist() for replica in step] for step in steps(strategy, data, options)]

    assert epoch(1) == epoch(4)
    assert len(epoch(1)) == 10


def test_steps_keep_their_order_when_the_background_thread_takes_over(strategy):
    dist = strategy.experimental_distribute_dataset([np.full(4, i) for i in range(40)])
    iterator = iter(dist)
    firsts = []
    for _ in range(40):  # the first steps are read inline, the rest by the thread once the consumer looks busy
        firsts.append(int(strategy.experimental_local_results(next(iterator))[0][0]))
        time.sleep(0.001)
    assert firsts == list(range(40))
    second_epoch = [int(strategy.experimental_local_results(b)[0][0]) for b in dist]  # starts ahead at once
    assert second_epoch == list(range(40))


def test_prefetching_reads_a_bounded_number_of_batches_ahead(strategy):
    read = []

    def endless():
        for i in itertools.count():
            read.append(i)
            yield np.zeros(4)

    iterator = iter(strategy.experimental_distribute_dataset(endless()))
    started = train_on(iterator, 12)
    time.sleep(0.2)
    assert len(started) == 1 and 12 <= len(read) <= 12 + 16
    iterator.close()


@pytest.mark.parametrize("element", ["bare", "dict"])
def test_a_loader_that_refills_one_buffer_gives_every_row_once_while_prefetch_reads_ahead(strategy, element):
    # before: read ahead, the loader refilled the buffer under batches not used yet (rows lost, others twice)
    rows = np.arange(80, dtype=np.float32).reshape(40, 2)

    class Loader:
        def __iter__(self):
            buffer = np.empty((8, 2), np.float32)
            for start in range(0, 40, 8):
                buffer[:] = rows[start:start + 8]
                yield buffer if element == "bare" else {"x": buffer}

    dataset = strategy.experimental_distribute_dataset(Loader())
    for epoch in range(3):  # the pace is remembered: later epochs read ahead from their first step
        seen = []
        for batch in dataset:
            time.sleep(0.002)  # a training step: the prefetch thread runs ahead meanwhile
            parts = strategy.experimental_local_results(batch if element == "bare" else batch["x"])
            seen.append(np.concatenate(parts))
        np.testing.assert_array_equal(np.concatenate(seen), rows, err_msg=f"epoch {epoch}")


def test_the_prefetch_thread_exits_when_the_data_ends(strategy):
    iterator = iter(strategy.experimental_distribute_dataset([np.zeros(4)] * 30))
    started = train_on(iterator, 12)
    assert len(started) == 1
    assert len(list(iterator)) == 30 - 12
    assert_stops(started)


def test_the_prefetch_thread_exits_when_the_iterator_is_dropped(strategy):
    iterator = iter(strategy.experimental_distribute_dataset(np.zeros(4) for _ in itertools.count()))
    started = train_on(iterator, 12)
    assert len(started) == 1
    del iterator
    gc.collect()
    assert_stops(started)


# -- multi-worker hooks ----------------------------------------------------------------------------------------


def workers(index, num_workers=2, any_worker_has_data=None, **extra):
    """Input worker `index` of `num_workers`, each with two local replicas."""
    if any_worker_has_data is not None:
        extra["any_worker_has_data"] = any_worker_has_data
    return InputWorkers(get_backend("cpu"), ("CPU:0", "CPU:1"), num_workers=num_workers, worker_index=index, **extra)


def local_steps(dataset):
    """Each step's per-replica components, as lists."""
    return [[x.tolist() for x in batch.values] for batch in dataset]


def test_by_data_each_worker_keeps_its_replicas_slices_of_every_global_batch():
    batches = [np.arange(8), np.arange(8, 15)]
    worker_0 = local_steps(DistributedDataset(batches, workers(0)))
    worker_1 = local_steps(DistributedDataset(batches, workers(1)))
    assert worker_0 == [[[0, 1], [2, 3]], [[8, 9], [10, 11]]]
    assert worker_1 == [[[4, 5], [6, 7]], [[12, 13], [14]]]
    for step, batch in enumerate(batches):
        np.testing.assert_array_equal(sum(worker_0[step] + worker_1[step], []), batch)


class ShardableBatches:
    """A dataset of files that shards by file: shard i of n keeps every n-th file."""

    def __init__(self, files):
        self.files = files

    def __iter__(self):
        return iter(self.files)

    def shard(self, num_shards, index):
        return ShardableBatches(self.files[index::num_shards])


def test_by_file_a_dataset_with_shard_is_sharded_and_each_worker_rebatches_its_shard():
    # TensorFlow rebatches every batch into num_replicas_in_sync pieces before sharding (by file here), and each
    # worker's replicas take the next pieces each step: a step holds one global batch's worth of rows in all
    files = [np.arange(4 * i, 4 * i + 4) for i in range(4)]
    worker_0 = local_steps(DistributedDataset(ShardableBatches(files), workers(0)))
    worker_1 = local_steps(DistributedDataset(ShardableBatches(files), workers(1)))
    assert worker_0 == [[[0], [1]], [[2], [3]], [[8], [9]], [[10], [11]]]
    assert worker_1 == [[[4], [5]], [[6], [7]], [[12], [13]], [[14], [15]]]


def test_with_auto_shard_off_each_worker_reads_every_batch_and_rebatches_it_over_all_replicas():
    off = InputOptions(auto_shard_policy=AutoShardPolicy.OFF)
    batches = [np.arange(7), np.arange(7, 9)]  # pieces of 2, 2, 2, 1 then 1, 1, 0, 0
    for index in (0, 1):
        assert local_steps(DistributedDataset(batches, workers(index), off)) == [
            [[0, 1], [2, 3]], [[4, 5], [6]], [[7], [8]], [[], []]]


def test_a_worker_whose_replicas_do_not_divide_the_pieces_takes_them_across_batches_and_ends_mid_step():
    # 3 replicas (1 on another worker): each batch of 6 rows gives 3 pieces of 2, this worker's 2 replicas take 2
    off = InputOptions(auto_shard_policy=AutoShardPolicy.OFF)
    batches = [np.arange(0, 6), np.arange(6, 12), np.arange(12, 18)]
    assert local_steps(DistributedDataset(batches, workers(1, first_replica=1, all_replicas=3), off)) == [
        [[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]], [[12, 13], [14, 15]], [[16, 17], []]]


class RefilledBuffer:
    """A loader that refills one buffer for every batch."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        buffer = np.empty_like(self.batches[0])
        for batch in self.batches:
            buffer[...] = batch
            yield buffer


def test_pieces_left_for_the_next_step_survive_a_loader_that_refills_its_buffer():
    off = InputOptions(auto_shard_policy=AutoShardPolicy.OFF)
    dataset = DistributedDataset(RefilledBuffer([np.arange(0, 6), np.arange(6, 12)]),
                                 workers(1, first_replica=1, all_replicas=3), off)
    assert local_steps(dataset) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]


def test_batches_of_another_structure_are_refused_before_their_pieces_meet_in_one_step():
    off = InputOptions(auto_shard_policy=AutoShardPolicy.OFF)
    dataset = DistributedDataset([{"x": np.arange(6)}, {"y": np.arange(6)}],
                                 workers(1, first_replica=1, all_replicas=3), off)
    with pytest.raises(ValueError, match=r"must have the structure of the first \(its element_spec\)\. "
                                         r"Received: PyTreeSpec\(\{'y': \*\}\), the first was"):
        list(dataset)


def test_a_single_worker_ignores_the_shard_method():
    files = ShardableBatches([np.full(4, i) for i in range(2)])
    assert local_steps(DistributedDataset(files, workers(0, num_workers=1))) == [[[0, 0], [0, 0]],
                                                                                 [[1, 1], [1, 1]]]


@pytest.mark.parametrize("policy", list(AutoShardPolicy))
def test_a_single_worker_splits_each_batch_over_its_replicas_whatever_the_policy(policy):
    if policy is AutoShardPolicy.FILE:
        dataset = ShardableBatches([np.arange(7), np.arange(7, 12)])
    else:
        dataset = [np.arange(7), np.arange(7, 12)]
    assert local_steps(DistributedDataset(dataset, workers(0, num_workers=1),
                                          InputOptions(auto_shard_policy=policy))) == [
        [[0, 1, 2, 3], [4, 5, 6]], [[7, 8, 9], [10, 11]]]


def other_worker(*votes):
    """`any_worker_has_data` beside another worker that casts `votes` in order: whether it has data at each step,
    and after the first step's, whether it has seen no element yet."""
    theirs = iter(votes)
    return lambda local: next(theirs) or local


def test_a_worker_out_of_data_gets_empty_batches_until_every_worker_is_out():
    files = [np.full((4, 3), i, np.float32) for i in range(3)]  # worker 0 reads files 0 and 2, worker 1 file 1
    # each file of 4 rows is rebatched into 4 pieces of 1, 2 a step: worker 0 takes 4 steps, worker 1 2
    dataset = DistributedDataset(ShardableBatches(files),
                                 workers(1, any_worker_has_data=other_worker(True, False, True, True, True, False)))
    epoch = [[x.shape for x in batch.values] for batch in dataset]
    assert epoch == [[(1, 3), (1, 3)], [(1, 3), (1, 3)], [(0, 3), (0, 3)], [(0, 3), (0, 3)]]


def test_a_pipeline_out_of_data_gets_empty_batches_until_every_worker_is_out():
    mine = [np.ones((2, 3), np.float32)] * 2
    dataset = DistributedDatasetsFromFunction(
        lambda ctx: mine, workers(0, any_worker_has_data=other_worker(True, False, True, False)))
    epoch = [[x.shape for x in batch.values] for batch in dataset]
    assert epoch == [[(2, 3), (2, 3)], [(0, 3), (0, 3)]]


@pytest.mark.parametrize("from_function", [False, True])
def test_a_worker_with_no_element_from_the_start_and_the_others_all_raise_at_the_first_step(from_function):
    # without an element, that worker cannot shape empty batches; raising alone, it left the others waiting for it
    # in their next collective
    def dataset(batches, worker):
        return DistributedDatasetsFromFunction(lambda ctx: batches, worker) if from_function else \
            DistributedDataset(batches, worker)

    start = "A worker's pipelines produced no element" if from_function else "A worker's shard of the dataset is empty"
    empty = dataset([], workers(1, any_worker_has_data=other_worker(True, False)))
    with pytest.raises(ValueError, match=f"^{start}.*Received: no element on this worker \\(index 1 of 2\\)"):
        next(iter(empty))
    full = dataset([np.zeros(4)], workers(0, any_worker_has_data=other_worker(False, True)))
    with pytest.raises(ValueError, match=f"^{start}.*Received: no element on another worker before its first step"):
        next(iter(full))


def test_only_the_first_step_asks_whether_a_worker_has_seen_no_element():
    votes = []
    dataset = DistributedDataset([np.zeros(4)] * 3, workers(0, any_worker_has_data=lambda local: votes.append(local)
                                                            or local))
    assert len(list(dataset)) == 3
    assert votes == [True, False, True, True, False]  # data and "none seen" at the first step, then data only


# -- context ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("api, call", [
    ("experimental_distribute_dataset", lambda s: s.experimental_distribute_dataset([np.zeros(4)])),
    ("distribute_datasets_from_function", lambda s: s.distribute_datasets_from_function(lambda ctx: [np.zeros(1)])),
])
def test_input_apis_refuse_a_replica_context(strategy, api, call):
    with pytest.raises(RuntimeError, match=f"{api} must be called in a cross-replica context"):
        strategy.run(lambda: call(strategy))


@pytest.mark.parametrize("dataset", [np.arange(12.0).reshape(3, 4), {"x": np.zeros((4, 2))}], ids=["array", "dict"])
def test_a_single_array_or_dict_is_not_a_dataset(strategy, dataset):
    with pytest.raises(TypeError, match="The dataset must be an iterable of batches, not a single"):
        strategy.experimental_distribute_dataset(dataset)


def test_a_python_list_of_numbers_gets_a_hint_to_use_an_array(strategy):
    with pytest.raises(ValueError, match=r"needs a leading batch dimension.*use np.asarray"):
        next(iter(strategy.experimental_distribute_dataset([{"x": [1.0, 2.0, 3.0, 4.0]}])))


@pytest.mark.parametrize("from_function", [False, True])
def test_end_of_input_checks_follow_the_steps_taken_not_the_steps_produced_ahead(from_function):
    # each check is a collective across the workers: one made ahead by a process's prefetch thread, for a step
    # never taken, would leave the processes' checks out of step for every later iterator
    checks = []

    def any_worker_has_data(local):
        checks.append(local)
        return local

    batches, worker = [np.arange(4)] * 50, workers(0, any_worker_has_data=any_worker_has_data)
    dataset = DistributedDatasetsFromFunction(lambda ctx: batches, worker) if from_function else \
        DistributedDataset(batches, worker)
    dataset._pace["ahead"] = True  # a thread produces ahead from the first step, as after slow training steps
    iterator = iter(dataset)
    for _ in range(3):
        next(iterator)
    deadline = time.monotonic() + 5
    while len(iterator._prefetcher._items) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # the thread has produced steps ahead
    assert len(iterator._prefetcher._items) >= 2
    assert checks == [True, False, True, True]  # the first step also asks whether a worker has seen no element
    iterator.close()


def test_one_long_pause_of_the_consumer_does_not_start_the_prefetch_thread_for_good():
    # a loop that only reads input splits inline; a garbage collection or a core taken away for a few
    # milliseconds must not switch a dataset to the thread (and its handoffs) for all its epochs
    from distrib.input.prefetch import Prefetcher

    pace: dict = {}
    prefetcher = Prefetcher(lambda: 0, depth=4, pace=pace)
    quick, pause = 3e-6, 5e-3
    assert not any(prefetcher._consumer_is_busy(quick) for _ in range(8))
    assert not prefetcher._consumer_is_busy(pause)
    assert not any(prefetcher._consumer_is_busy(quick) for _ in range(50))
    busy = [prefetcher._consumer_is_busy(pause) for _ in range(20)]  # a training step between every two steps
    assert busy[-1] and busy.index(True) < 10
    prefetcher.close()


def test_input_context_fields_are_read_only_as_in_tensorflow(strategy):
    seen = []

    def dataset_fn(ctx):
        for name in ("num_input_pipelines", "input_pipeline_id", "num_replicas_in_sync"):
            with pytest.raises(AttributeError):
                setattr(ctx, name, 7)
        seen.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
        return [np.zeros(4)]

    strategy.distribute_datasets_from_function(dataset_fn)
    assert seen == [(1, 0, 4)]
