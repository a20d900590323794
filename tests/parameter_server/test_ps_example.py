"""examples/ps_embedding.py runs as written, shortened, and its model learns."""

from __future__ import annotations

import pathlib
import re
import runpy
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "ps_embedding.py"


@pytest.mark.timeout(120)
def test_the_embedding_example_trains_a_sharded_table(ray_cluster, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--vocab", "5000", "--steps", "150", "--batch-size", "256"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    printed = capsys.readouterr().out
    assert "shards=2 rows=[2500, 2500]" in printed and "on ['/job:ps/task:0', '/job:ps/task:1']" in printed
    accuracy = float(re.search(r"test accuracy ([\d.]+)%", printed).group(1))
    assert accuracy > 70, printed


@pytest.mark.timeout(120)
def test_the_embedding_example_runs_a_table_too_small_to_shard_and_fewer_steps_than_it_reports(
        ray_cluster, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--vocab", "200", "--steps", "3", "--batch-size", "16"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    printed = capsys.readouterr().out
    assert "on ['/job:ps/task:0']" in printed  # 12.8 KB: one piece, on one server
    assert [line.split()[1] for line in printed.splitlines() if line.startswith("step ")] == ["0", "1", "2"]
