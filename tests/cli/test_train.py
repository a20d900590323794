"""The main job, `distrib train`: the bundled digits, training to accuracy, checkpoints, resuming, the CLI."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from distrib import cli
from distrib.backends import detect
from distrib.datasets import load_digits
from distrib.cli.train import main as train_main


def test_the_digits_split_is_fixed_stratified_and_scaled():
    x_train, y_train, x_test, y_test = load_digits()
    assert x_train.shape == (1442, 64) and x_test.shape == (355, 64)
    assert x_train.dtype == np.float32 and 0.0 <= x_train.min() and x_train.max() <= 1.0
    assert set(np.unique(y_test)) == set(range(10))
    again = load_digits()
    np.testing.assert_array_equal(again[0], x_train)
    np.testing.assert_array_equal(again[3], y_test)
    for label in range(10):  # every class is split 80/20
        train_count, test_count = (y_train == label).sum(), (y_test == label).sum()
        assert abs(test_count / (train_count + test_count) - 0.2) < 0.02


def test_training_on_four_replicas_reaches_95_percent_and_leaves_checkpoint_and_plot(tmp_path, capsys):
    assert train_main(["--replicas", "4", "--epochs", "12", "--out", str(tmp_path)]) == 0
    output = capsys.readouterr().out
    accuracy = float(output.split("test accuracy ")[-1].split("%")[0])
    assert accuracy >= 95.0, output
    assert (tmp_path / "ckpt").is_file()
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    history = json.loads((tmp_path / "history.json").read_text())
    assert len(history["test_accuracy"]) == 12
    assert history["step_loss"][-1] < history["step_loss"][0] / 5


def test_resume_continues_the_epochs_and_the_history(tmp_path, capsys):
    assert train_main(["--replicas", "2", "--epochs", "2", "--out", str(tmp_path)]) == 0
    first = json.loads((tmp_path / "history.json").read_text())
    assert train_main(["--replicas", "4", "--epochs", "4", "--resume", "--out", str(tmp_path)]) == 0
    resumed = json.loads((tmp_path / "history.json").read_text())
    assert "after 4 epochs" in capsys.readouterr().out
    assert len(resumed["test_accuracy"]) == 4
    assert resumed["step_loss"][:len(first["step_loss"])] == first["step_loss"]  # the earlier epochs are kept
    assert len(resumed["step_loss"]) == 2 * len(first["step_loss"])


def test_one_and_four_replicas_train_the_same_model(tmp_path, capsys):
    """Data parallelism changes where the work runs, not what is learnt."""
    for replicas in ("1", "4"):
        train_main(["--replicas", replicas, "--epochs", "2", "--out", str(tmp_path / replicas)])
    one, four = (json.loads((tmp_path / r / "history.json").read_text()) for r in ("1", "4"))
    np.testing.assert_allclose(four["step_loss"], one["step_loss"], rtol=1e-4)


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "3", "--global-batch-size", "64"], "must divide evenly over the 3 replicas"),
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--momentum", "0.9"], "--momentum applies to --optimizer sgd only"),
    (["--resume"], "--resume found no checkpoint"),
])
def test_bad_flags_are_refused_with_the_reason(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        train_main(flags + ["--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_command_line_runs_info_and_train():
    result = subprocess.run([sys.executable, "-m", "distrib", "info"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    kind = detect()  # the GPU machine's answer is cuda: the test holds on both
    assert f"backend: {kind}" in result.stdout
    assert ("default devices: GPU:0" if kind == "cuda" else "default devices: CPU:0, CPU:1") in result.stdout
    assert cli.main(["info"]) == 0
    with pytest.raises(SystemExit):
        cli.main(["fly"])


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_mixed_precision_trains_or_says_what_is_missing(tmp_path, capsys, precision):
    flags = ["--replicas", "2", "--epochs", "3", "--precision", precision, "--out", str(tmp_path)]
    if precision == "bfloat16" and importlib.util.find_spec("ml_dtypes") is None:
        with pytest.raises(SystemExit):
            train_main(flags)
        assert "needs ml_dtypes" in capsys.readouterr().err
        return
    assert train_main(flags) == 0
    accuracy = float(capsys.readouterr().out.split("test accuracy ")[-1].split("%")[0])
    assert accuracy > 80.0  # ten classes: chance is 10%
