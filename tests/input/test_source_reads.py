"""How distributed input reads its source: buffers a loader refills, epochs started early, the source's end, the
context its code runs in, and the one element_spec of a dataset."""

from __future__ import annotations

import threading
import time
import weakref

import numpy as np
import pytest

import distrib
from distrib import InputOptions, InputReplicationMode

pytestmark = pytest.mark.timeout(30)

ROWS = np.arange(96, dtype=np.float32).reshape(48, 2)


@pytest.fixture(scope="module")
def strategy():
    return distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])


def ahead(dataset):
    """`dataset`, its iterators reading ahead on a thread from the first step (as after slow training steps)."""
    dataset._pace["ahead"] = True
    return dataset


def rows_of(strategy, step, key=None):
    parts = strategy.experimental_local_results(step if key is None else step[key])
    return np.concatenate(parts)


class OneBufferLoader:
    """Yields ROWS `rows` at a time through one buffer it refills, held as `container` describes."""

    def __init__(self, container="bare", rows=8):
        self.container, self.rows = container, rows

    def __iter__(self):
        buffer = np.empty((self.rows, 2), np.float32)
        kept = {"bare": buffer, "dict": {"x": buffer}, "tuple": (buffer,), "nested": {"x": {"y": buffer}},
                "inner dict kept": {"x": buffer}}[self.container]
        del buffer  # held through the container only, as a loader that keeps its batch object holds it
        for start in range(0, len(ROWS), self.rows):
            LEAF[self.container](kept)[:] = ROWS[start:start + self.rows]
            yield {"outer": kept} if self.container == "inner dict kept" else kept


LEAF = {"bare": lambda s: s, "dict": lambda s: s["x"], "tuple": lambda s: s[0], "nested": lambda s: s["x"]["y"],
        "inner dict kept": lambda s: s["x"]}


@pytest.mark.parametrize("container", list(LEAF))
def test_a_loader_that_refills_a_buffer_it_keeps_in_any_container_gives_every_row_once(strategy, container):
    # before: the same dict or tuple yielded every step hid the loader's hold on the buffer; read ahead, rows of
    # one step were overwritten by the next ones (32 of 200 steps wrong)
    dataset = ahead(strategy.experimental_distribute_dataset(OneBufferLoader(container)))
    seen = []
    for step in dataset:
        time.sleep(0.002)  # a training step: the thread reads ahead meanwhile
        leaf = step["outer"]["x"] if container == "inner dict kept" else LEAF[container](step)
        seen.append(np.concatenate(strategy.experimental_local_results(leaf)))
    np.testing.assert_array_equal(np.concatenate(seen), ROWS)


@pytest.mark.parametrize("options", [None, InputOptions(experimental_per_replica_buffer_size=0)])
@pytest.mark.parametrize("container", ["bare", "dict"])
def test_batches_kept_past_the_next_step_of_a_loader_that_refills_one_buffer_keep_their_rows(strategy, container,
                                                                                              options):
    # before: read inline (no prefetch thread: the first steps, or buffer size 0), each replica's batch was a view
    # of the loader's buffer, so every kept batch read as the last one, where TensorFlow copies into tensors; and
    # whether it did depended on how long the steps took
    kept = list(strategy.experimental_distribute_dataset(OneBufferLoader(container), options))
    np.testing.assert_array_equal(np.concatenate([rows_of(strategy, LEAF[container](step)) for step in kept]), ROWS)
    per_worker = list(strategy.distribute_datasets_from_function(lambda ctx: OneBufferLoader(container, rows=2),
                                                                 options))
    firsts = [[part[0, 0] for part in strategy.experimental_local_results(LEAF[container](step))]
              for step in per_worker[:2]]
    assert firsts == [[0, 4, 8], [12, 16, 20]]


def test_a_fresh_array_in_a_fresh_dict_read_ahead_is_not_copied(strategy):
    # the copy is only for what someone else may write: a gather yielded in a new dict is the batch itself
    yielded = []

    def noted(array):  # a weak reference: a strong one would be someone else's hold, and make a copy
        yielded.append(weakref.ref(array))
        return array

    def fresh():
        for start in range(0, len(ROWS), 6):
            yield {"x": noted(ROWS[np.arange(start, start + 6)])}

    steps = list(ahead(strategy.experimental_distribute_dataset(fresh())))
    assert len(steps) == 8
    for step, ref in zip(steps, yielded):
        assert all(part.base is ref() for part in strategy.experimental_local_results(step["x"]))


def test_pipelines_from_a_function_that_refill_one_buffer_give_each_replica_its_own_batch(strategy):
    # before: with one pipeline per worker, a step read every replica's element before splitting any: each
    # replica got the last one read
    dataset = strategy.distribute_datasets_from_function(lambda ctx: OneBufferLoader("bare", rows=2))
    steps = [[r[:, 0].tolist() for r in strategy.experimental_local_results(step)] for step in dataset]
    assert steps[:2] == [[[0, 2], [4, 6], [8, 10]], [[12, 14], [16, 18], [20, 22]]]
    assert len(steps) == 8


class Restarting:
    """A loader that starts over in `__iter__` (one index, reset there) and counts its reads."""

    def __init__(self, count=40, rewind_at_end=False, read_seconds=0.0005):
        self.count, self.rewind_at_end, self.read_seconds, self.index, self.reads = \
            count, rewind_at_end, read_seconds, 0, 0

    def __iter__(self):
        self.index = 0
        return self

    def __next__(self):
        self.reads += 1
        if self.index >= self.count:
            if self.rewind_at_end:  # a loader that rewinds itself once it has said it ended
                self.index = 0
            raise StopIteration
        time.sleep(self.read_seconds)
        self.index += 1
        return np.full(3, self.index - 1, np.float32)


def firsts(strategy, iterable, sleep=0.0, limit=None):
    out = []
    for step in iterable:
        out.append(int(strategy.experimental_local_results(step)[0][0]))
        time.sleep(sleep)
        if limit is not None and len(out) == limit:
            break
    return out


def test_an_epoch_left_early_leaves_the_next_epoch_all_of_its_batches(strategy):
    # before: the abandoned iterator's thread, still inside the loader's __next__, took the new epoch's first batch
    loader = Restarting(read_seconds=0.004)  # slower than the consumer: the thread is inside __next__ at the break
    dataset = strategy.experimental_distribute_dataset(loader)
    for _ in range(3):
        assert firsts(strategy, dataset, sleep=0.0005, limit=20) == list(range(20))
        assert firsts(strategy, dataset) == list(range(40))


def test_an_earlier_iterator_still_in_use_goes_on_inline_beside_a_new_one(strategy):
    dataset = ahead(strategy.experimental_distribute_dataset([np.full(3, i, np.float32) for i in range(30)]))
    old = iter(dataset)
    assert firsts(strategy, old, sleep=0.002, limit=10) == list(range(10))
    readers = [t for t in threading.enumerate() if t.name == "distrib-input-prefetch"]
    assert readers
    new = iter(dataset)  # stops the old one's thread, and waits for it
    assert not any(t.is_alive() for t in readers)
    assert firsts(strategy, old) == list(range(10, 30))
    assert firsts(strategy, new) == list(range(30))


@pytest.mark.parametrize("read_ahead", [False, True])
def test_the_source_is_not_read_past_its_end(strategy, read_ahead):
    # before: the thread kept calling next() after StopIteration; a loader that rewinds there lost batches
    loader = Restarting(count=20, rewind_at_end=True)
    dataset = strategy.experimental_distribute_dataset(loader)
    if read_ahead:
        ahead(dataset)
    for _ in range(3):
        loader.reads = 0
        assert firsts(strategy, dataset, sleep=0.001) == list(range(20))
        assert loader.reads == 21


def test_pipelines_from_a_function_are_not_read_past_their_end(strategy):
    # before: with 5 elements and 3 replicas, the replica after the end read the rewound pipeline: no end at all
    loader = Restarting(count=5, rewind_at_end=True)
    dataset = strategy.distribute_datasets_from_function(lambda ctx: loader)
    steps = [[r.tolist() for r in strategy.experimental_local_results(step)] for step in dataset]
    assert [[r[0] if r else None for r in step] for step in steps] == [[0, 1, 2], [3, 4, None]]


def test_a_buffer_size_of_zero_never_reads_ahead(strategy):
    options = InputOptions(experimental_per_replica_buffer_size=0)
    dataset = strategy.experimental_distribute_dataset([np.full(3, i, np.float32) for i in range(30)], options)
    before = set(threading.enumerate())
    assert firsts(strategy, dataset, sleep=0.002) == list(range(30))
    assert firsts(strategy, dataset, sleep=0.002) == list(range(30))
    assert [t for t in set(threading.enumerate()) - before if t.name == "distrib-input-prefetch"] == []


def test_the_source_runs_in_the_strategy_scope_of_the_iteration_inline_and_read_ahead(strategy):
    # before: the first steps, read inline, saw the strategy; the thread that took over saw the default one
    seen = []

    def source():
        for i in range(30):
            seen.append(distrib.get_strategy() is strategy)
            yield np.full(3, i, np.float32)

    with strategy.scope():
        assert firsts(strategy, strategy.experimental_distribute_dataset(source()), sleep=0.002) == list(range(30))
    assert seen == [True] * 30


def test_an_element_of_another_dtype_is_refused_naming_the_path(strategy):
    data = [{"x": np.zeros(3, np.float32)}, {"x": np.zeros(3, np.float64)}]
    with pytest.raises(TypeError, match=r"must have the dtypes of the first \(its element_spec\)\. Received: float64 "
                                        r"at path \['x'\], where the first element had float32"):
        list(strategy.experimental_distribute_dataset(data))


def test_replicas_pipelines_of_different_dtypes_are_refused(strategy):
    options = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)

    def dataset_fn(ctx):
        return [np.zeros(2, np.int64 if ctx.input_pipeline_id == 1 else np.float32)]

    with pytest.raises(TypeError, match="must have the dtypes of the first"):
        list(strategy.distribute_datasets_from_function(dataset_fn, options))


def test_byte_swapped_batches_reach_the_replicas_in_native_byte_order(strategy):
    # before: each replica's batch kept the element's '>f4', where a TensorFlow tensor holds native values
    data = [{"x": (np.arange(6, dtype=np.float32) + 6 * i).astype(">f4")} for i in range(2)]
    steps = list(strategy.experimental_distribute_dataset(data))
    for i, step in enumerate(steps):
        parts = strategy.experimental_local_results(step["x"])
        assert all(part.dtype == np.float32 and part.dtype.isnative for part in parts)
        assert np.concatenate(parts).tolist() == list(range(6 * i, 6 * i + 6))
