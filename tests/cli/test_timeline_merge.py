"""`distrib timeline merge`: the rank traces of one MPI job merged into one, lined up in time; anything else (a file
that is not a trace, a file or rank twice, a single process's trace, two jobs' traces) refused in one line naming
the file, exit status 2, before anything is written."""

from __future__ import annotations

import json

import pytest

from distrib import cli, timeline

LAUNCHER = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid",
            "SLURM_JOB_ID", "SLURM_STEP_ID", "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "PMIX_SIZE")


@pytest.fixture(autouse=True)
def outside_a_job(monkeypatch):
    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)


def trace_of(path, monkeypatch, rank: int | None = None, job: str = "4242", size: int = 2) -> str:
    """A trace as distrib writes it, with one all_reduce: rank `rank`'s of job `job` under mpirun (its file is
    named for the rank), or a single process's (rank None)."""
    with monkeypatch.context() as env:
        if rank is not None:
            env.setenv("OMPI_COMM_WORLD_RANK", str(rank))
            env.setenv("OMPI_COMM_WORLD_SIZE", str(size))
            env.setenv("PMIX_NAMESPACE", job)
        recorded = timeline.Timeline(path)
        recorded.add("all_reduce", "collective", 1_000, 2_000, ["CPU:0"], {"bytes": 4})
        return recorded.write()


def merge(capsys, *paths, out) -> tuple[int, list[str]]:
    status = cli.main(["timeline", "merge", *map(str, paths), "-o", str(out)])
    return status, capsys.readouterr().err.splitlines()


def test_the_rank_traces_of_one_job_merge_into_one(tmp_path, monkeypatch, capsys):
    ranks = [trace_of(tmp_path / "trace.json", monkeypatch, rank) for rank in (0, 1)]
    assert ranks == [str(tmp_path / "trace.rank0.json"), str(tmp_path / "trace.rank1.json")]
    assert merge(capsys, *ranks, out=tmp_path / "merged.json") == (0, [])
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert sorted(e["pid"] for e in merged["traceEvents"] if e["ph"] == "X") == [0, 1]
    assert merged["otherData"] == {"producer": "distrib", "clock": "wall", "job": "4242", "job_size": 2,
                                   "ranks": [0, 1]}
    # traces of an older distrib, without otherData, are told apart by their process names
    for path in ranks:
        trace = json.loads(open(path).read())
        del trace["otherData"]
        open(path, "w").write(json.dumps(trace))
    assert merge(capsys, *ranks, out=tmp_path / "merged.json") == (0, [])


def test_the_line_that_says_what_was_written_counts_the_traces(tmp_path, monkeypatch, capsys):
    # "(1 traces)"
    single = trace_of(tmp_path / "single.json", monkeypatch)
    assert cli.main(["timeline", "merge", single, "-o", str(tmp_path / "m1.json")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'm1.json'} (1 trace)\n"
    ranks = [trace_of(tmp_path / "trace.json", monkeypatch, rank) for rank in (0, 1)]
    assert cli.main(["timeline", "merge", *ranks, "-o", str(tmp_path / "m2.json")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'm2.json'} (2 traces)\n"


@pytest.mark.parametrize("text, why", [
    ('{"traceEvents": "abc"}', '"traceEvents" is a string, not a list'),
    ('{"traceEvents": [1, 2]}', 'event 0 is 1, not an object with a "ph"'),
    ('[1, 2]', "a JSON list, not an object"),
    ('{"events": []}', 'no "traceEvents"'),
    ('{"traceEvents": [{"name": "x", "ts": 1}]}', 'event 0 is {"name": "x", "ts": 1}, not an object with a "ph"'),
    ('{"traceEvents": [{"name": "x", "ph": "X", "ts": "soon"}]}', "event 0's 'ts' is \"soon\", not a number"),
    ("trace", "not JSON: Expecting value: line 1 column 1 (char 0)"),
])
def test_a_file_that_is_not_a_trace_is_refused_naming_it(tmp_path, monkeypatch, capsys, text, why):
    # {"traceEvents": "abc"} merged into ["a", "b", "c"] and {"traceEvents": [1, 2]} into [1, 2], with status 0
    rank0 = trace_of(tmp_path / "trace.json", monkeypatch, 0)
    (tmp_path / "bad.json").write_text(text)
    assert merge(capsys, rank0, tmp_path / "bad.json", out=tmp_path / "merged.json") == (2, [
        f"distrib timeline merge: A timeline to merge must be a trace distrib wrote (a JSON object whose "
        f"\"traceEvents\" is a list of events). Received: {str(tmp_path / 'bad.json')!r} ({why})."])
    assert not (tmp_path / "merged.json").exists()


def test_the_same_file_twice_is_refused(tmp_path, monkeypatch, capsys):
    # its spans were in the merged trace twice
    rank0, rank1 = (trace_of(tmp_path / "trace.json", monkeypatch, rank) for rank in (0, 1))
    again = str(tmp_path / "." / "trace.rank0.json")  # another name for it
    assert merge(capsys, rank0, rank1, again, out=tmp_path / "merged.json") == (2, [
        f"distrib timeline merge: A timeline to merge must be named once: its spans would be in the merged trace "
        f"twice. Received: {again!r} (the file {rank0!r} names)."])
    assert not (tmp_path / "merged.json").exists()


def test_one_rank_twice_is_refused(tmp_path, monkeypatch, capsys):
    first = trace_of(tmp_path / "a" / "trace.json", monkeypatch, 0)
    second = trace_of(tmp_path / "b" / "trace.json", monkeypatch, 0)
    assert merge(capsys, first, second, out=tmp_path / "merged.json") == (2, [
        f"distrib timeline merge: Timelines to merge must hold each rank once: its spans would be in the merged "
        f"trace twice. Received: rank 0 in both {first!r} and {second!r}."])


def test_traces_of_two_jobs_are_refused(tmp_path, monkeypatch, capsys):
    first = trace_of(tmp_path / "a" / "trace.json", monkeypatch, 0, job="11")
    second = trace_of(tmp_path / "b" / "trace.json", monkeypatch, 1, job="12")
    assert merge(capsys, first, second, out=tmp_path / "merged.json") == (2, [
        f"distrib timeline merge: Timelines to merge must be the rank traces of one MPI job. Received: {first!r} and "
        f"{second!r}, of different jobs (job 11 and 12)."])
    third = trace_of(tmp_path / "c" / "trace.json", monkeypatch, 1, job="11", size=3)  # the same id, reused
    status, err = merge(capsys, first, third, out=tmp_path / "merged.json")
    assert status == 2 and err[0].endswith(f"{third!r}, of different jobs (number of ranks 2 and 3).")
    assert not (tmp_path / "merged.json").exists()


def test_traces_of_single_processes_are_not_lined_up_with_another(tmp_path, monkeypatch, capsys):
    # each is timed from the start of its own recording: merged, their spans overlapped as if they ran together
    one, two = (trace_of(tmp_path / name, monkeypatch) for name in ("one.json", "two.json"))
    assert merge(capsys, one, two, out=tmp_path / "merged.json") == (2, [
        f"distrib timeline merge: Timelines to merge must be the rank traces of one MPI job (trace.rank<N>.json, "
        f"from DISTRIB_TIMELINE or start_timeline under mpirun). Received: {one!r} (a single process's trace, timed "
        f"from the start of its own recording: it lines up with no other)."])
    rank0 = trace_of(tmp_path / "trace.json", monkeypatch, 0)
    assert merge(capsys, rank0, two, out=tmp_path / "merged.json")[0] == 2
    assert not (tmp_path / "merged.json").exists()
    assert merge(capsys, one, out=tmp_path / "merged.json") == (0, [])  # alone, it needs no lining up
