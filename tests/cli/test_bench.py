"""`distrib bench`: nccl-tests' flags, columns and bus-bandwidth factors, the host check, JSON and the plot."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
from support import interruptible

from distrib import backends, cli
from distrib.cli.bench import report
from distrib.cli.bench.runners import NumpySeries, RowSpec, count_wrong
from distrib.cli.bench.table import COLLECTIVES, Cell, bandwidths, footer, parse_size, row, sizes
from distrib.install_hint import pip_install

QUICK = ["-g", "4", "-b", "1K", "-e", "8K", "-f", "8", "-n", "2", "-w", "1"]


@pytest.fixture(autouse=True)
def on_the_emulator(monkeypatch):
    """The emulator's tables on every machine, as with DISTRIB_BACKEND=cpu: on one with a GPU, detection would
    pick it, and `-g 4` would ask for more GPUs than one machine may have."""
    monkeypatch.setenv("DISTRIB_BACKEND", "cpu")  # the subprocesses too
    monkeypatch.setattr(backends, "_DETECTED", [])  # detected again with it, and as before after the test


@pytest.mark.parametrize("name, factor", [("all_reduce", 1.5), ("all_gather", 0.75), ("reduce_scatter", 0.75),
                                          ("broadcast", 1.0), ("reduce", 1.0), ("batch_reduce", 1.5)])
def test_bus_bandwidth_factors_are_nccl_tests_on_4_ranks(name, factor):
    collective = COLLECTIVES[name]
    layout = collective.layout(4096, 4, 4)
    algbw, busbw = bandwidths(collective, layout, 1e-6, 4)  # 4096 B in 1 us
    assert algbw == pytest.approx(4.096)
    assert busbw == pytest.approx(4.096 * factor)


def test_layouts_follow_nccl_tests_counts():
    gather = COLLECTIVES["all_gather"].layout(1000, 4, 4)  # 250 floats: 62 per rank, 248 gathered
    assert (gather.send_count, gather.recv_count, gather.size, gather.count) == (62, 248, 992, 62)
    scatter = COLLECTIVES["reduce_scatter"].layout(1000, 4, 4)  # 62 per rank, rounded down to 16 bytes: 60
    assert (scatter.send_count, scatter.recv_count, scatter.size, scatter.count) == (240, 60, 960, 60)
    assert COLLECTIVES["all_reduce"].layout(10, 4, 8).count == 2


def test_a_row_has_nccl_tests_columns():
    collective = COLLECTIVES["broadcast"]
    line = row(collective, collective.layout(1 << 20, 2, 8), "half", "sum", 3, 8, [Cell(250.0, 2), Cell(12.5, None)])
    assert line.split() == ["1048576", "524288", "half", "none", "3", "250.0", "4.19", "4.19", "2",
                            "12.50", "83.89", "83.89", "N/A"]


def test_sizes_and_the_footer():
    assert sizes(8, 128, stepfactor=4) == [8, 32, 128]
    assert sizes(parse_size("1M"), parse_size("2.5M"), stepbytes=parse_size("512K")) == [1 << 20, 3 << 19, 2 << 20,
                                                                                          5 << 19]
    assert footer(0, [1.0, 2.0]) == "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 1.5 "
    with pytest.raises(ValueError, match="A size is a number of bytes"):
        parse_size("8X")


def test_wrong_counts_real_mismatches_against_the_host():
    spec = RowSpec(COLLECTIVES["reduce_scatter"], COLLECTIVES["reduce_scatter"].layout(256, 4, 4),
                   np.dtype(np.float32), "sum", 0, 4)
    prepared = NumpySeries().prepare(spec)
    outputs = prepared.outputs(prepared.step())
    assert count_wrong(outputs, spec.expected()) == 0
    outputs[2] = outputs[2].copy()
    outputs[2][[0, 5]] += 1
    assert count_wrong(outputs, spec.expected()) == 2


def run_bench(args, capsys):
    status = cli.main(["bench", *args])
    return status, capsys.readouterr().out


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce"])
def test_every_collective_prints_a_checked_table_on_the_emulator(collective, capsys):
    status, out = run_bench([collective, *QUICK, "-r", "1"], capsys)
    assert status == 0
    assert "EMULATED" in out and "# Out of bounds values : 0 OK" in out
    rows = [line.split() for line in out.splitlines() if not line.startswith("#")]
    assert [r[0] for r in rows][0] in ("1024", "1008", "960", "1020") and len(rows) == 2
    assert all(r[8] == "0" for r in rows)  # distrib's #wrong


def test_flags_with_nccl_tests_meanings(tmp_path, capsys):
    status, out = run_bench(["all_reduce", "-g", "2", "-b", "64", "-e", "256", "-f", "2", "-n", "3", "-w", "0",
                             "-c", "0", "-d", "half", "-o", "avg", "--json", str(tmp_path / "r.json")], capsys)
    assert status == 0
    rows = [line.split() for line in out.splitlines() if not line.startswith("#")]
    assert [(r[0], r[1], r[2], r[3], r[8]) for r in rows] == [("64", "32", "half", "avg", "N/A"),
                                                              ("128", "64", "half", "avg", "N/A"),
                                                              ("256", "128", "half", "avg", "N/A")]
    settings = json.loads((tmp_path / "r.json").read_text())["settings"]
    assert (settings["iters"], settings["warmup_iters"], settings["check"], settings["ngpus"]) == (3, 0, 0, 2)


@pytest.mark.parametrize("flags, message", [
    (["-o", "prod"], "-o prod is an nccl-tests op that distrib does not have"),
    (["-d", "int32", "-o", "avg"], "-o avg needs a floating type"),
    (["-b", "1M", "-e", "1K"], "invalid sizes for 'minbytes' and 'maxbytes'"),
    (["-n", "0"], "-n must be at least 1"),
    (["-g", "0"], "-g must be at least 1"),
])
def test_flags_distrib_cannot_honour_exit_with_the_reason(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "all_reduce", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("env, message", [
    ({"DISTRIB_BACKEND": "gpu"}, "distrib bench: error: DISTRIB_BACKEND must be 'cpu' or 'cuda'. Received: 'gpu'."),
    ({"DISTRIB_BACKEND": "cpu", "DISTRIB_CPU_REPLICAS": "0"},
     "distrib bench: error: DISTRIB_CPU_REPLICAS must be a positive integer. Received: '0'."),
])
def test_an_environment_distrib_cannot_use_exits_with_one_line(env, message):
    result = subprocess.run([sys.executable, "-m", "distrib", "bench", "all_reduce", *QUICK], capture_output=True,
                            text=True, timeout=120, env={**os.environ, **env})
    assert (result.returncode, result.stderr.strip().splitlines()[-1]) == (2, message)
    assert "Traceback" not in result.stderr


def test_output_files_are_checked_before_measuring(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    for flag in ("--json", "--plot"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["bench", "all_reduce", *QUICK, flag, str(tmp_path / "a_file" / "r")])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"distrib bench: error: {flag} must name a file distrib bench can write. Received: ")
    program = ("import sys; sys.modules['matplotlib'] = None; from distrib import cli; "
               f"sys.exit(cli.main(['bench', 'all_reduce', '--plot', {str(tmp_path / 'r.png')!r}]))")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr.strip().splitlines()[-1]) == (
        2, f"distrib bench: error: --plot needs matplotlib: {pip_install('bench')}.")
    assert result.stdout == ""  # refused before the first row


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_ctrl_c_keeps_the_rows_printed_and_exits_130_in_one_line(tmp_path):
    with interruptible([sys.executable, "-m", "distrib", "bench", "all_reduce", "-g", "2", "-b", "1K", "-e", "256M",
                        "-n", "20", "--json", str(tmp_path / "r.json")]) as process:
        assert process.stdout.readline().startswith("# distrib bench all_reduce")
        for line in process.stdout:
            if line.strip()[:1].isdigit():  # the first measured row
                break
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert err.strip().splitlines()[-1] == f"distrib bench: interrupted; {tmp_path / 'r.json'} not written."
    assert "Traceback" not in err and not (tmp_path / "r.json").exists()


def test_json_follows_the_schema_and_the_plot_is_a_png(tmp_path, capsys):
    status, out = run_bench(["batch_reduce", "-g", "2", "-b", "2K", "-e", "4K", "-n", "2", "-w", "1",
                             "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")], capsys)
    assert status == 0
    document = report.validate(json.loads((tmp_path / "b.json").read_text()))
    assert document["series"] == ["distrib packed", "distrib per array", "distrib bytes_per_pack=65536",
                                  "raw NumPy", "raw NumPy per array"]
    assert [r["size"] for r in document["rows"]] == [2048, 4096] and document["emulated"] is True
    assert document["wrong"] == 0 and document["rows"][0]["results"]["distrib packed"]["wrong"] == 0
    from matplotlib import image

    png = (tmp_path / "b.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and image.imread(tmp_path / "b.png").shape[2] in (3, 4)
    del document["rows"][0]["results"]["raw NumPy"]
    with pytest.raises(ValueError, match=r"rows\[0\].results needs one entry per series"):
        report.validate(document)
    with pytest.raises(ValueError, match="A distrib bench result needs wrong"):
        report.validate({k: v for k, v in document.items() if k != "wrong"})


def test_piped_output_is_plain_text():
    result = subprocess.run([sys.executable, "-m", "distrib", "bench", "broadcast", *QUICK], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("# distrib bench broadcast") and "\x1b[" not in result.stdout


def test_top_level_help_lists_every_command_and_version(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    help_text = capsys.readouterr().out
    assert all(f"    {name}" in help_text for name in ("train", "bench", "info"))
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.startswith("distrib 0.")


NCCL_TYPES = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double", "bfloat16"]


def table_rows(out):
    return [line.split() for line in out.splitlines() if line and not line.startswith("#")]


def test_d_all_runs_every_nccl_tests_type_in_turn_in_one_table(capsys):
    status, out = run_bench(["all_gather", "-g", "2", "-b", "1K", "-e", "4K", "-f", "4", "-n", "1", "-w", "0", "-d",
                             "all"], capsys)
    assert status == 0
    rows = table_rows(out)
    assert [(r[0], r[2], r[3]) for r in rows] == [(size, t, "none") for t in NCCL_TYPES for size in ("1024", "4096")]
    itemsize = {"int8": 1, "uint8": 1, "half": 2, "bfloat16": 2, "int32": 4, "uint32": 4, "float": 4}
    assert all(int(r[1]) == int(r[0]) // itemsize.get(r[2], 8) // 2 for r in rows)  # all_gather: count per rank
    assert all(r[8] == "0" for r in rows)
    assert out.count("#       size") == 1 and out.count("# Out of bounds values : 0 OK") == 1


def test_o_all_runs_sum_then_avg_per_type_and_lists_what_distrib_cannot(tmp_path, capsys):
    status, out = run_bench(["all_reduce", "-g", "3", "-b", "96", "-e", "96", "-n", "1", "-w", "0", "-d", "all",
                             "-o", "all", "--json", str(tmp_path / "all.json"), "--plot", str(tmp_path / "all.png")],
                            capsys)
    assert status == 0
    expected = [(t, op) for t in NCCL_TYPES for op in ("sum", "avg") if op == "sum" or t in ("half", "float", "double",
                                                                                          "bfloat16")]
    rows = table_rows(out)
    assert [(r[2], r[3]) for r in rows] == expected
    assert all(r[8] == "0" and r[12] == "0" for r in rows)  # distrib's and raw NumPy's #wrong
    assert "# -o all: sum avg (distrib's SUM and MEAN; nccl-tests' prod max min mulsum have no distrib op)" in out
    assert "# skipped int8/avg uint8/avg int32/avg uint32/avg int64/avg uint64/avg: -o avg needs a floating type" in out
    document = report.validate(json.loads((tmp_path / "all.json").read_text()))
    assert (document["type"], document["op"]) == ("all", "all")
    assert [(r["type"], r["redop"]) for r in document["rows"]] == expected
    assert (tmp_path / "all.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_o_all_on_one_type_and_what_cannot_run_at_all(capsys):
    status, out = run_bench(["reduce_scatter", "-g", "2", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0", "-o", "all"],
                            capsys)
    assert status == 0 and [(r[2], r[3]) for r in table_rows(out)] == [("float", "sum")]
    assert "# skipped float/avg: reduce_scatter sums only" in out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "reduce_scatter", "-d", "all", "-o", "avg"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("distrib bench: error: nothing to measure: reduce_scatter sums only")


def test_a_terminal_gets_a_rich_table_with_every_column(monkeypatch, capsys):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("COLUMNS", "300")
    status, out = run_bench(["all_reduce", *QUICK], capsys)
    assert status == 0
    lines = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out).splitlines()  # no colours or cursor moves
    [groups] = [line for line in lines if "distrib" in line and "raw NumPy in-place" in line and "┃" in line]
    assert [cell.strip() for cell in groups.split("┃")[1:-1]][5:17:4] == ["distrib", "raw NumPy",
                                                                           "raw NumPy in-place"]
    [names] = [line for line in lines if "#wrong" in line and "┃" in line]
    assert [cell.strip() for cell in names.split("┃")[1:-1]] == \
        ["size", "count", "type", "redop", "root"] + ["time", "algbw", "busbw", "#wrong"] * 3 + ["vs raw"]
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in lines if line.startswith("│")]
    assert [r[0] for r in rows] == ["1024", "8192"] and all(r[8] == "0" for r in rows)
