"""`distrib train` under faults: Ctrl-C says where the last checkpoint is and how to resume, under mpirun too; a
damaged history does not stop a resume whose checkpoint is fine."""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings

import pytest
from support import MPIRUN, OPEN_MPI_5, interruptible, mpirun_env, needs_mpirun

from distrib.cli.train import main as train_main

pytestmark = pytest.mark.timeout(120)


def interrupted_after_the_first_checkpoint(command: list[str], out, env: dict | None = None):
    """Runs `command` until `out` holds a checkpoint, then sends it SIGINT (Ctrl-C); the process, its stdout and
    its stderr once it ended."""
    with interruptible(command, env) as process:
        deadline = time.monotonic() + 60
        while not (out / "ckpt").exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (out / "ckpt").exists(), process.stderr.read() if process.poll() is not None else "no checkpoint"
        process.send_signal(signal.SIGINT)
        return process, *process.communicate(timeout=30)


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_ctrl_c_abandons_the_step_names_the_checkpoint_and_exits_130(tmp_path):
    flags = ["--replicas", "2", "--epochs", "500", "--out", str(tmp_path)]
    process, out, err = interrupted_after_the_first_checkpoint([sys.executable, "-m", "distrib", "train", *flags],
                                                               tmp_path)
    assert process.returncode == 130, err
    assert "Traceback" not in err
    resume = f"distrib train --replicas 2 --epochs 500 --out {tmp_path} --resume"
    assert f"The last checkpoint is {tmp_path / 'ckpt'}; resume with: {resume}" in err
    assert train_main(["--replicas", "2", "--epochs", "1", "--out", str(tmp_path), "--resume"]) == 0


@needs_mpirun
def test_ctrl_c_on_mpirun_says_once_that_no_rank_failed_and_how_to_resume_under_mpirun(tmp_path):
    # the terminal's Ctrl-C reaches mpirun alone, which ends the ranks with SIGTERM
    flags = ["--epochs", "500", "--out", str(tmp_path)]
    process, out, err = interrupted_after_the_first_checkpoint(
        [MPIRUN, "-np", "2", sys.executable, "-m", "distrib", "train", *flags], tmp_path, mpirun_env())
    assert process.returncode == 1, err  # mpirun's status for a job it ended
    if OPEN_MPI_5:  # its mpirun discards what the ranks print after the Ctrl-C (README)
        return
    assert "Traceback" not in err and "MPI_ABORT" not in err
    reports = [line for line in err.splitlines() if line.startswith("distrib train: ")]
    assert len(reports) == 1, err  # rank 0's, in one line, whether it was in Python or inside an MPI call
    assert "no rank failed: mpirun itself was interrupted (Ctrl-C) or killed" in reports[0]
    # the ranks cannot see mpirun's own options (--oversubscribe, -x ...): the line asks for the same mpirun command
    assert reports[0].endswith(f" The last checkpoint is {tmp_path / 'ckpt'}; resume with the same mpirun command "
                               f"(its options, any -np) ending in: distrib train --epochs 500 --out {tmp_path} "
                               f"--resume")


def test_a_truncated_history_warns_and_the_resume_goes_on(tmp_path, capsys):
    assert train_main(["--replicas", "2", "--epochs", "1", "--out", str(tmp_path)]) == 0
    history = tmp_path / "history.json"
    history.write_text(history.read_text()[:20])
    capsys.readouterr()
    assert train_main(["--replicas", "2", "--epochs", "2", "--out", str(tmp_path), "--resume"]) == 0
    captured = capsys.readouterr()
    assert f"distrib train: {history} is damaged (" in captured.err
    assert "after 2 epochs" in captured.out


def test_a_loss_that_becomes_nan_stops_training_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    flags = ["--replicas", "2", "--out", str(tmp_path)]
    assert train_main([*flags, "--epochs", "1"]) == 0
    checkpoint = (tmp_path / "ckpt").read_bytes()
    history = (tmp_path / "history.json").read_text()
    capsys.readouterr()
    with warnings.catch_warnings():  # the one line below says it all: no NumPy overflow warnings before it
        warnings.simplefilter("error", RuntimeWarning)
        status = train_main([*flags, "--epochs", "3", "--resume", "--learning-rate", "1e30"])
    assert status == 1
    err = capsys.readouterr().err
    assert "distrib train: the training loss became nan at step " in err and "(epoch 2), so training stopped" in err
    assert f"The last checkpoint is {tmp_path / 'ckpt'}" in err
    assert (tmp_path / "ckpt").read_bytes() == checkpoint  # no NaN weights saved over it
    assert (tmp_path / "history.json").read_text() == history
