"""`distrib train` keeps its run resumable and says what went wrong in one line: weights checked before each
checkpoint, the checkpoint written before the history, SIGTERM as Ctrl-C, folders and sizes it cannot use, a
resume with another --momentum, and the resume line under mpirun."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings

import numpy as np
import pytest
from support import interruptible

from distrib.cli import train as train_module
from distrib.cli.model import MLP
from distrib.cli.train import build_parser, main as train_main
from support import train_refusal as refusal

pytestmark = pytest.mark.timeout(120)

ONE_STEP = ["--replicas", "2", "--global-batch-size", "1442"]  # one step per epoch: its last step is its only one


# -- 1. non-finite weights ------------------------------------------------------------------------------

def test_weights_an_epochs_last_step_makes_non_finite_are_never_checkpointed(tmp_path, capsys, monkeypatch):
    flags = [*ONE_STEP, "--out", str(tmp_path)]
    assert train_main([*flags, "--epochs", "1"]) == 0
    checkpoint, history = (tmp_path / "ckpt").read_bytes(), (tmp_path / "history.json").read_text()
    capsys.readouterr()
    finite_loss_and_gradients = MLP.loss_and_gradients

    def nan_gradients(self, x, y, dtype):  # the loss is finite; the update it makes is not
        loss, grads = finite_loss_and_gradients(self, x, y, dtype)
        return loss, [grads[0] * np.float32("nan"), *grads[1:]]

    monkeypatch.setattr(MLP, "loss_and_gradients", nan_gradients)
    assert train_main([*flags, "--epochs", "3", "--resume"]) == 1
    err = capsys.readouterr().err
    assert "distrib train: the weights became nan or infinite by step 2 (epoch 2: hidden/kernel" in err
    assert "so training stopped (a lower --learning-rate usually avoids that)." in err
    assert f"The last checkpoint is {tmp_path / 'ckpt'}; resume with: " in err
    assert (tmp_path / "ckpt").read_bytes() == checkpoint  # the last good one, as it was
    assert (tmp_path / "history.json").read_text() == history
    monkeypatch.undo()
    assert train_main([*flags, "--epochs", "2", "--resume"]) == 0  # and it resumes


def test_a_learning_rate_beyond_float32_is_refused_without_warnings(tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        message = refusal(capsys, [*ONE_STEP, "--learning-rate", "1e39", "--out", str(tmp_path / "run")])
    assert message == ("--learning-rate must be finite in float32, the dtype of the weights and of the optimizer's "
                       "arithmetic: at most 3.402823e+38. Received: 1e+39.")
    assert not (tmp_path / "run").exists()


# -- 2. the checkpoint before the history ----------------------------------------------------------------

def test_the_history_is_written_after_the_checkpoint_it_describes(tmp_path, monkeypatch, capsys):
    seen = []
    save = train_module.History.save

    def save_history(self, path):
        seen.append((path.parent / "ckpt").exists())
        save(self, path)

    monkeypatch.setattr(train_module.History, "save", save_history)
    assert train_main([*ONE_STEP, "--epochs", "1", "--out", str(tmp_path)]) == 0
    assert seen == [True]


def test_a_history_that_cannot_be_written_keeps_the_last_one_and_leaves_no_partial_file(tmp_path, monkeypatch,
                                                                                         capsys):
    # a full disk while history.json was written left history.json.partial in --out
    import errno
    import pathlib

    write_text, writes = pathlib.Path.write_text, []

    def disk_fills_on_the_second_history(path, text, *args, **kwargs):
        if path.name == "history.json.partial":
            writes.append(path)
            if len(writes) == 2:
                write_text(path, text[:10], *args, **kwargs)  # what fitted
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_text(path, text, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", disk_fills_on_the_second_history)
    assert train_main([*ONE_STEP, "--epochs", "3", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        f"distrib train: the history could not be written to {tmp_path / 'history.json'} (No space left on "
        f"device); the checkpoint of epoch 2 was.")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "history.json"]
    assert len(json.loads((tmp_path / "history.json").read_text())["test_accuracy"]) == 1


def test_a_run_stopped_between_the_checkpoint_and_the_history_resumes(tmp_path, capsys):
    flags = [*ONE_STEP, "--out", str(tmp_path)]
    assert train_main([*flags, "--epochs", "2"]) == 0
    history = json.loads((tmp_path / "history.json").read_text())
    (tmp_path / "history.json").write_text(json.dumps({key: value[:1] if isinstance(value, list) else value
                                                       for key, value in history.items()}))
    capsys.readouterr()
    assert train_main([*flags, "--epochs", "3", "--resume"]) == 0  # killed after epoch 2's checkpoint
    assert (f"distrib train: {tmp_path / 'history.json'} holds 1 of the checkpoint's 2 epochs; resuming from the "
            f"checkpoint, with the loss curve restarting at epoch 3.") in capsys.readouterr().err
    (tmp_path / "history.json").unlink()  # killed after the first checkpoint
    assert train_main([*flags, "--epochs", "4", "--resume"]) == 0
    assert f"{tmp_path / 'history.json'} is missing; resuming" in capsys.readouterr().err
    assert json.loads((tmp_path / "history.json").read_text())["epoch_end_step"] == [1]  # epoch 4's alone
    assert train_main([*flags, "--epochs", "6", "--resume"]) == 0  # the restarted curve goes on, not again
    assert "restarting" not in capsys.readouterr().err
    saved = json.loads((tmp_path / "history.json").read_text())
    assert saved["first_epoch"] == 3 and saved["epoch_end_step"] == [1, 2, 3]  # epochs 4, 5 and 6


def test_an_out_with_a_history_but_no_checkpoint_says_to_start_over_with_overwrite(tmp_path, capsys):
    (tmp_path / "history.json").write_text(json.dumps({"step_loss": [2.0], "epoch_end_step": [1],
                                                       "test_accuracy": [0.5]}))
    flags = [*ONE_STEP, "--epochs", "1", "--out", str(tmp_path)]
    assert refusal(capsys, flags) == (f"--out holds a run's history.json but no checkpoint to resume from: pass "
                                      f"--overwrite to start over. Received: {str(tmp_path)!r}.")
    assert refusal(capsys, [*flags, "--resume"]) == (f"--resume found no checkpoint at {tmp_path / 'ckpt'}, only "
                                                     f"history.json: start over with --overwrite instead of --resume.")
    assert train_main([*flags, "--overwrite"]) == 0


# -- 3. SIGTERM --------------------------------------------------------------------------------------------

@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_sigterm_stops_like_ctrl_c_names_the_checkpoint_writes_the_timeline_and_exits_143(tmp_path):
    out, trace = tmp_path / "run", tmp_path / "trace.json"
    flags = ["--replicas", "2", "--epochs", "500", "--out", str(out)]
    env = dict(os.environ, DISTRIB_TIMELINE=str(trace))
    with interruptible([sys.executable, "-m", "distrib", "train", *flags], env) as process:
        deadline = time.monotonic() + 60
        while not (out / "ckpt").exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (out / "ckpt").exists(), process.stderr.read() if process.poll() is not None else "no checkpoint"
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 143, err
    assert "Traceback" not in err
    assert (f"distrib train: terminated (SIGTERM); the step in progress was abandoned. The last checkpoint is "
            f"{out / 'ckpt'}; resume with: distrib train --replicas 2 --epochs 500 --out {out} --resume") in err
    assert trace.is_file()  # the program's exit ran: DISTRIB_TIMELINE's trace is written then


def test_sigterm_is_handled_during_the_run_and_its_handler_restored_after(tmp_path, monkeypatch, capsys):
    during = []
    monkeypatch.setattr(train_module, "plot_history", lambda history, path: during.append(
        signal.getsignal(signal.SIGTERM)))
    before = signal.getsignal(signal.SIGTERM)
    assert before == signal.SIG_DFL
    assert train_main([*ONE_STEP, "--epochs", "1", "--out", str(tmp_path)]) == 0
    assert callable(during[0])
    assert signal.getsignal(signal.SIGTERM) == before


# -- 4. folders and sizes it cannot use; the loss curve ----------------------------------------------------

@pytest.mark.parametrize("folder, flag", [("ckpt", "--resume"), ("ckpt", "--overwrite"),
                                          ("history.json", "--resume"), ("loss.png", "--resume"),
                                          ("loss.png", "--overwrite")])
def test_a_folder_named_as_a_run_file_is_refused_in_one_line(tmp_path, capsys, folder, flag):
    flags = [*ONE_STEP, "--out", str(tmp_path)]
    assert train_main([*flags, "--epochs", "1"]) == 0
    (tmp_path / folder).unlink()
    (tmp_path / folder).mkdir()
    capsys.readouterr()
    message = refusal(capsys, [*flags, "--epochs", "2", flag])
    assert message.startswith(f"--out must not hold a folder named {folder}, the name of a run's ")
    assert message.endswith(f": move or remove it. Received: {str(tmp_path / folder)!r}, a folder.")


def test_a_loss_curve_that_cannot_be_written_is_one_line_after_the_accuracy(tmp_path, capsys, monkeypatch):
    def plot_history(history, path):
        raise IsADirectoryError(21, "Is a directory", str(path))

    monkeypatch.setattr(train_module, "plot_history", plot_history)
    assert train_main([*ONE_STEP, "--epochs", "1", "--out", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "test accuracy " in captured.out and f"checkpoint {tmp_path / 'ckpt'}\n" in captured.out
    assert captured.err.splitlines()[-1] == (f"distrib train: the loss curve could not be written to "
                                            f"{tmp_path / 'loss.png'} (Is a directory).")


def test_a_hidden_layer_too_large_to_allocate_is_refused_in_one_line(tmp_path, capsys):
    # 10**13 units: petabytes, past any address space, so the allocation fails at once wherever this runs
    assert refusal(capsys, [*ONE_STEP, "--hidden", str(10**13), "--out", str(tmp_path)]) == (
        "--hidden must give weights that fit in memory: --hidden 10000000000000 needs 2,728 TiB for each replica's "
        "weights, more than could be allocated (MemoryError). Received: 10000000000000.")


# -- 5. resuming with another --momentum; a damaged checkpoint ----------------------------------------

def test_a_resume_that_would_drop_the_saved_momentum_is_refused_up_front(tmp_path, capsys):
    flags = [*ONE_STEP, "--optimizer", "sgd", "--out", str(tmp_path)]
    assert train_main([*flags, "--epochs", "1"]) == 0  # --momentum 0.9, the default
    capsys.readouterr()
    assert refusal(capsys, [*flags, "--epochs", "2", "--resume", "--momentum", "0"]) == (
        "--resume needs a --momentum above 0: the checkpoint was trained with --momentum 0.9 and holds each weight's "
        "momentum, which --momentum 0.0 would drop. Received: --momentum 0.0.")
    assert train_main([*flags, "--epochs", "2", "--resume", "--momentum", "0.5"]) == 0  # another one continues it


def test_a_resume_records_its_own_momentum(tmp_path, capsys):
    flags = [*ONE_STEP, "--optimizer", "sgd", "--out", str(tmp_path)]
    assert train_main([*flags, "--epochs", "1", "--momentum", "0"]) == 0
    assert train_main([*flags, "--epochs", "2", "--resume"]) == 0  # 0.9 from here: the checkpoint now has momentum
    capsys.readouterr()
    assert refusal(capsys, [*flags, "--epochs", "3", "--resume", "--momentum", "0"]).startswith(
        "--resume needs a --momentum above 0: the checkpoint was trained with --momentum 0.9 ")


def test_a_damaged_checkpoint_says_to_start_over_not_to_restore_an_earlier_one(tmp_path, capsys):
    flags = [*ONE_STEP, "--epochs", "1", "--out", str(tmp_path)]
    assert train_main(flags) == 0
    damaged = bytearray((tmp_path / "ckpt").read_bytes())
    damaged[-10:] = b"\xff" * 10
    (tmp_path / "ckpt").write_bytes(bytes(damaged))
    capsys.readouterr()
    message = refusal(capsys, [*flags, "--resume"])
    assert message.startswith(f"--resume: Checkpoint {str(tmp_path / 'ckpt')!r} is corrupted")
    assert message.endswith("distrib train keeps only the last checkpoint: start over with --overwrite instead of "
                            "--resume.")
    assert "Restore an earlier checkpoint" not in message


# -- 6. the resume line under mpirun; 7. --help -----------------------------------------------------------

def test_the_resume_line_under_mpirun_asks_for_the_same_mpirun_command(tmp_path, capsys, monkeypatch):
    (tmp_path / "ckpt").write_bytes(b"")
    args = build_parser().parse_args(["--out", str(tmp_path)])
    argv = ["--epochs", "40", "--out", str(tmp_path), "--resume"]
    monkeypatch.setattr(train_module, "mpi_environment", lambda: ("Open MPI", 0, 3, 0, 3))
    train_module.stopped(args, argv, "interrupted.")
    assert capsys.readouterr().err == (
        f"\ndistrib train: interrupted. The last checkpoint is {tmp_path / 'ckpt'}; resume with the same mpirun "
        f"command (its options, any -np) ending in: distrib train --epochs 40 --out {tmp_path} --resume\n")
    monkeypatch.setattr(train_module, "mpi_environment", lambda: None)  # one process: the whole command, as before
    train_module.stopped(args, argv, "interrupted.")
    assert capsys.readouterr().err == (f"\ndistrib train: interrupted. The last checkpoint is {tmp_path / 'ckpt'}; "
                                       f"resume with: distrib train --epochs 40 --out {tmp_path} --resume\n")


def test_help_says_that_replicas_are_per_process_under_mpirun():
    text = " ".join(build_parser().format_help().split())
    assert "under mpirun, N emulated replicas per process (mpirun -np 2 ... --replicas 2: 4 in all)" in text


def test_weights_near_the_float32_limit_stop_the_run_in_one_line_without_warnings(tmp_path, capsys):
    # one step at this rate leaves finite weights near float32's limit: the accuracy overflows, the next loss is nan
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        status = train_main([*ONE_STEP, "--learning-rate", "3.4e38", "--epochs", "3", "--out", str(tmp_path)])
    assert status == 1
    assert "distrib train: the training loss became nan at step 2 (epoch 2), so training stopped" in \
        capsys.readouterr().err


def test_a_second_run_into_an_out_another_run_holds_is_refused_in_one_line(tmp_path, capsys):
    # two runs into one --out both trained, their checkpoints and histories interleaving
    import fcntl

    out = tmp_path / "run"
    out.mkdir()
    other = os.open(out, os.O_RDONLY)  # what the other run's process holds
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with pytest.raises(SystemExit) as exit_info:
            train_main(["--epochs", "1", "--out", str(out)])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"distrib train: error: --out is in use by another distrib train run: wait for it to end, or pass another "
            f"--out. Received: {str(out)!r}.")
        assert list(out.iterdir()) == []
    finally:
        os.close(other)
    assert train_main(["--epochs", "1", "--out", str(out)]) == 0  # free again: it runs, and lets go at its end
    assert train_main(["--epochs", "2", "--out", str(out), "--resume"]) == 0
