"""The main job, `distrib train`: the bundled digits, training to accuracy, checkpoints, resuming, the CLI."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from distrib import cli
from distrib.backends import detect, get_backend
from distrib.datasets import load_digits
from distrib.backends import cuda_problem
from distrib.cli.progress import PlainProgress
from distrib.cli import train as train_module
from distrib.cli.train import build_parser, main as train_main
from support import train_refusal as refusal
from distrib.cli.train_strategy import blas_threads, make_strategy, replica_devices, replicas_at_once, shared_cores


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
    # resumed once every epoch has run: the accuracy, and no throughput of a training that did not happen
    assert train_main(["--replicas", "2", "--epochs", "4", "--resume", "--out", str(tmp_path)]) == 0
    assert "after 4 epochs; the checkpoint had run them all, so nothing was trained (raise --epochs to train more)" \
        in capsys.readouterr().out


def test_one_and_four_replicas_train_the_same_model(tmp_path, capsys, monkeypatch):
    """Data parallelism changes where the work runs, not what is learnt; nor do threads or cooperative replicas."""
    for replicas in ("1", "4"):
        train_main(["--replicas", replicas, "--epochs", "2", "--out", str(tmp_path / replicas)])
    monkeypatch.setenv("DISTRIB_REPLICA_EXECUTION", "threads")
    train_main(["--replicas", "4", "--epochs", "2", "--out", str(tmp_path / "threads")])
    one, four, threads = (json.loads((tmp_path / r / "history.json").read_text()) for r in ("1", "4", "threads"))
    np.testing.assert_allclose(four["step_loss"], one["step_loss"], rtol=1e-4)
    assert threads["step_loss"] == four["step_loss"]  # bit for bit


@pytest.mark.skipif(detect() != "cpu",
                    reason="the emulator's default; GPU replicas run on threads unless a strategy asks otherwise")
def test_emulated_replicas_train_cooperatively_unless_the_environment_says_threads(tmp_path, monkeypatch):
    args = build_parser().parse_args(["--replicas", "4", "--out", str(tmp_path)])
    monkeypatch.delenv("DISTRIB_REPLICA_EXECUTION", raising=False)
    strategy = make_strategy(args)
    assert strategy.extended.replica_execution == "cooperative"
    assert replicas_at_once(strategy) == 1  # they take turns: each matmul may use the cores
    monkeypatch.setenv("DISTRIB_REPLICA_EXECUTION", "threads")
    strategy = make_strategy(args)
    assert strategy.extended.replica_execution == "threads"
    assert replicas_at_once(strategy) == 4


def test_steps_run_ahead_of_the_host_which_reads_their_losses_once_per_refresh(tmp_path, monkeypatch, capsys):
    """On a GPU every read of a device value waits for the queued steps: a run reads a few times per epoch."""
    backend = get_backend()
    reads = []
    copy_to_host = backend.to_host
    monkeypatch.setattr(backend, "to_host", lambda array: reads.append(np.size(array)) or copy_to_host(array))
    monkeypatch.setattr(train_module, "REFRESH_SECONDS", 3600.0)
    assert train_main(["--replicas", "2", "--epochs", "2", "--global-batch-size", "16", "--out", str(tmp_path)]) == 0
    steps = 2 * (1442 // 16)
    history = json.loads((tmp_path / "history.json").read_text())
    assert len(history["step_loss"]) == steps and steps // 2 in reads  # each epoch's losses in one copy
    assert len(reads) < steps // 2, reads  # the checkpoints' reads, not one or two per step


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "3", "--global-batch-size", "64"], "--global-batch-size must divide evenly over the 3 replicas"),
    (["--epochs", "0"], "--epochs must be at least 1. Received: 0."),
    # a hundred million replicas ground on building their devices
    (["--replicas", "100000000"], "--replicas must be at most 4096: each replica is a thread of this process. "
                                  "Received: 100000000."),
    (["--momentum", "0.9"], "--momentum applies to --optimizer sgd only"),
    (["--resume"], "--resume found no checkpoint"),
    (["--learning-rate", "nan"], "--learning-rate must be a finite number of at least 0. Received: nan."),
    (["--learning-rate", "inf"], "--learning-rate must be a finite number of at least 0. Received: inf."),
    (["--learning-rate", "-1"], "--learning-rate must be a finite number of at least 0. Received: -1.0."),
    (["--optimizer", "sgd", "--momentum", "2"], "--momentum must be in [0, 1]. Received: 2.0."),
    (["--seed", "-5"], "--seed must be at least 0. Received: -5."),
    (["--epochs", "abc"], "argument --epochs: invalid int value: 'abc'"),
    (["--global-batch-size", "5000"], "--global-batch-size must be at most the 1442 training rows"),
    (["--resume", "--overwrite"], "--resume continues the run in --out and --overwrite replaces it"),
])
def test_bad_flags_are_refused_in_one_line_naming_the_flag(tmp_path, capsys, flags, message):
    assert refusal(capsys, flags + ["--out", str(tmp_path / "run")]).startswith(message)
    assert not (tmp_path / "run").exists()  # nothing is created for a run that does not start


def test_an_out_that_is_a_file_or_under_one_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert refusal(capsys, ["--out", str(tmp_path / "file")]).startswith("--out must be a directory. Received:")
    assert refusal(capsys, ["--out", str(tmp_path / "file" / "run")]).startswith(
        "--out must be a directory distrib train can create and write to. Received:")


def test_an_out_that_cannot_be_written_is_refused(tmp_path, capsys):
    if os.geteuid() == 0:  # root writes anywhere chmod forbids; sysfs refuses even root
        out = Path("/sys/kernel")
        if not out.is_dir():
            pytest.skip("running as root without /sys/kernel: no directory refuses writes here")
    else:
        out = tmp_path / "read-only"
        out.mkdir(mode=0o500)
    assert refusal(capsys, ["--epochs", "1", "--out", str(out)]).startswith(
        "--out must be a directory distrib train can create and write to. Received:")


def test_running_again_into_a_run_needs_resume_or_overwrite(tmp_path, capsys):
    flags = ["--replicas", "2", "--epochs", "1", "--out", str(tmp_path)]
    assert train_main(flags) == 0
    saved = (tmp_path / "ckpt").read_bytes()
    assert "after 1 epoch; " in capsys.readouterr().out
    assert refusal(capsys, flags).startswith("--out already holds a run (ckpt, history.json, loss.png): pass "
                                             "--resume to continue it or --overwrite to replace it.")
    assert (tmp_path / "ckpt").read_bytes() == saved
    assert train_main(flags + ["--overwrite", "--seed", "1"]) == 0
    assert (tmp_path / "ckpt").read_bytes() != saved
    capsys.readouterr()
    assert refusal(capsys, flags + ["--resume", "--hidden", "64"]).startswith(
        "--resume needs the --hidden the checkpoint was trained with: --hidden 128. Received: --hidden 64.")
    assert refusal(capsys, flags + ["--resume", "--optimizer", "sgd"]).startswith(
        "--resume needs the --optimizer the checkpoint was trained with: --optimizer adam. Received: --optimizer sgd.")
    damaged = bytearray((tmp_path / "ckpt").read_bytes())
    damaged[-10:] = b"\xff" * 10
    (tmp_path / "ckpt").write_bytes(bytes(damaged))
    assert refusal(capsys, flags + ["--resume"]).startswith(f"--resume: Checkpoint {str(tmp_path / 'ckpt')!r}")


@pytest.mark.parametrize("environment, message", [
    ({"DISTRIB_CPU_REPLICAS": "abc"}, "DISTRIB_CPU_REPLICAS must be a positive integer of at most 4096 (each "
                                      "emulated replica is a thread of this process). Received: 'abc'."),
    # a billion replicas ground on building their device names, then ran out of memory
    ({"DISTRIB_CPU_REPLICAS": "1000000000"}, "DISTRIB_CPU_REPLICAS must be a positive integer of at most 4096 (each "
                                             "emulated replica is a thread of this process). Received: '1000000000'."),
    ({"DISTRIB_BACKEND": "gpu"}, "DISTRIB_BACKEND must be 'cpu' or 'cuda'. Received: 'gpu'."),
    pytest.param({"DISTRIB_BACKEND": "cuda"}, "DISTRIB_BACKEND=cuda, but ", marks=pytest.mark.skipif(
        cuda_problem() is None, reason="the CUDA backend runs here")),
])
def test_bad_environment_variables_are_one_line_and_exit_2(tmp_path, environment, message):
    """A fresh process: the backend is chosen once per process, from the environment."""
    result = subprocess.run([sys.executable, "-m", "distrib", "train", "--out", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=120, env={**os.environ, **environment})
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith(f"distrib train: error: {message}")


def test_a_run_whose_reader_goes_away_still_trains_and_writes_its_files(tmp_path):
    # `distrib train | head -1`: before, the first print after the reader left raised BrokenPipeError, and a run
    # started with --overwrite had already deleted the one it replaced
    out = tmp_path / "run"
    with subprocess.Popen([sys.executable, "-m", "distrib", "train", "--epochs", "3", "--out", str(out)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        assert "replicas, global batch" in process.stdout.readline()
        process.stdout.close()  # as `head -1` exits
        returncode, stderr = process.wait(timeout=120), process.stderr.read()
    assert returncode == 0, stderr
    assert "BrokenPipeError" not in stderr
    assert len(json.loads((out / "history.json").read_text())["test_accuracy"]) == 3


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device every write fails on")
def test_a_run_whose_output_cannot_be_written_still_trains_and_exits_1(tmp_path):
    # a full disk under stdout: the run trains and writes its files, says once that its output was lost, and does
    # not exit 0 as if all were well
    out = tmp_path / "run"
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "distrib", "train", "--epochs", "2", "--out", str(out)],
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("distrib: cannot write its output") == 1 and "Traceback" not in done.stderr
    assert len(json.loads((out / "history.json").read_text())["test_accuracy"]) == 2


def test_an_epoch_without_steps_still_prints_its_line(capsys):
    progress = PlainProgress()
    progress.start_epoch(0, 1, steps=0)
    progress.end_epoch(0.5)
    assert capsys.readouterr().out.startswith("epoch 1/1  loss nan  test accuracy 50.00%")


@pytest.mark.parametrize("replicas, available, expected", [
    (None, ("GPU:0", "GPU:1"), None),
    (2, ("GPU:0", "GPU:1", "GPU:2", "GPU:3"), ["GPU:0", "GPU:1"]),
    (4, ("GPU:0", "GPU:1"), ["GPU:0", "GPU:1", "GPU:0", "GPU:1"]),
    (3, ("CPU:0", "CPU:1"), ["CPU:0", "CPU:1", "CPU:2"]),
])
def test_replicas_take_gpus_when_there_are_some(replicas, available, expected):
    """`--replicas N` is N GPUs, or N replicas over the GPUs there are, as `torchrun --nproc_per_node` is."""
    assert replica_devices(replicas, available) == expected


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


@pytest.mark.parametrize("replicas, cores, threads", [(1, 2, 1), (2, 2, 1), (1, 16, 15), (4, 16, 3), (8, 4, 1)])
def test_each_replica_gets_its_share_of_the_cores(replicas, cores, threads):
    assert blas_threads(replicas, cores) == threads


def test_training_limits_every_blas_to_the_replicas_share():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    before = [pool["num_threads"] for pool in threadpoolctl.threadpool_info()]
    with shared_cores(replicas=64) as threads:
        assert threads == 1
        assert all(pool["num_threads"] == 1 for pool in threadpoolctl.threadpool_info())
    assert [pool["num_threads"] for pool in threadpoolctl.threadpool_info()] == before
