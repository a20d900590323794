"""`distrib train` under faults: Ctrl-C says where the last checkpoint is and how to resume; a damaged history
does not stop a resume whose checkpoint is fine."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from support import interruptible

from distrib.cli.train import main as train_main

pytestmark = pytest.mark.timeout(120)


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_ctrl_c_abandons_the_step_names_the_checkpoint_and_exits_130(tmp_path):
    flags = ["--replicas", "2", "--epochs", "500", "--out", str(tmp_path)]
    with interruptible([sys.executable, "-m", "distrib", "train", *flags]) as process:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ckpt").exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "ckpt").exists(), process.stderr.read() if process.poll() is not None else "no checkpoint"
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    assert process.returncode == 130, err
    assert "Traceback" not in err
    resume = f"distrib train --replicas 2 --epochs 500 --out {tmp_path} --resume"
    assert f"The last checkpoint is {tmp_path / 'ckpt'}; resume with: {resume}" in err
    assert train_main(["--replicas", "2", "--epochs", "1", "--out", str(tmp_path), "--resume"]) == 0


def test_a_truncated_history_warns_and_the_resume_goes_on(tmp_path, capsys):
    assert train_main(["--replicas", "2", "--epochs", "1", "--out", str(tmp_path)]) == 0
    history = tmp_path / "history.json"
    history.write_text(history.read_text()[:20])
    capsys.readouterr()
    assert train_main(["--replicas", "2", "--epochs", "2", "--out", str(tmp_path), "--resume"]) == 0
    captured = capsys.readouterr()
    assert f"distrib train: {history} is damaged (" in captured.err
    assert "after 2 epochs" in captured.out
