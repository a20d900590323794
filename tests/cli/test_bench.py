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
    gather = COLLECTIVES["all_gather"].layout(1000, 4, 4)  # 250 floats: 62 per rank, rounded down to 16 bytes: 60
    assert (gather.send_count, gather.recv_count, gather.size, gather.count) == (60, 240, 960, 60)
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
    assert footer(2, []) == "# Out of bounds values : 2 FAILED\n# Avg bus bandwidth    : 0 "


def test_sizes_read_as_nccl_tests_reads_them():
    assert [parse_size(t) for t in ("8", "1KB", "64KiB", "1.5M", "2mb", "1G", "1 K")] == \
        [8, 1024, 64 << 10, 3 << 19, 2 << 20, 1 << 30, 1024]
    for text in ("8X", "1KX", "K", "-1"):
        with pytest.raises(ValueError, match="A size is a number of bytes"):
            parse_size(text)


def test_a_size_argparse_cannot_read_says_what_a_size_is(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "all_reduce", "-b", "1X"])
    assert exit_info.value.code == 2
    assert "error: argument -b/--minbytes: A size is a number of bytes with an optional K, M or G suffix" in \
        capsys.readouterr().err


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
     "distrib bench: error: DISTRIB_CPU_REPLICAS must be a positive integer of at most 4096 (each emulated replica "
     "is a thread of this process). Received: '0'."),
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
            cli.main(["bench", "all_reduce", *QUICK, flag, str(tmp_path / "a_file" / "r.png")])
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


def plain(out):
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)


@pytest.mark.parametrize("collective, columns", [("all_reduce", "80"), ("all_reduce", "120"), ("batch_reduce", "200")])
def test_a_narrow_terminal_never_cuts_a_number(collective, columns, monkeypatch, capsys):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("COLUMNS", columns)
    status, out = run_bench([collective, "-g", "2", "-b", "1M", "-e", "1M", "-n", "1", "-w", "0"], capsys)
    assert status == 0 and "…" not in out
    # a rich table that fits, or else nccl-tests' text, which the terminal wraps whole
    rows = [line.replace("│", " ").split() for line in plain(out).splitlines() if re.match(r"│? *\d", line)]
    assert [r[:5] for r in rows] == [["1048576", "262144", "float", "sum", "-1"]]
    assert len(rows[0]) == 5 + 4 * (5 if collective == "batch_reduce" else 3) + 1
    assert "# Out of bounds values : 0 OK" in out


def reported(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *argv])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == ""  # refused before the first row
    [line] = captured.err.strip().splitlines()
    return line


@pytest.mark.parametrize("argv, message", [
    (["all_reduce", "-f", "1", "-i", "0"],
     "-f 1 steps the sizes by -i, which must be at least 1 byte. Received: -i 0."),
    (["batch_reduce", "--bytes-per-pack", "64X"], "--bytes-per-pack takes comma-separated sizes: A size is a number"),
    (["batch_reduce", "--array-bytes", "3", "-b", "4K", "-e", "4K"],
     "--array-bytes must hold one element of each type measured (4 bytes for float). Received: 3."),
    (["batch_reduce", "-d", "all", "--array-bytes", "2"],
     "--array-bytes must hold one element of each type measured (8 bytes for int64). Received: 2."),
    (["batch_reduce", "-b", "8", "-e", "512"], "batch_reduce's rows hold whole arrays: -e must be at least"),
    (["all_reduce", "--plot", "p.xyz"], "--plot needs a file name ending in a format matplotlib writes ("),
    (["all_reduce", "--plot", "plotnoext"], "--plot needs a file name ending in a format matplotlib writes ("),
    (["all_reduce", "-r", "-2"], "-r must be at least -1. Received: -2."),
])
def test_bad_input_is_one_line_before_the_first_measurement(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert reported(argv, capsys).startswith(f"distrib bench: error: {message}")
    assert not list(tmp_path.iterdir())


def test_a_directory_for_json_or_plot_is_refused_up_front(tmp_path, capsys):
    for flag, name in (("--json", "out"), ("--plot", "out.png")):
        (tmp_path / name).mkdir()
        assert reported(["all_reduce", *QUICK, flag, str(tmp_path / name)], capsys) == \
            f"distrib bench: error: {flag} must name a file distrib bench can write. Received: " \
            f"{str(tmp_path / name)!r} (it is a directory)."


def test_a_size_beyond_memory_is_refused_naming_both(tmp_path):
    # `ulimit -v` of 3 GiB: 16 GiB per rank cannot fit, and numpy would fail part-way
    program = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
               "from distrib import cli; "
               "sys.exit(cli.main(['bench', 'all_reduce', '-g', '2', '-b', '16G', '-e', '16G']))")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr
    assert re.fullmatch(r"distrib bench: error: -e 17179869184 needs at least 128\.0 GiB of memory in this process, "
                        r"more than the \d+\.\d GiB free \(nccl-tests would lower -e to fit\): use a smaller -e\. "
                        r"Received: -e 17179869184\.", result.stderr.strip().splitlines()[-1])


def test_running_out_of_memory_part_way_is_one_line(monkeypatch, capsys):
    prepare = NumpySeries.prepare

    def fails_at_2k(self, spec):
        if spec.layout.size >= 2048:
            raise MemoryError("Unable to allocate")
        return prepare(self, spec)

    monkeypatch.setattr(NumpySeries, "prepare", fails_at_2k)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "all_reduce", "-g", "2", "-b", "1K", "-e", "2K", "-n", "1", "-w", "0"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and table_rows(captured.out)[0][0] == "1024"  # the rows so far stand
    assert captured.err.strip().splitlines() == ["distrib bench: error: float rows of 2048 B do not fit in memory "
                                                 "(raw NumPy): use a smaller -e. Received: -e 2048."]


def off_by_one(monkeypatch, checks=None):
    """distrib's results with element 0 of every rank one too large; `checks` counts the checks made."""
    from distrib.cli.bench.runners import DistribSeries

    prepare = DistribSeries.prepare

    def corrupted(self, spec):
        prepared = prepare(self, spec)
        outputs = prepared.outputs

        def wrong(result):
            if checks is not None:
                checks.append(spec.layout.size)
            return [None if a is None else np.where(np.arange(a.size) == 0, a + 1, a).astype(a.dtype)
                    for a in outputs(result)]
        prepared.outputs = wrong
        return prepared

    monkeypatch.setattr(DistribSeries, "prepare", corrupted)


@pytest.mark.parametrize("dtype", ["half", "bfloat16"])
def test_one_wrong_element_per_rank_is_counted_in_16_bit_floats_on_32_ranks(dtype, monkeypatch, capsys):
    off_by_one(monkeypatch)
    status, out = run_bench(["all_reduce", "-g", "32", "-d", dtype, "-b", "64", "-e", "64", "-n", "1", "-w", "0"],
                            capsys)
    [r] = table_rows(out)
    assert status == 1 and (r[2], r[8], r[12]) == (dtype, "32", "0")  # distrib's #wrong, raw NumPy's


def test_sums_stay_exact_where_a_type_cannot_hold_7_per_rank():
    spec = RowSpec(COLLECTIVES["all_reduce"], COLLECTIVES["all_reduce"].layout(128, 2, 64), numpy_bfloat16(), "sum",
                   0, 64)
    assert spec.input_top == 4 and spec.tolerance == 0.0  # 64 ranks x 4 = 256: every partial sum exact in bfloat16
    prepared = NumpySeries().prepare(spec)
    assert count_wrong(prepared.outputs(prepared.step()), spec.expected()) == 0
    avg = RowSpec(COLLECTIVES["all_reduce"], spec.layout, np.dtype(np.float16), "avg", 0, 3)
    assert avg.tolerance == pytest.approx(2 * 2 ** -10)  # avg's division rounds: 2 units in the last place


def numpy_bfloat16():
    from distrib.cli.bench.sweep import numpy_dtype

    return numpy_dtype("bfloat16")


def test_c_reports_the_first_failing_checks_count_and_stops_there(tmp_path, monkeypatch, capsys):
    checks = []
    off_by_one(monkeypatch, checks)
    status, out = run_bench(["all_reduce", "-g", "3", "-b", "64", "-e", "128", "-n", "1", "-w", "0", "-c", "4",
                             "--json", str(tmp_path / "r.json")], capsys)
    assert status == 1
    assert [(r[0], r[8]) for r in table_rows(out)] == [("64", "3"), ("128", "3")]  # one check's count, not 4 x 3
    assert checks == [64, 128]  # the first check failed: no more of the 4
    assert "# Out of bounds values : 2 FAILED" in out  # measurements that failed, as nccl-tests counts
    assert json.loads((tmp_path / "r.json").read_text())["wrong"] == 2


def test_all_gather_rounds_each_ranks_part_to_16_bytes_as_nccl_tests(capsys):
    status, out = run_bench(["all_gather", "-d", "int8", "-g", "3", "-b", "8", "-e", "64", "-n", "1", "-w", "0"],
                            capsys)
    # count / 3 ranks = 2, 5, 10, 21 int8 per rank; & ~15: 0, 0, 0, 16; the size is the gathered 3 x that
    assert status == 0 and [(r[0], r[1], r[8]) for r in table_rows(out)] == [("0", "0", "0"), ("0", "0", "0"),
                                                                             ("0", "0", "0"), ("48", "16", "0")]
    whole = COLLECTIVES["broadcast"].layout(100, 8, 3)  # broadcast, reduce, all_reduce: count = size / itemsize
    assert (whole.send_count, whole.recv_count, whole.size) == (12, 12, 96)


def test_ctrl_c_on_a_terminal_shows_the_rows_measured_and_the_cursor(monkeypatch, capsys):
    from distrib.cli.bench import command

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("COLUMNS", "300")
    measure, calls = command.measure, []

    def interrupted_in_the_second_row(*args):
        calls.append(1)
        if len(calls) == 4:  # the second row's first series: 3 per row
            raise KeyboardInterrupt
        return measure(*args)

    monkeypatch.setattr(command, "measure", interrupted_in_the_second_row)
    status = cli.main(["bench", "all_reduce", *QUICK])
    captured = capsys.readouterr()
    assert status == 130 and captured.err.strip() == "distrib bench: interrupted."
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in plain(captured.out).splitlines()
            if line.startswith("│")]
    assert [r[0] for r in rows] == ["1024"] and rows[0][8] == "0"
    assert captured.out.rindex("\x1b[?25h") > captured.out.rindex("\x1b[?25l")  # the cursor shown again


def test_the_footer_is_nccl_tests_and_then_the_baseline(capsys):
    status, out = run_bench(["all_reduce", *QUICK], capsys)
    lines = out.splitlines()
    start = lines.index("# Out of bounds values : 0 OK")
    assert re.fullmatch(r"# Avg bus bandwidth    : [0-9.e+-]+ ", lines[start + 1])
    assert re.fullmatch(r"# Avg bus bandwidth \(raw NumPy, out-of-place and in-place\): [0-9.e+-]+ ",
                        lines[start + 2])
    assert lines[start + 3:] == ["#", "# Collective test concluded: distrib bench all_reduce"]


def test_one_rank_plots_algbw_as_busbw_is_0(tmp_path, monkeypatch, capsys):
    import warnings

    from matplotlib.axes import Axes

    drawn = []
    plot = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda self, *a, **k: drawn.append(k["label"]) or plot(self, *a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        status, out = run_bench(["all_gather", "-g", "1", "-b", "64", "-e", "256", "-n", "1", "-w", "0",
                                 "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "ag1.png")], capsys)
    assert status == 0 and f"# plot: {tmp_path / 'ag1.png'}" in out
    document = json.loads((tmp_path / "r.json").read_text())
    assert report.plotted_quantity(document) == "algbw_GBps"
    assert drawn == ["distrib", "raw NumPy"]  # raw NumPy in-place all_gather is N/A


def test_r_and_o_are_ignored_where_nccl_tests_ignores_them(capsys):
    status, out = run_bench(["all_reduce", "-g", "2", "-r", "5", "-b", "64", "-e", "64", "-n", "1", "-w", "0"], capsys)
    assert status == 0 and "# -r 5 ignored: all_reduce has no root (as in nccl-tests)" in out
    assert [r[4] for r in table_rows(out)] == ["-1"]
    status, out = run_bench(["all_gather", "-g", "2", "-o", "prod", "-b", "64", "-e", "64", "-n", "1", "-w", "0"],
                            capsys)
    assert status == 0 and "# -o prod ignored: all_gather has no reduction op (as in nccl-tests)" in out
    assert [r[3] for r in table_rows(out)] == ["none"]


@pytest.mark.parametrize("collective", ["reduce", "broadcast"])
def test_r_minus_1_sweeps_every_root_as_nccl_tests(collective, capsys):
    status, out = run_bench([collective, "-g", "3", "-r", "-1", "-b", "64", "-e", "128", "-n", "1", "-w", "0"],
                            capsys)
    assert status == 0
    assert [(r[0], r[4], r[8]) for r in table_rows(out)] == [(size, root, "0") for root in "012"
                                                             for size in ("64", "128")]


def test_raw_nccl_refills_are_finished_on_every_gpu_before_a_step(monkeypatch):
    """With a stand-in for CuPy (no GPU here): reset() copies on each GPU's default stream, which the non-blocking
    streams of the NCCL calls do not wait for, so it must wait for every GPU, not the first alone."""
    import types

    from distrib.cli.bench import cuda

    synchronized = []

    class Device:
        def __init__(self, ordinal):
            self.ordinal = ordinal

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def synchronize(self):
            synchronized.append(self.ordinal)

    class Array(np.ndarray):
        def set(self, host):
            self[...] = host

        @property
        def data(self):
            return types.SimpleNamespace(ptr=0)

    fake = types.SimpleNamespace(asarray=lambda a: np.array(a).view(Array),
                                 empty=lambda n, dtype: np.empty(n, dtype).view(Array),
                                 cuda=types.SimpleNamespace(Device=Device, Stream=lambda non_blocking: None))
    series = cuda.NcclSeries([0, 1, 2])
    series._comms, series._streams = [None] * 3, [None] * 3
    monkeypatch.setattr(series, "_setup", lambda: (fake, None))
    spec = RowSpec(COLLECTIVES["all_reduce"], COLLECTIVES["all_reduce"].layout(64, 4, 3), np.dtype(np.float32),
                   "sum", 0, 3)
    prepared = series.prepare(spec)
    synchronized.clear()
    prepared.reset()
    assert sorted(synchronized) == [0, 1, 2]
