"""The examples refuse flags they cannot run with in one line naming the flag, as argparse refuses a bad flag,
and a step size that diverges is called that, not a difference between one replica and several."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).parents[1] / "examples"


def run_example(name: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / name), *flags], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, DISTRIB_BACKEND="cpu", DISTRIB_CPU_REPLICAS="2"))


@pytest.mark.parametrize("name, flags, message", [
    ("train_mlp.py", ("--batch-size", "5000"), "--batch-size must be at most the 1442 training rows. Received: 5000."),
    ("train_mlp.py", ("--batch-size", "0"), "--batch-size must be at least 1. Received: 0."),
    ("train_mlp.py", ("--epochs", "0"), "--epochs must be at least 1. Received: 0."),
    ("train_mlp.py", ("--learning-rate", "nan"), "--learning-rate must be a finite number above 0. Received: nan."),
    ("quickstart.py", ("--steps", "0"), "--steps must be at least 1. Received: 0."),
    ("quickstart.py", ("--replicas", "0"), "--replicas must be at least 1. Received: 0."),
    ("quickstart.py", ("--rows", "3"), "--rows must divide evenly over the 2 replicas. Received: 3."),
    ("quickstart.py", ("--lr", "inf"), "--lr must be a finite number above 0. Received: inf."),
    ("ps_embedding.py", ("--vocab", "0"), "--vocab must be at least 1. Received: 0."),
    ("ps_embedding.py", ("--bag", "0"), "--bag must be at least 1. Received: 0."),
])
def test_an_example_refuses_a_flag_it_cannot_run_with_naming_it(name, flags, message):
    done = run_example(name, *flags)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines()[-1] == f"{name}: error: {message}", done.stderr
    assert "Traceback" not in done.stderr


def test_the_quickstart_says_a_step_size_diverged_rather_than_the_replicas():
    done = run_example("quickstart.py", "--lr", "5", "--steps", "40", "--rows", "64")
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == "training diverged (the weights are not finite): a smaller --lr than 5.0 " \
                                           "converges", done.stderr
