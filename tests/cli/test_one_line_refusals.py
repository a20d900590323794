"""What the `distrib` command refuses, it refuses in one line with exit status 2 (README: a flag or environment
variable it cannot use is refused in one line naming it, the rule and what it received): argparse's errors of every
subcommand, output paths under a file, and $DISTRIB_MPI_ANNOUNCEMENTS."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from support import MPIRUN, mpirun_env, needs_mpirun

from distrib import backends, cli

MULTI_WORKER = pathlib.Path(__file__).resolve().parents[1] / "multi_worker"
QUICK = ["-g", "2", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0"]


@pytest.fixture(autouse=True)
def on_the_emulator(monkeypatch):
    monkeypatch.setenv("DISTRIB_BACKEND", "cpu")
    monkeypatch.setattr(backends, "_DETECTED", [])


@pytest.mark.parametrize("argv, message", [
    (["bench", "foo"], "distrib bench: error: argument collective: invalid choice: 'foo' (choose from "),
    (["bench", "all_reduce", "-f", "1.5"], "distrib bench: error: argument -f/--stepfactor: invalid int value: '1.5'"),
    (["bench", "all_reduce", "-b", "abc"], "distrib bench: error: argument -b/--minbytes: A size is a number of bytes"),
    (["bench"], "distrib bench: error: the following arguments are required: collective"),
    # a hundred million devices ran out of memory building their names
    (["bench", "all_reduce", "-g", "100000000"], "distrib bench: error: -g must be at most 4096: each device's "
                                                 "replica is a thread of this process. Received: 100000000."),
    (["timeline"], "distrib timeline: error: the following arguments are required: ACTION"),
    (["timeline", "merge", "t.json"], "distrib timeline merge: error: the following arguments are required: "
                                      "-o/--output"),
    # an argument a subcommand does not know was refused by "distrib:", as if the command itself had not known it
    (["info", "--bogus"], "distrib info: error: unrecognized arguments: --bogus"),
    (["bench", "all_reduce", "extra"], "distrib bench: error: unrecognized arguments: extra"),
    (["timeline", "merge", "t.json", "-o", "m.json", "--x"], "distrib timeline merge: error: unrecognized arguments: "
                                                             "--x"),
    (["train", "--out", ""], "distrib train: error: argument --out: an empty path names no directory (pass . for the "
                             "current one)"),
    (["bogus"], "distrib: error: argument COMMAND: invalid choice: 'bogus' (choose from "),
])
def test_an_argument_argparse_refuses_is_one_line_without_the_usage(argv, message, capsys):
    # distrib bench printed its 7-line usage first (distrib train's OneLineParser did not)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(message), err


def test_a_file_where_a_folder_of_json_or_plot_must_be_is_named(tmp_path, capsys):
    # mkdir's "(File exists)" named nothing
    (tmp_path / "afile").write_text("")
    for flag, name in (("--json", "x.json"), ("--plot", "sub/x.png")):
        path = str(tmp_path / "afile" / name)
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["bench", "all_reduce", *QUICK, flag, path])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.splitlines() == [
            f"distrib bench: error: {flag} must name a file distrib bench can write. Received: {path!r} "
            f"({str(tmp_path / 'afile')!r} is a file, not a folder)."]
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]


REFUSED = "ValueError: DISTRIB_MPI_ANNOUNCEMENTS must be 'shared-memory' or 'messages'. Received: {!r}."


@needs_mpirun
@pytest.mark.parametrize("value, announced", [
    ("foo", None), ("1", None), ("Messages", "messages"), (" SHARED-MEMORY ", "shared-memory"),
    ("", "shared-memory"),
])
def test_mpi_announcements_take_the_documented_values_in_any_case_and_refuse_the_rest(tmp_path, value, announced):
    # any value but "messages" meant shared memory, silently ("Messages" and typos included)
    done = subprocess.run([MPIRUN, "-np", "2", sys.executable, str(MULTI_WORKER / "announcement_values.py"),
                           str(tmp_path / "report")], capture_output=True, text=True, timeout=120,
                          env=mpirun_env(DISTRIB_CPU_REPLICAS="1", DISTRIB_MPI_ANNOUNCEMENTS=value))
    assert done.returncode == 0, done.stderr
    reports = [json.loads((tmp_path / f"report.{rank}").read_text()) for rank in (0, 1)]
    expected = {"error": REFUSED.format(value)} if announced is None else {"announcements": announced, "sum": 2.0}
    assert reports == [expected, expected]


@needs_mpirun
def test_distrib_bench_refuses_mpi_announcements_it_cannot_use_in_one_line():
    done = subprocess.run([MPIRUN, "-np", "2", sys.executable, "-m", "distrib", "bench", "all_reduce", *QUICK],
                          capture_output=True, text=True, timeout=120,
                          env=mpirun_env(DISTRIB_CPU_REPLICAS="1", DISTRIB_MPI_ANNOUNCEMENTS="foo"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("distrib bench")]  # by rank 0 alone
    assert said == ["distrib bench: error: " + REFUSED.format("foo").removeprefix("ValueError: ")]


@needs_mpirun
@pytest.mark.parametrize("flags, message", [
    (["--epochs", "0"], "distrib train: error: --epochs must be at least 1. Received: 0."),
    (["--bogus"], "distrib train: error: unrecognized arguments: --bogus"),
    # refused after the job agreed on its replicas, by every rank alike: it was said once per rank
    (["--global-batch-size", "63"], "distrib train: error: --global-batch-size must divide evenly over the 2 "
                                    "replicas, so that every replica's batch mean weighs rows equally. Received: 63."),
])
def test_distrib_train_under_mpirun_says_a_bad_flag_once_not_once_per_rank(tmp_path, flags, message):
    done = subprocess.run([MPIRUN, "-np", "2", sys.executable, "-m", "distrib", "train", "--out", str(tmp_path / "run"),
                           *flags], capture_output=True, text=True, timeout=120,
                          env=mpirun_env(DISTRIB_CPU_REPLICAS="1"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("distrib train")] == [message]


@pytest.mark.parametrize("argv", [["info"], ["bench", "all_reduce", *QUICK]])
def test_a_command_started_with_its_output_closed_runs_without_a_traceback(argv):
    # `distrib info >&-` ended in AttributeError: 'NoneType' object has no attribute 'isatty'
    import os

    done = subprocess.run([sys.executable, "-m", "distrib", *argv], capture_output=False, stderr=subprocess.PIPE,
                          text=True, timeout=120, env={**os.environ, "DISTRIB_BACKEND": "cpu"},
                          preexec_fn=lambda: os.close(1))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.skipif(not pathlib.Path("/dev/full").exists(), reason="needs /dev/full, a device every write fails on")
@pytest.mark.parametrize("argv", [["info"], ["--version"], ["bench", "all_reduce", *QUICK]])
def test_output_that_cannot_be_written_is_said_once_and_exits_1(argv):
    # `distrib info > /dev/full` ended in an OSError traceback; `distrib --version > /dev/full` exited 0, its
    # output lost
    import os

    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "distrib", *argv], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120, env={**os.environ, "DISTRIB_BACKEND": "cpu"})
    assert done.returncode == 1, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("distrib: cannot write")]
    assert said == ["distrib: cannot write its output ([Errno 28] No space left on device); the rest of it is "
                    "dropped."], done.stderr
    assert "Traceback" not in done.stderr


def test_ctrl_c_while_distrib_train_finds_its_devices_is_one_line(tmp_path, monkeypatch, capsys):
    # a Ctrl-C before the first epoch (CuPy's import) printed a 30-line traceback
    from distrib.cli import train

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "make_strategy", interrupted)
    assert train.main(["--out", str(tmp_path / "run")]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "distrib train: interrupted before training started; " \
                                                       "nothing was trained."


@pytest.mark.parametrize("flags, message", [
    (["--json", ""], "--json needs a file name. Received: ''."),
    (["--plot", " "], "--plot needs a file name. Received: ' '."),
    (["--json", "same.png", "--plot", "same.png"], "--json and --plot must name different files: the plot would "
                                                   "replace the results. Received: 'same.png' for both."),
])
def test_bench_refuses_an_empty_output_name_or_one_file_for_both_outputs(flags, message, capsys, tmp_path,
                                                                         monkeypatch):
    # an empty name wrote nothing silently; one file for both kept the plot and lost the results it reported
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "all_reduce", *QUICK, *flags])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"distrib bench: error: {message}"
    assert list(tmp_path.iterdir()) == []
