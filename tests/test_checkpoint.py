"""Checkpoints: round trips of every kind of variable, across replica counts and into no strategy, optimizer slots,
metadata, damaged files, interrupted saves, and files that do not match the objects.

The saving rules are TensorFlow's (section 4 of semantics.md): a MirroredVariable saves its primary copy, a
SyncOnReadVariable its aggregate, and restoring a SyncOnRead SUM variable writes `value / n` to each copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy

import distrib
from distrib import Checkpoint, VariableAggregation
from distrib import checkpoint as checkpoint_module
from distrib.errors import CheckpointError, ContextError, DistribError

pytestmark = pytest.mark.timeout(30)

SUM, MEAN, FIRST = VariableAggregation.SUM, VariableAggregation.MEAN, VariableAggregation.ONLY_FIRST_REPLICA


def strategy_with(replicas: int):
    """A MirroredStrategy on `replicas` emulated CPUs; 0 means the default strategy (plain variables)."""
    return distrib.MirroredStrategy([f"CPU:{i}" for i in range(replicas)]) if replicas else distrib.get_strategy()


def variable(strategy, value, **kwargs):
    with strategy.scope():
        return distrib.Variable(value, **kwargs)


def sync_on_read(strategy, value, aggregation):
    return variable(strategy, value, synchronization="ON_READ", aggregation=aggregation)


def copies(var) -> list:
    """Each replica's copy (a plain variable is its only copy)."""
    return [c.numpy().tolist() for c in getattr(var, "values", (var,))]


@pytest.fixture
def path(tmp_path):
    return tmp_path / "model.ckpt"


# -- round trips ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [np.arange(6, dtype=np.float32).reshape(2, 3), np.float64(2.5), np.int64(-7),
                                   np.array([1, 2, 3], np.int32), np.array([True, False]), np.zeros((0, 4))],
                         ids=["float32-matrix", "float64-scalar", "int64-scalar", "int32", "bool", "empty"])
def test_plain_variable_round_trip(path, value):
    v = distrib.Variable(value, name="v")
    ckpt = Checkpoint(v=v)
    assert ckpt.save(path) == os.fspath(path)
    v.assign(np.zeros_like(value))
    ckpt.restore(path)
    np.testing.assert_array_equal(v.numpy(), value)
    assert v.dtype == np.asarray(value).dtype and v.shape == np.shape(value)


def test_mirrored_saves_the_primary_and_restores_every_copy(path):
    strategy = strategy_with(4)
    w = variable(strategy, np.array([1.0, 2.0], np.float32))
    w.values[2].assign(np.array([9.0, 9.0], np.float32))  # a stray copy: the primary is what counts
    Checkpoint(w=w).save(path)
    w.assign(np.zeros(2, np.float32))
    Checkpoint(w=w).restore(path)
    assert copies(w) == [[1.0, 2.0]] * 4


@pytest.mark.parametrize("aggregation, per_replica, saved", [
    (SUM, [1.0, 2.0, 3.0, 6.0], 12.0),
    (MEAN, [1.0, 2.0, 3.0, 6.0], 3.0),
    (FIRST, [5.0, 1.0, 1.0, 1.0], 5.0),
])
@pytest.mark.parametrize("restored_replicas", [4, 2, 1, 0])
def test_sync_on_read_saves_the_aggregate_and_restores_it_anywhere(path, aggregation, per_replica, saved,
                                                                    restored_replicas):
    metric = sync_on_read(strategy_with(4), np.float32(0), aggregation)
    for component, value in zip(metric.values, per_replica):
        component.assign(np.float32(value))
    Checkpoint(metric=metric).save(path)

    strategy = strategy_with(restored_replicas)
    restored = sync_on_read(strategy, np.float32(0), aggregation)
    Checkpoint(metric=restored).restore(path)
    assert float(restored.numpy()) == saved
    n = max(restored_replicas, 1)
    share = saved / n if aggregation is SUM and restored_replicas else saved
    assert copies(restored) == [share] * n


def test_integer_sum_truncates_over_replicas(path):
    """7 saved, restored over 2 replicas: each copy gets int(7 / 2) = 3, and the sum reads 6 (as in TensorFlow)."""
    count = sync_on_read(strategy_with(4), np.int32(0), SUM)
    for component, value in zip(count.values, [1, 2, 4, 0]):
        component.assign(np.int32(value))
    Checkpoint(count=count).save(path)

    on_two = sync_on_read(strategy_with(2), np.int32(0), SUM)
    Checkpoint(count=on_two).restore(path)
    assert copies(on_two) == [3, 3] and int(on_two.numpy()) == 6 and on_two.dtype == np.int32

    on_one = sync_on_read(strategy_with(1), np.int32(0), SUM)
    Checkpoint(count=on_one).restore(path)
    assert copies(on_one) == [7]


@pytest.mark.parametrize("saved_replicas, restored_replicas", [(4, 2), (4, 1), (2, 4), (1, 4), (4, 0), (0, 4)])
def test_restore_into_another_replica_count_or_no_strategy(path, saved_replicas, restored_replicas):
    def model(strategy):
        return {"w": variable(strategy, np.zeros((2, 2), np.float32), name="w"),
                "steps": variable(strategy, np.int64(0), aggregation=FIRST, name="steps"),
                "loss_sum": sync_on_read(strategy, np.float32(0), SUM)}

    saved = model(strategy_with(saved_replicas))
    saved["w"].assign(np.array([[1, 2], [3, 4]], np.float32))
    saved["steps"].assign(np.int64(41))
    saved["loss_sum"].assign(np.float32(8))
    Checkpoint(model=saved).save(path)

    strategy = strategy_with(restored_replicas)
    restored = model(strategy)
    with strategy.scope():  # inside or outside the scope: both are cross-replica
        Checkpoint(model=restored).restore(path)
    assert copies(restored["w"]) == [[[1, 2], [3, 4]]] * max(restored_replicas, 1)
    assert int(restored["steps"].numpy()) == 41
    assert float(restored["loss_sum"].numpy()) == 8.0


def test_nested_checkpoints_dicts_and_lists(path):
    layers = [distrib.Variable(np.full(2, i, np.float32)) for i in range(3)]  # the same default name: keyed by position
    bias = distrib.Variable(np.float32(5))
    ckpt = Checkpoint(model=Checkpoint(layers=layers, head={"bias": bias}, epoch=3), step=10)
    ckpt.save(path)
    for v in (*layers, bias):
        v.assign(np.zeros(v.shape, np.float32))
    model = Checkpoint(layers=layers, head={"bias": bias}, epoch=0)
    metadata = Checkpoint(model=model, step=0).restore(path)
    assert [v.numpy().tolist() for v in layers] == [[0, 0], [1, 1], [2, 2]] and float(bias.numpy()) == 5
    assert metadata == {"step": 10} and model.metadata == {"epoch": 3}


# -- optimizers -----------------------------------------------------------------------------------------------

def train_one_step(strategy, optimizer, w):
    grad = lambda: np.full(3, distrib.get_replica_context().replica_id_in_sync_group + 1, np.float32)  # noqa: E731
    strategy.run(lambda: optimizer.apply_gradients([(grad(), w)]))


@pytest.mark.parametrize("make", [lambda: distrib.optimizers.Adam(0.1),
                                  lambda: distrib.optimizers.SGD(0.1, momentum=0.9)], ids=["Adam", "SGD"])
def test_optimizer_iterations_and_slots_round_trip_across_replica_counts(path, make):
    strategy = strategy_with(4)
    with strategy.scope():
        w = distrib.Variable(np.ones(3, np.float32), name="w")
        optimizer = make()
    train_one_step(strategy, optimizer, w)
    train_one_step(strategy, optimizer, w)
    Checkpoint(w=w, optimizer=optimizer).save(path)
    saved = {v.name: v.numpy() for v in optimizer.variables()}

    strategy = strategy_with(2)
    with strategy.scope():
        w2 = distrib.Variable(np.zeros(3, np.float32), name="w")
        optimizer2 = make()
        optimizer2.build([w2])  # the slots exist before the restore
    Checkpoint(w=w2, optimizer=optimizer2).restore(path)
    np.testing.assert_array_equal(w2.numpy(), w.numpy())
    assert {v.name: v.numpy().tolist() for v in optimizer2.variables()} == {k: v.tolist() for k, v in saved.items()}
    assert sorted(saved) == sorted(["w/" + s for s in optimizer.slot_names] + [f"{optimizer.name}/iterations"])



def test_optimizer_slots_restored_before_the_optimizer_builds_them(path):
    strategy = strategy_with(2)
    with strategy.scope():
        w = distrib.Variable(np.ones(3, np.float32), name="w")
        optimizer = distrib.optimizers.Adam(0.1)
    train_one_step(strategy, optimizer, w)
    Checkpoint(w=w, optimizer=optimizer).save(path)

    with strategy.scope():
        fresh = distrib.optimizers.Adam(0.1)
    Checkpoint(w=w, optimizer=fresh).restore(path)  # no iterations, no slots yet: their values wait
    with strategy.scope():
        fresh.build([w])
        checkpoint_module.restore_deferred(fresh)  # what an optimizer calls once it has created its variables
    assert [v.numpy().tolist() for v in fresh.variables()] == [v.numpy().tolist() for v in optimizer.variables()]

def two_steps(make, names=("w",)):
    """`make()`'s optimizer after two steps of variables named `names`, under 2 replicas."""
    strategy = strategy_with(2)
    with strategy.scope():
        variables = [distrib.Variable(np.ones(2, np.float32), name=name) for name in names]
        optimizer = make()
    for _ in range(2):
        strategy.run(lambda: optimizer.apply_gradients([(np.ones(2, np.float32), v) for v in variables]))
    return strategy, variables, optimizer


@pytest.mark.parametrize("saved_with, restored_into, saved, never", [
    (lambda: distrib.optimizers.Adam(0.1), lambda: distrib.optimizers.SGD(0.1, momentum=0.9), "Adam 'Adam'",
     "['optimizer/Adam/iterations', 'optimizer/w/m', 'optimizer/w/v']"),
    (lambda: distrib.optimizers.SGD(0.1, momentum=0.9), lambda: distrib.optimizers.Adam(0.1), "SGD 'SGD'",
     "['optimizer/SGD/iterations', 'optimizer/w/momentum']"),
    (lambda: distrib.optimizers.SGD(0.1), lambda: distrib.optimizers.Adam(0.1), "SGD 'SGD'",
     "['optimizer/SGD/iterations']"),
    (lambda: distrib.optimizers.SGD(0.1, momentum=0.9, name="opt"), lambda: distrib.optimizers.SGD(0.1, name="opt"),
     "SGD 'opt'", "['optimizer/w/momentum']"),  # same kind and name, but no momentum slot
    (lambda: distrib.optimizers.Adam(0.1, name="opt"), lambda: distrib.optimizers.Adam(0.1), "Adam 'opt'",
     "['optimizer/opt/iterations']"),
], ids=["Adam-into-SGD", "SGD-into-Adam", "plain-SGD-into-Adam", "momentum-into-plain", "another-name"])
def test_state_the_optimizer_never_creates_is_refused_not_left_pending(path, saved_with, restored_into, saved,
                                                                        never):
    strategy, (w,), optimizer = two_steps(saved_with)
    Checkpoint(w=w, optimizer=optimizer).save(path)
    with strategy.scope():
        w2 = distrib.Variable(np.zeros(2, np.float32), name="w")
        fresh = restored_into()
    with pytest.raises(CheckpointError, match=re.escape(f"holds the state of {saved} at 'optimizer', which the "
                                                        f"Checkpoint's {type(fresh).__name__} {fresh.name!r} with "
                                                        f"slots {list(fresh.slot_names)} never creates: {never}.")):
        Checkpoint(w=w2, optimizer=fresh).restore(path)
    assert w2.numpy().tolist() == [0, 0]  # refused before anything is assigned

    Checkpoint(w=w2, optimizer=fresh).restore(path, allow_partial=True)  # the state it never creates is dropped
    assert w2.numpy().tolist() == w.numpy().tolist()
    strategy.run(lambda: fresh.apply_gradients([(np.ones(2, np.float32), w2)]))
    assert fresh not in checkpoint_module._DEFERRED  # nothing left waiting for a variable that never comes
    assert int(fresh.iterations.numpy()) == (1 if "iterations" in never else 3)


def test_slots_of_variables_that_share_a_name_are_still_restored_when_created(path):
    strategy, (a, b), optimizer = two_steps(lambda: distrib.optimizers.Adam(0.1), names=("w", "w"))
    Checkpoint(a=a, b=b, optimizer=optimizer).save(path)  # slots w/m, w/v, w/m_1, w/v_1
    with strategy.scope():
        fresh = distrib.optimizers.Adam(0.1)
    Checkpoint(a=a, b=b, optimizer=fresh).restore(path)
    with strategy.scope():
        fresh.build([a, b])  # creates the slots, which takes their saved values
    assert [v.numpy().tolist() for v in fresh.variables()] == [v.numpy().tolist() for v in optimizer.variables()]
    assert fresh not in checkpoint_module._DEFERRED


def test_a_file_that_does_not_record_the_optimizers_kind_is_still_refused(path):
    _, (w,), optimizer = two_steps(lambda: distrib.optimizers.Adam(0.1))
    Checkpoint(w=w, optimizer=optimizer).save(path)
    manifest, arrays = checkpoint_module.checkpoint_file.read(path)
    del manifest["owners"]  # as distrib wrote files before it recorded the kind
    checkpoint_module.checkpoint_file.write(path, arrays, manifest)
    with pytest.raises(CheckpointError, match=r"holds the state of an optimizer 'Adam' at 'optimizer', which the "
                                              r"Checkpoint's SGD 'SGD' with slots \[\] never creates"):
        Checkpoint(w=w, optimizer=distrib.optimizers.SGD(0.1)).restore(path)


class LazyOptimizer:
    """A stand-in optimizer that creates its slots on first use, and then takes their restored values."""

    def __init__(self):
        self.iterations = distrib.Variable(np.int64(0), name="iterations")
        self.slots = {}

    def variables(self):
        return [self.iterations, *self.slots.values()]

    def apply(self, grad, var):
        if var.name not in self.slots:
            self.slots[var.name] = distrib.Variable(np.zeros(var.shape, var.dtype), name=f"{var.name}/velocity")
            checkpoint_module.restore_deferred(self)
        velocity = self.slots[var.name]
        velocity.assign(0.5 * velocity.numpy() + grad)
        var.assign_sub(velocity)
        self.iterations.assign_add(1)


def test_slots_the_optimizer_has_not_created_yet_are_restored_when_it_creates_them(path):
    w = distrib.Variable(np.ones(2, np.float32), name="w")
    optimizer = LazyOptimizer()
    optimizer.apply(np.ones(2, np.float32), w)
    Checkpoint(w=w, optimizer=optimizer).save(path)  # velocity [1, 1], iterations 1

    fresh = LazyOptimizer()
    Checkpoint(w=w, optimizer=fresh).restore(path)  # no slot yet: not an error
    assert int(fresh.iterations.numpy()) == 1 and fresh.slots == {}
    fresh.apply(np.zeros(2, np.float32), w)  # creates the slot, which calls restore_deferred
    assert fresh.slots["w"].numpy().tolist() == [0.5, 0.5]  # 0.5 * the restored velocity, not 0.5 * 0
    assert checkpoint_module.restore_deferred(fresh) == []


class Owner:
    """An object whose variables() a Checkpoint saves by name, as it saves an optimizer's slots."""

    def __init__(self, variables):
        self.created = variables

    def variables(self):
        return self.created


def test_an_owners_variables_that_share_a_name_are_numbered_in_order(path):
    names = ["Variable", "Variable", "Variable_1", "Variable", "w", "Variable", "w"]
    Checkpoint(owner=Owner([distrib.Variable(np.float32(k), name=n) for k, n in enumerate(names)])).save(path)
    saved = {key: float(value) for key, value in safetensors.numpy.load_file(path).items()}
    assert saved == {"owner/Variable": 0, "owner/Variable_1": 1, "owner/Variable_1_1": 2, "owner/Variable_2": 3,
                     "owner/w": 4, "owner/Variable_3": 5, "owner/w_1": 6}
    fresh = Owner([distrib.Variable(np.float32(0), name=n) for n in names])
    Checkpoint(owner=fresh).restore(path)
    assert [float(v.numpy()) for v in fresh.created] == list(range(len(names)))



def test_the_file_is_safetensors_with_the_manifest_in_its_header(path):
    strategy = strategy_with(2)
    total = sync_on_read(strategy, np.float32(0), SUM)
    total.assign(np.float32(6))
    Checkpoint(total=total, w=distrib.Variable(np.arange(3, dtype=np.int16)), step=4).save(path)
    arrays = safetensors.numpy.load_file(path)
    assert arrays["total"].dtype == np.float32 and arrays["total"] == 6.0  # the sum, not a replica's share
    assert arrays["w"].dtype == np.int16 and arrays["w"].tolist() == [0, 1, 2]
    with safetensors.safe_open(path, framework="numpy") as file:
        header = file.metadata()
    manifest = json.loads(header["distrib_manifest"])
    assert header["format"] == "distrib-checkpoint/2" and len(header["sha256"]) == 64
    assert manifest["distrib_version"] == distrib.__version__ and manifest["metadata"] == {"": {"step": 4}}
    assert [(e["key"], e["variable"], e["aggregation"]) for e in manifest["entries"]] == [
        ("total", "SyncOnReadVariable", "SUM"), ("w", "Variable", "NONE")]


READ_WITHOUT_TORCH = """
import json, sys
sys.modules["torch"] = None  # any import of PyTorch fails
import safetensors.numpy
print(json.dumps({k: v.tolist() for k, v in safetensors.numpy.load_file(sys.argv[1]).items()}))
"""


def test_pytorch_free_readers_load_the_weights_by_their_keys(path):
    strategy = strategy_with(2)
    with strategy.scope():
        w = distrib.Variable(np.ones(3, np.float32), name="w")
        b = distrib.Variable(np.float32(0.5), name="b")
        optimizer = distrib.optimizers.SGD(0.1, momentum=0.9)
    train_one_step(strategy, optimizer, w)
    Checkpoint(model={"w": w, "b": b}, optimizer=optimizer, step=1).save(path)
    read = subprocess.run([sys.executable, "-c", READ_WITHOUT_TORCH, str(path)], capture_output=True, text=True,
                          check=True)
    arrays = json.loads(read.stdout)
    assert sorted(arrays) == ["model/b", "model/w", "optimizer/SGD/iterations", "optimizer/w/momentum"]
    assert arrays["model/w"] == w.numpy().tolist() and arrays["model/b"] == 0.5
    assert arrays["optimizer/SGD/iterations"] == 1


# -- metadata -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_the_file_gets_the_mode_the_umask_gives_new_files(path, umask, mode):
    previous = os.umask(umask)
    try:
        Checkpoint(w=distrib.Variable(np.ones(3, np.float32))).save(path)
    finally:
        os.umask(previous)
    assert os.stat(path).st_mode & 0o777 == mode


def test_metadata_round_trip(path):
    w = distrib.Variable(np.zeros(2, np.float32))
    history = {"loss": [0.5, 0.25], "accuracy": [0.75, 0.9]}
    ckpt = Checkpoint(w=w, step=np.int64(12), lr=0.001, run="baseline", history=history, tags=("a", "b"))
    assert ckpt.metadata["step"] == 12
    ckpt.save(path)
    fresh = Checkpoint(w=w, step=0, added_later="kept")
    metadata = fresh.restore(path)
    assert metadata is fresh.metadata
    assert metadata == {"step": 12, "lr": 0.001, "run": "baseline", "history": history, "tags": ["a", "b"],
                        "added_later": "kept"}
    assert type(metadata["step"]) is int


def test_metadata_must_be_json():
    with pytest.raises(TypeError, match="Checkpoint metadata must be JSON values.*'weights'"):
        Checkpoint(weights=np.zeros(3))
    with pytest.raises(TypeError, match="A Checkpoint holds variables.*'model/lr'"):
        Checkpoint(model={"w": distrib.Variable(np.zeros(1)), "lr": 0.1})


def test_repr():
    ckpt = Checkpoint(w=distrib.Variable(np.zeros(1)), step=1)
    assert repr(ckpt) == "<Checkpoint objects=['w'] metadata=['step']>"


# -- damaged files --------------------------------------------------------------------------------------------

@pytest.fixture
def saved(path):
    """A checkpoint of one 1000-float variable at `path`, and that variable."""
    w = distrib.Variable(np.arange(1000, dtype=np.float32), name="w")
    Checkpoint(w=w, step=1).save(path)
    return w


@pytest.mark.parametrize("where", ["manifest", "payload", "checksum"])
def test_a_flipped_byte_is_detected(path, saved, where):
    data = bytearray(path.read_bytes())
    with safetensors.safe_open(path, framework="numpy") as file:
        checksum = file.metadata()["sha256"].encode()
    at = {"manifest": data.index(b"Variable"), "payload": -2000, "checksum": data.index(checksum) + 5}[where]
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"Checkpoint '.*model.ckpt' is corrupted: its SHA-256 checksum"):
        Checkpoint(w=saved, step=0).restore(path)
    assert saved.numpy()[1] == 1.0  # nothing was assigned


@pytest.mark.parametrize("keep", [10, 30, 200, -100, -1])
def test_a_truncated_file_is_detected(path, saved, keep):
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(CheckpointError, match=r"Checkpoint '.*model.ckpt' is truncated or damaged"):
        Checkpoint(w=saved).restore(path)


FORMAT_1 = b"distrib-checkpoint\n" + bytes(16) + b"{}" + bytes(32)


@pytest.mark.parametrize("content, named", [
    (b"", "an empty file"),
    (b"PK\x03\x04 a zip file", "a zip archive"),
    (bytes(range(256)) * 4, r"not a safetensors file \(it starts with b'\\x00\\x01"),
    (FORMAT_1, "a checkpoint in distrib's format 1"),
    (None, r"a safetensors file of 2 tensors \(bias, weight\) whose header names no distrib format"),
], ids=["empty", "zip", "random-bytes", "format-1", "other-safetensors"])
def test_a_file_that_is_no_checkpoint_is_named(path, content, named):
    if content is None:
        safetensors.numpy.save_file({"weight": np.ones((2, 2), np.float32), "bias": np.zeros(2, np.float32)}, path)
    else:
        path.write_bytes(content)
    with pytest.raises(CheckpointError, match=f"restore needs a file written by Checkpoint.save.* {named}"):
        Checkpoint(w=distrib.Variable(np.zeros(1))).restore(path)
    assert issubclass(CheckpointError, DistribError) and issubclass(CheckpointError, ValueError)


def write_with_manifest(path: Path, manifest, arrays=None) -> None:
    """A file with a valid checksum whose manifest is `manifest` (JSON text as given, anything else dumped)."""
    arrays = {"w": np.zeros(2, np.float32)} if arrays is None else arrays
    text = manifest if isinstance(manifest, str) else json.dumps(manifest, sort_keys=True)
    digest = hashlib.sha256(text.encode())
    for array in arrays.values():
        digest.update(array.tobytes())
    safetensors.numpy.save_file(arrays, path, metadata={"format": "distrib-checkpoint/2", "distrib_manifest": text,
                                                        "sha256": digest.hexdigest()})


ENTRY = {"key": "w", "variable": "Variable", "aggregation": "NONE", "owner": None, "name": None}


@pytest.mark.parametrize("manifest, complaint", [
    ("{not json", "has an unreadable manifest"),
    ([ENTRY], "has a malformed manifest: the manifest is a JSON object. Received: 'list'"),
    ({"metadata": {}}, "has a malformed manifest: 'entries' is a list. Received: None"),
    ({"entries": {"w": ENTRY}, "metadata": {}}, "has a malformed manifest: 'entries' is a list"),
    ({"entries": [ENTRY], "metadata": []}, "has a malformed manifest: 'metadata' maps each Checkpoint's path"),
    ({"entries": [ENTRY], "metadata": {"": 3}}, "has a malformed manifest: 'metadata' maps each Checkpoint's path"),
    ({"entries": ["w"], "metadata": {}}, "has a malformed manifest: entry 0 is a JSON object. Received: 'w'"),
    ({"entries": [{**ENTRY, "key": 5}], "metadata": {}}, "has a malformed manifest: entry 0 has a 'key' of type str"),
    ({"entries": [{k: v for k, v in ENTRY.items() if k != "aggregation"}], "metadata": {}},
     "has a malformed manifest: entry 0 has a 'aggregation' of type str. Received: None"),
    ({"entries": [{**ENTRY, "owner": "opt"}], "metadata": {}}, "has a malformed manifest: entry 0 of owner 'opt'"),
    ({"entries": [ENTRY], "metadata": {}, "owners": {"opt": 3}}, "has a malformed manifest: 'owners' maps each "
                                                                 "owner's key to the name of its class"),
    ({"entries": [{**ENTRY, "key": "v"}], "metadata": {}}, r"is damaged: its manifest lists \['v'\] but the file "
                                                            r"holds the tensors \['w'\]"),
    ({"entries": [ENTRY, ENTRY], "metadata": {}}, "is damaged: its manifest lists"),
], ids=["not-json", "a-list", "no-entries", "entries-a-dict", "metadata-a-list", "metadata-of-a-number",
        "entry-a-string", "key-a-number", "no-aggregation", "owner-without-name", "owners-not-names",
        "another-key", "a-key-twice"])
def test_a_malformed_manifest_with_a_valid_checksum_is_a_checkpoint_error(path, manifest, complaint):
    write_with_manifest(path, manifest)
    with pytest.raises(CheckpointError, match=f"Checkpoint '.*model.ckpt' {complaint}"):
        Checkpoint(w=distrib.Variable(np.ones(2, np.float32))).restore(path)


def test_a_checkpoint_of_a_later_format_asks_for_that_version(path):
    safetensors.numpy.save_file({"w": np.zeros(2, np.float32)}, path, metadata={"format": "distrib-checkpoint/3"})
    with pytest.raises(CheckpointError, match="Checkpoint '.*' has format 'distrib-checkpoint/3'; this distrib reads"):
        Checkpoint(w=distrib.Variable(np.ones(2, np.float32))).restore(path)


def test_a_dtype_safetensors_cannot_hold_is_refused_at_save(path):
    with pytest.raises(TypeError, match="A checkpoint saves variables of the dtypes a safetensors file holds.*"
                                        "'z' of dtype complex64"):
        Checkpoint(z=distrib.Variable(np.ones(2, np.complex64))).save(path)
    assert not path.parent.exists() or os.listdir(path.parent) == []


def test_a_250_character_file_name_saves_and_restores(tmp_path):
    path = tmp_path / ("m" * 245 + ".ckpt")
    w = distrib.Variable(np.arange(3, dtype=np.float32))
    Checkpoint(w=w, step=2).save(path)
    w.assign(np.zeros(3, np.float32))
    assert Checkpoint(w=w, step=0).restore(path) == {"step": 2}
    assert w.numpy().tolist() == [0, 1, 2] and os.listdir(tmp_path) == [path.name]


# -- interrupted saves ----------------------------------------------------------------------------------------

def test_an_exception_midway_through_a_save_leaves_the_previous_checkpoint(path, saved, monkeypatch):
    def disk_full_after_the_header(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\x80\x00\x00\x00\x00\x00\x00\x00{")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", disk_full_after_the_header)
    saved.assign(np.zeros(1000, np.float32))
    with pytest.raises(OSError, match="No space left"):
        Checkpoint(w=saved, step=2).save(path)
    assert os.listdir(path.parent) == ["model.ckpt"]  # no temporary file left behind
    assert Checkpoint(w=saved, step=0).restore(path) == {"step": 1}
    assert saved.numpy()[999] == 999.0


def test_a_failed_flush_to_disk_leaves_the_previous_checkpoint(path, saved, monkeypatch):
    def failing_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="Input/output error"):
        Checkpoint(w=saved, step=2).save(path)
    monkeypatch.undo()
    assert os.listdir(path.parent) == ["model.ckpt"]
    assert Checkpoint(w=saved, step=0).restore(path) == {"step": 1}


SAVE_IN_A_LOOP = """
import sys, numpy as np, distrib
w = distrib.Variable(np.zeros(int(sys.argv[2]), np.float32), name="w")
ckpt = distrib.Checkpoint(w=w)
for step in range(1, 1000):
    w.assign(np.full(w.shape, step, np.float32))
    ckpt.save(sys.argv[1])
"""


def half_written(folder: Path, path: Path) -> list[Path]:
    """The files of saves in progress (anything in `folder` but the checkpoint `path`: temporaries, in folders of
    their own or not, safetensors' own among them) that already hold more than 1 MiB."""
    found = []
    for file in folder.rglob("*"):
        with contextlib.suppress(FileNotFoundError):  # renamed onto the checkpoint in the meantime
            if file != path and file.is_file() and file.stat().st_size > 1 << 20:
                found.append(file)
    return found


def kill_mid_save(path: Path, size: int) -> bool:
    """Starts a process saving `size` floats to `path` in a loop, kills it mid-write; True if it was caught so."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(distrib.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-c", SAVE_IN_A_LOOP, str(path), str(size)], env=env)
    try:
        deadline = time.monotonic() + 10
        while not half_written(path.parent, path) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        process.kill()
        process.wait()
    return bool(set(os.listdir(path.parent)) - {path.name})  # left behind: the kill came between creation and rename


@pytest.mark.timeout(120)  # three 32 MiB saves and a child process on a busy machine
def test_a_process_killed_mid_save_leaves_a_restorable_checkpoint_and_the_next_save_cleans_up(path):
    size = 8 << 20  # 32 MiB of float32: each save takes long enough to be caught in the middle
    w = distrib.Variable(np.full(size, -1, np.float32), name="w")
    Checkpoint(w=w).save(path)
    assert any(kill_mid_save(path, size) for _ in range(3)), "the saving process was never caught mid-write"
    w.assign(np.zeros(size, np.float32))
    Checkpoint(w=w).restore(path)
    values = w.numpy()
    assert values[0] != 0 and (values == values[0]).all()  # one whole save: ours (-1), or one of the process's
    Checkpoint(w=w).save(path)
    # the killed save's temporaries are gone, safetensors' own too (it wrote its file under a name of its own
    # beside the one it was given, which was left behind for good)
    assert os.listdir(path.parent) == [path.name]


# -- paths that cannot hold a checkpoint ----------------------------------------------------------------------

def test_a_folder_or_a_path_under_a_file_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "afile").write_text("")
    os.mkfifo(tmp_path / "fifo")
    ckpt = Checkpoint(w=distrib.Variable(np.ones(2, np.float32)))
    for given, error, complaint in [
            (tmp_path / "folder", IsADirectoryError, "must name a file, not a folder"),
            (f"{tmp_path}/new/", IsADirectoryError, "must name a file, not a folder"),
            (tmp_path / "afile" / "model.ckpt", NotADirectoryError, f"and '{tmp_path}/afile' is a file"),
            (tmp_path / "afile" / "a" / "model.ckpt", NotADirectoryError, f"and '{tmp_path}/afile' is a file"),
            (tmp_path / "fifo", FileExistsError, "must name a regular file or nothing yet")]:
        with pytest.raises(error, match=f"{re.escape(complaint)}.*Received: {re.escape(repr(str(given)))}"):
            ckpt.save(given)
    assert sorted(os.listdir(tmp_path)) == ["afile", "fifo", "folder"] and os.listdir(tmp_path / "folder") == []
    with pytest.raises(TypeError, match="A checkpoint's path must be a str, bytes or os.PathLike. Received: int."):
        ckpt.save(3)


def test_bytes_and_pathlike_paths_save_and_restore(tmp_path):
    w = distrib.Variable(np.arange(2, dtype=np.float32))
    for given in (os.fsencode(tmp_path / "b.ckpt"), tmp_path / "p.ckpt"):
        assert Checkpoint(w=w).save(given) == os.fsdecode(given)
        Checkpoint(w=w).restore(given)
    assert sorted(os.listdir(tmp_path)) == ["b.ckpt", "p.ckpt"]


def test_an_unwritable_folder_raises_a_permission_error_naming_the_path():
    path = "/sys/distrib-checkpoint-test.ckpt"  # sysfs refuses new files even to root, who may write anywhere else
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except PermissionError:
        pass
    except OSError as exc:
        pytest.skip(f"no folder here refuses a new file with EACCES ({exc})")
    else:
        os.remove(path)
        pytest.skip("/sys lets this process create files")
    with pytest.raises(PermissionError, match=r"^Checkpoint.save could not write the file. Received: "
                                              r"'/sys/distrib-checkpoint-test.ckpt' \((Permission denied|"
                                              r"Operation not permitted)\)\.$"):
        Checkpoint(w=distrib.Variable(np.ones(2, np.float32))).save(path)


def test_an_io_error_safetensors_reports_is_an_os_error_naming_the_path(path, saved, monkeypatch):
    def disk_full(tensors, filename, metadata=None):
        raise safetensors.SafetensorError(f'Error while serializing: I/O error: No space left on device (os error '
                                          f'28) at path "{os.path.dirname(filename)}/.tmpETngi0"')

    monkeypatch.setattr(safetensors.numpy, "save_file", disk_full)
    with pytest.raises(OSError, match=f"^Checkpoint.save could not write the file. Received: "
                                      f"{re.escape(repr(str(path)))} \\(No space left on device\\).$") as caught:
        Checkpoint(w=saved, step=2).save(path)
    assert caught.value.errno == 28
    assert os.listdir(path.parent) == ["model.ckpt"]  # no temporary file left behind


# -- files that do not match the objects ----------------------------------------------------------------------

def test_missing_and_extra_keys_are_listed(path):
    a, b = distrib.Variable(np.ones(2)), distrib.Variable(np.ones(2))
    Checkpoint(a=a, b=b).save(path)
    c = distrib.Variable(np.zeros(2))
    with pytest.raises(CheckpointError, match=r"missing from the file: \['c'\]; in the file but not in the "
                                              r"Checkpoint: \['b'\]"):
        Checkpoint(a=a, c=c).restore(path)
    a.assign(np.zeros(2))
    Checkpoint(a=a, c=c).restore(path, allow_partial=True)
    assert a.numpy().tolist() == [1, 1] and c.numpy().tolist() == [0, 0]


def test_a_shape_mismatch_names_the_key_and_both_shapes(path):
    Checkpoint(model={"w": distrib.Variable(np.ones((2, 3)))}).save(path)
    with pytest.raises(CheckpointError, match=r"restore needs the shape the variable has. Received: 'model/w', "
                                              r"shape \(2, 3\) in the file vs \(3, 2\) in the variable"):
        Checkpoint(model={"w": distrib.Variable(np.zeros((3, 2)))}).restore(path)


def test_dtypes_cast_only_safely(path):
    Checkpoint(w=distrib.Variable(np.array([1, 2], np.int32))).save(path)
    wider = distrib.Variable(np.zeros(2, np.int64))
    Checkpoint(w=wider).restore(path)
    assert wider.numpy().tolist() == [1, 2] and wider.dtype == np.int64
    with pytest.raises(CheckpointError, match="Received: 'w', dtype int32 in the file vs int16 in the variable"):
        Checkpoint(w=distrib.Variable(np.zeros(2, np.int16))).restore(path)


def test_nothing_is_assigned_unless_everything_matches(path):
    a, b = distrib.Variable(np.ones(2)), distrib.Variable(np.ones(2))
    Checkpoint(a=a, b=b).save(path)
    a.assign(np.zeros(2))
    with pytest.raises(CheckpointError, match="shape"):
        Checkpoint(a=a, b=distrib.Variable(np.zeros(3))).restore(path)
    assert a.numpy().tolist() == [0, 0]


# -- contexts and unsupported variables -----------------------------------------------------------------------

def test_restore_and_save_in_a_replica_context_raise(path):
    strategy = strategy_with(2)
    w = variable(strategy, np.zeros(2, np.float32))
    ckpt = Checkpoint(w=w)
    ckpt.save(path)
    for method in (ckpt.restore, ckpt.save):
        with pytest.raises(ContextError, match=r"Checkpoint\.\w+ must be called in a cross-replica context"):
            strategy.run(method, args=(path,))
    assert issubclass(ContextError, RuntimeError)


def test_sync_on_read_without_aggregation_cannot_be_saved(path):
    metric = sync_on_read(strategy_with(2), np.float32(0), "NONE")
    with pytest.raises(ValueError, match="aggregation NONE does not define"):
        Checkpoint(metric=metric).save(path)
    assert not path.parent.exists() or os.listdir(path.parent) == []


@pytest.mark.parametrize("where", ["plain", "mirrored"])
@pytest.mark.parametrize("restore_before_build", [True, False])
def test_slots_of_variables_with_one_name_go_back_to_their_own_variables_whatever_the_gradients_order(
        path, where, restore_before_build):
    # before: slots were told apart by the order the first step met their variables; a program passing its
    # gradients in another order restored one variable's Adam moments into the other, silently
    scope = distrib.MirroredStrategy(["CPU:0", "CPU:1"]).scope() if where == "mirrored" else contextlib.nullcontext()
    grads = (np.array([1.0, 1.0], np.float32), np.array([-5.0, 3.0], np.float32))

    def program():
        with scope:  # two unnamed variables of one shape: both named "Variable"
            a, b = distrib.Variable(np.zeros(2, np.float32)), distrib.Variable(np.ones(2, np.float32))
            return a, b, distrib.optimizers.Adam(0.1)

    def step(a, b, optimizer, reverse=False):
        pairs = [(grads[0], a), (grads[1], b)]
        with scope:
            optimizer.apply_gradients(pairs[::-1] if reverse else pairs)

    a, b, optimizer = program()
    step(a, b, optimizer)
    Checkpoint(a=a, b=b, optimizer=optimizer).save(path)
    step(a, b, optimizer)
    a2, b2, optimizer2 = program()
    if not restore_before_build:
        with scope:
            optimizer2.build([b2, a2])
    Checkpoint(a=a2, b=b2, optimizer=optimizer2).restore(path)
    step(a2, b2, optimizer2, reverse=True)
    np.testing.assert_array_equal(a2.numpy(), a.numpy())
    np.testing.assert_array_equal(b2.numpy(), b.numpy())
