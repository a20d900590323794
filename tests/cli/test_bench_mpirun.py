"""`distrib bench` under `mpirun -np 2`: 2 processes x 2 emulated devices are 4 ranks of every collective, rank 0
alone prints nccl-tests' table listing every rank, busbw uses n = 4, raw mpi4py runs beside distrib on the same
buffers, and #wrong is checked on every rank."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from support import MPIRUN, mpirun_env, needs_mpirun

from distrib.cli.bench import report
from distrib.cli.bench.table import COLLECTIVES, bandwidths
from distrib.install_hint import pip_install

JOB = pathlib.Path(__file__).parents[1] / "multi_worker" / "bench_job.py"
pytestmark = needs_mpirun
NAMES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "batch_reduce")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    done = subprocess.run([MPIRUN, "-np", "2", sys.executable, str(JOB), str(folder)], env=mpirun_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    tables = dict(zip(NAMES, ("# distrib bench " + part for part in done.stdout.split("# distrib bench ")[1:])))
    assert "distrib bench: error: under mpirun, broadcast's root must be one of rank 0's 2 devices" in done.stderr
    return tables, {name: json.loads((folder / f"{name}.json").read_text()) for name in NAMES + ("corrupted",)}


def test_rank_0_alone_prints_one_table_per_collective_listing_every_rank(job):
    tables, _ = job
    assert list(tables) == list(NAMES)
    for text in tables.values():
        assert "cpu-emulated, 2 processes x 2 emulated devices" in text and "EMULATED" in text
        ranks = [line.split() for line in text.splitlines() if line.startswith("#  Rank")]
        assert [int(r[2]) for r in ranks] == [0, 1, 2, 3]
        assert len({r[4] for r in ranks[:2]} | {r[4] for r in ranks[2:]}) == 2  # two pids, two devices each
        assert "# Out of bounds values : 0 OK" in text


def test_columns_and_raw_mpi4py_beside_distrib(job):
    tables, documents = job
    lines = tables["all_reduce"].splitlines()
    titles = next(line for line in lines if "raw mpi4py" in line)
    assert titles.split() == ["#", "distrib", "raw", "mpi4py", "raw", "mpi4py", "in-place"]
    names = next(line for line in lines if line.startswith("#       size"))
    assert names.split()[1:6] == ["size", "count", "type", "redop", "root"]
    assert names.split()[6:] == ["time", "algbw", "busbw", "#wrong"] * 3 + ["vs", "raw"]
    rows = [line.split() for line in lines if line and not line.startswith("#")]
    assert [(r[0], r[1], r[2], r[3], r[4]) for r in rows] == [("1024", "256", "float", "sum", "-1"),
                                                              ("4096", "1024", "float", "sum", "-1")]
    assert documents["batch_reduce"]["series"] == ["distrib packed", "distrib per array",
                                                   "distrib bytes_per_pack=65536", "raw mpi4py",
                                                   "raw mpi4py per array"]


@pytest.mark.parametrize("name", NAMES)
def test_every_rank_checked_and_bus_bandwidth_over_4_ranks(job, name):
    document = report.validate(job[1][name])
    assert (document["ranks"], document["processes"], document["wrong"]) == (4, 2, 0)
    collective = COLLECTIVES[name]
    for row in document["rows"]:
        layout = collective.layout(row["size"], 4, 4)
        assert (layout.size, layout.count) == (row["size"], row["count"])
        for series, result in row["results"].items():
            assert result["wrong"] == 0, (series, row["size"])
            algbw, busbw = bandwidths(collective, layout, result["time_us"] / 1e6, 4)
            assert result["busbw_GBps"] == pytest.approx(busbw)
            assert busbw == pytest.approx(algbw * {"all_reduce": 1.5, "batch_reduce": 1.5, "all_gather": 0.75,
                                                   "reduce_scatter": 0.75}.get(name, 1.0))
    if name == "reduce":
        assert (document["rows"][0]["root"], document["rows"][0]["redop"]) == (3, "avg")  # rank 3: on process 1


def test_a_wrong_element_on_rank_1_is_counted_in_rank_0s_table(job):
    tables, documents = job
    document = documents["corrupted"]
    [row] = document["rows"]
    assert [row["results"][name]["wrong"] for name in document["series"]] == [0, 3, 3]
    assert document["wrong"] == 2  # measurements with a wrong element, as nccl-tests' "Out of bounds values"


def in_a_terminal(command: list[str], env: dict) -> str:
    """What `command` writes when its output is a pseudo-terminal, as an MPI launcher's ranks get."""
    import pty

    leader, follower = pty.openpty()
    process = subprocess.Popen(command, stdout=follower, stderr=follower, stdin=subprocess.DEVNULL, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: every process writing to it has exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert process.wait(timeout=120) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


def test_under_mpirun_bench_and_info_print_plain_text_on_the_launchers_terminal():
    env = dict(os.environ, DISTRIB_CPU_REPLICAS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    distrib_cli = [sys.executable, "-m", "distrib"]
    bench = in_a_terminal([MPIRUN, "-np", "1", *distrib_cli, "bench", "all_reduce", "-b", "8", "-e", "64",
                           "-n", "2", "-w", "1"], env)
    info = in_a_terminal([MPIRUN, "-np", "1", *distrib_cli, "info"], env)
    for output in (bench, info):
        assert "\x1b[" not in output  # no colour, no redrawn progress bar: the terminal is the job's log
    assert "# Avg bus bandwidth    : " in bench and "backend" in info


def test_without_mpi4py_every_rank_says_what_to_install_in_one_line(tmp_path):
    # a module named mpi4py that cannot be imported, ahead of the installed one: what a machine without it shows
    (tmp_path / "mpi4py").mkdir()
    (tmp_path / "mpi4py" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'mpi4py'\", "
                                                     "name='mpi4py')\n")
    done = subprocess.run([MPIRUN, "-np", "2", sys.executable, "-m", "distrib", "bench", "all_reduce", "-e", "64"],
                          env=mpirun_env(PYTHONPATH=str(tmp_path)), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("distrib bench: error: ")]
    assert errors and all(line.startswith(f"distrib bench: error: Multi-worker strategies need mpi4py and an MPI "
                                          f"library: {pip_install('mpi')}") for line in errors)


@pytest.mark.parametrize("flags, message", [
    (["-o", "prod"], "distrib bench: error: -o prod is an nccl-tests op that distrib does not have"),
    (["-b", "1X"], "distrib bench: error: argument -b/--minbytes: A size is a number of bytes"),
    (["-e", "64", "--json", "/"], "distrib bench: error: --json must name a file distrib bench can write"),
])
def test_a_user_error_is_said_once_by_rank_0_and_every_rank_exits_2(flags, message):
    done = subprocess.run([MPIRUN, "-np", "2", sys.executable, "-m", "distrib", "bench", "all_reduce", "-g", "1",
                           *flags], env=mpirun_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("distrib bench: error: ")]
    assert len(errors) == 1 and errors[0].startswith(message), done.stderr
