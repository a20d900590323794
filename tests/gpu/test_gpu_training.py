"""Training on a GPU end to end: `distrib train` learns, with finite losses, on one replica and on four sharing
GPU:0; host arguments of `run` reach the replicas' GPU; a scalar reduced on one replica stays a scalar."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import distrib
from distrib.cli.train import main as train_main

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")


@pytest.mark.parametrize("replicas", [1, 4])
def test_distrib_train_learns_on_the_gpu_with_finite_losses(tmp_path, capsys, replicas):
    assert train_main(["--replicas", str(replicas), "--epochs", "3", "--out", str(tmp_path)]) == 0, \
        capsys.readouterr().err
    history = json.loads((tmp_path / "history.json").read_text())
    assert all(math.isfinite(loss) for loss in history["step_loss"])
    assert history["test_accuracy"][-1] > 0.9, history["test_accuracy"]


def test_a_scalar_reduced_or_broadcast_on_one_gpu_replica_stays_a_scalar():
    strategy = distrib.MirroredStrategy(["GPU:0"])
    count = strategy.run(lambda: cupy.asarray(3, cupy.int64))
    for op in ("SUM", "MEAN"):
        (reduced,) = strategy.experimental_local_results(strategy.extended.reduce_to(op, count, "GPU:0"))
        assert reduced.shape == () and int(reduced) == 3
    (copied,) = strategy.experimental_local_results(strategy.extended.broadcast_to(cupy.asarray(2.5), "GPU:0"))
    assert copied.shape == () and float(copied) == 2.5


@pytest.mark.parametrize("devices", [["GPU:0"], ["GPU:0", "GPU:0"]])
def test_numpy_arguments_of_run_arrive_on_each_replicas_gpu(devices):
    strategy = distrib.MirroredStrategy(devices)
    doubled = strategy.run(lambda x, scale: x * scale, args=(np.arange(3, dtype=np.float32),),
                           kwargs={"scale": np.float32(2)})
    for value in strategy.experimental_local_results(doubled):
        assert isinstance(value, cupy.ndarray)
        np.testing.assert_array_equal(value.get(), [0, 2, 4])
