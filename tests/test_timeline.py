"""The collective timeline: Chrome trace events of runs, merge_calls, collectives, packs and unpacks."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from support import MPIRUN, mpirun_env, needs_mpirun

import distrib
from distrib import timeline

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROGRAM = textwrap.dedent("""
    import numpy as np, distrib
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    def step():
        ctx = distrib.get_replica_context()
        a = ctx.all_reduce("SUM", np.ones(8, np.float32))
        b = ctx.all_gather(np.ones(2, np.float32), axis=0)
        return a, b
    for _ in range(4):
        strategy.run(step)
""")


def complete_events(trace: dict, category: str | None = None) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and category in (None, e["cat"])]


def track_names(trace: dict) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}


def test_the_environment_variable_records_a_whole_program(tmp_path):
    path = tmp_path / "trace.json"
    subprocess.run([sys.executable, "-c", PROGRAM], check=True, capture_output=True,
                   env={**os.environ, "DISTRIB_TIMELINE": str(path), "DISTRIB_BACKEND": "cpu"})
    trace = json.loads(path.read_text())
    names = track_names(trace)
    collectives = complete_events(trace, "collective")
    # 4 runs x (one all_reduce + one all_gather), one event per device each
    assert sorted((e["name"], names[e["tid"]]) for e in collectives) == sorted(
        (name, f"CPU:{d}") for name in ("all_reduce", "all_gather") for d in range(3) for _ in range(4))
    runs = [names[e["tid"]] for e in complete_events(trace, "run")]
    assert sorted(runs) == sorted(["MainThread"] * 4 + [f"replica {r}" for r in range(3) for _ in range(4)])
    merges = complete_events(trace, "merge_call")
    assert {e["name"] for e in merges} == {"all_reduce", "all_gather"}
    assert len(merges) == 4 * 2 * (3 + 1)  # each collective: one wait per replica, one merge on the caller


def test_events_are_chrome_trace_events_nested_in_their_run(tmp_path):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    strategy.start_timeline(str(tmp_path / "t.json"))
    try:
        strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", {"a": np.ones(3), "b": np.ones(2)}))
    finally:
        path = strategy.stop_timeline()
    trace = json.loads(open(path).read())
    events = complete_events(trace)
    assert all({"name", "cat", "ph", "ts", "dur", "pid", "tid"} <= set(e) for e in events)
    (run,) = [e for e in events if e["cat"] == "run" and track_names(trace)[e["tid"]] == "MainThread"]
    for event in events:
        assert run["ts"] <= event["ts"] and event["ts"] + event["dur"] <= run["ts"] + run["dur"] + 1e-3
    packs = [e for e in events if e["name"] == "pack"]
    assert [e["args"]["bytes"] for e in packs] == [40, 40]  # one packed float64 buffer of 5 values per device


def test_start_twice_is_an_error_and_stop_without_start_returns_none(tmp_path):
    timeline.start(tmp_path / "a.json")
    try:
        with pytest.raises(RuntimeError, match="A timeline is already recording"):
            timeline.start(tmp_path / "b.json")
    finally:
        assert timeline.stop() == str(tmp_path / "a.json")
    assert timeline.stop() is None
    assert not (tmp_path / "b.json").exists()


def test_a_path_that_cannot_be_written_is_refused_at_the_start_not_at_the_end(tmp_path):
    (tmp_path / "a_file").write_text("")
    path = tmp_path / "a_file" / "trace.json"  # a folder that cannot be made: a file holds its name
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    with pytest.raises(OSError, match=r"^A timeline needs a file it can write\. Received: '.*a_file/trace\.json'"):
        strategy.start_timeline(path)
    assert timeline.recording is None
    result = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                            env={**os.environ, "DISTRIB_TIMELINE": str(path), "DISTRIB_BACKEND": "cpu"})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"NotADirectoryError: DISTRIB_TIMELINE: A timeline needs a file it can write. Received: {str(path)!r} "
        f"({str(tmp_path / 'a_file')!r} is a file, not a folder).")


def test_a_folder_is_refused_at_the_start_and_by_the_environment_variable(tmp_path):
    folder = tmp_path / "traces"
    folder.mkdir()
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    with pytest.raises(IsADirectoryError, match=r"^A timeline needs a file it can write\. Received: "
                                                r"'.*/traces' \(a folder; name a file in it, such as trace\.json\)\.$"):
        strategy.start_timeline(folder)
    assert timeline.recording is None and os.listdir(tmp_path) == ["traces"] and os.listdir(folder) == []
    result = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                            env={**os.environ, "DISTRIB_TIMELINE": str(folder), "DISTRIB_BACKEND": "cpu"})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"IsADirectoryError: DISTRIB_TIMELINE: A timeline needs a file it can write. Received: {str(folder)!r} "
        f"(a folder")
    assert os.listdir(tmp_path) == ["traces"]


def test_a_bad_environment_variable_is_refused_by_the_first_strategy_not_by_import_distrib(tmp_path):
    # `import distrib` raised it, a 22-line traceback from timeline.py on every command, `distrib --version` too
    (tmp_path / "a_file").write_text("")
    for path, why in ((tmp_path, "(a folder; name a file in it, such as trace.json)."),
                      (tmp_path / "a_file" / "t.json", f"({str(tmp_path / 'a_file')!r} is a file, not a folder).")):
        program = textwrap.dedent("""
            import distrib
            print("imported")
            try:
                distrib.MirroredStrategy(["CPU:0", "CPU:1"])
            except OSError as exc:
                print(type(exc).__name__, exc)
            try:
                distrib.MirroredStrategy(["CPU:0", "CPU:1"])  # refused every time, not only the first
            except OSError as exc:
                print(type(exc).__name__, exc)
        """)
        result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                                env={**os.environ, "DISTRIB_TIMELINE": str(path), "DISTRIB_BACKEND": "cpu"})
        error = "IsADirectoryError" if path == tmp_path else "NotADirectoryError"
        line = f"{error} DISTRIB_TIMELINE: A timeline needs a file it can write. Received: {str(path)!r} {why}"
        assert (result.returncode, result.stdout.splitlines()) == (0, ["imported", line, line]), result.stderr
        for command, status, out in ((["--version"], 0, f"distrib {distrib.__version__}\n"), (["info"], 2, ""),
                                     (["train", "--epochs", "1"], 2, ""), (["bench", "all_reduce"], 2, ""),
                                     (["timeline", "merge", "a.json", "-o", "b.json"], 2, "")):
            result = subprocess.run([sys.executable, "-m", "distrib", *command], capture_output=True, text=True,
                                    cwd=tmp_path, timeout=120,
                                    env={**os.environ, "DISTRIB_TIMELINE": str(path), "DISTRIB_BACKEND": "cpu"})
            expected = [] if status == 0 else [f"distrib {command[0]}: error: DISTRIB_TIMELINE: A timeline needs a "
                                               f"file it can write. Received: {str(path)!r} {why}"]
            assert (result.returncode, result.stdout, result.stderr.splitlines()) == (status, out, expected)
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


def test_reductions_outside_run_are_on_the_timeline_once_each(tmp_path):
    # reduce_to, Strategy.reduce and batch_reduce_to onto a device or the host sum with the backend's add_n, which
    # the timeline left out: only the all_reduce inside `run` was recorded
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(4, ctx.replica_id_in_sync_group + 1, np.float32))
    summed_by_a_function = distrib.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=distrib.ReductionToOneDevice(
        accumulation_fn=lambda arrays: sum(arrays[1:], arrays[0])))
    other_values = summed_by_a_function.experimental_distribute_values_from_function(
        lambda ctx: np.full(4, ctx.replica_id_in_sync_group + 1, np.float32))
    calls = {
        "reduce_to a device": lambda: strategy.extended.reduce_to("SUM", values, "CPU:1"),
        "reduce_to the host": lambda: strategy.extended.reduce_to("MEAN", values, "host"),
        "Strategy.reduce": lambda: strategy.reduce("SUM", values, axis=None),
        "batch_reduce_to onto the host": lambda: strategy.extended.batch_reduce_to("SUM", [(values, "host"),
                                                                                          (values, "host")]),
        "reduce_to with an accumulation_fn": lambda: summed_by_a_function.extended.reduce_to("SUM", other_values,
                                                                                             "CPU:0"),
    }
    # (collectives, the device each sums on): batch_reduce_to onto the host packs its two values into one sum
    expected = {"reduce_to a device": ["CPU:1"], "reduce_to the host": ["CPU:0"], "Strategy.reduce": ["CPU:0"],
                "batch_reduce_to onto the host": ["CPU:0"], "reduce_to with an accumulation_fn": ["CPU:0"]}
    strategy.start_timeline(tmp_path / "t.json")
    try:
        for name, call in calls.items():
            with timeline.span(name, "test"):
                call()
    finally:
        path = strategy.stop_timeline()
    trace = json.loads(open(path).read())
    names, events = track_names(trace), complete_events(trace)
    found = {}
    for marker in (e for e in events if e["cat"] == "test"):
        inside = [e for e in events if e["cat"] == "collective" and
                  marker["ts"] <= e["ts"] and e["ts"] + e["dur"] <= marker["ts"] + marker["dur"] + 1e-3]
        found[marker["name"]] = [(e["name"], names[e["tid"]], e["args"]["bytes"]) for e in inside]
    assert found == {name: [("add_n", device, 32 if name == "batch_reduce_to onto the host" else 16)
                            for device in devices] for name, devices in expected.items()}


@needs_mpirun
@pytest.mark.parametrize("replicas", [1, 2])
def test_under_mpirun_every_collective_across_the_processes_is_on_the_timeline_once(tmp_path, replicas):
    # the MPI backend's plans sum straight through MPI, past the timed all_reduce: a whole `distrib train` under
    # mpirun recorded no all_reduce at all
    program = ROOT / "tests" / "multi_worker" / "timeline_routes.py"
    done = subprocess.run([MPIRUN, "-np", "2", sys.executable, str(program)],
                          env=mpirun_env(DISTRIB_CPU_REPLICAS=str(replicas), DISTRIB_TIMELINE=str(tmp_path / "t.json")),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        trace = json.loads((tmp_path / f"t.rank{rank}.json").read_text())
        names, events = track_names(trace), complete_events(trace)
        found = {}
        for marker in (e for e in events if e["cat"] == "test"):
            inside = [e for e in events if e["cat"] == "collective" and
                      marker["ts"] <= e["ts"] and e["ts"] + e["dur"] <= marker["ts"] + marker["dur"] + 1e-3]
            found[marker["name"]] = sorted((e["name"], names[e["tid"]]) for e in inside)
        devices = [f"CPU:{d}" for d in range(replicas)]
        one_all_reduce = [("all_reduce", device) for device in devices]  # one event per device, as in one process
        assert found == {"run: all_reduce": one_all_reduce, "run: all_reduce of two values": one_all_reduce,
                         "run: all_reduce of float16": one_all_reduce,
                         "run: all_gather": sorted([("all_gather", device) for device in devices] +
                                                   [("gather_rows", "MainThread")]),
                         "reduce_to": one_all_reduce, "reduce_to of float16": one_all_reduce,
                         "reduce_to the host": one_all_reduce, "Strategy.reduce": one_all_reduce,
                         "batch_reduce_to": one_all_reduce}, rank


def test_a_write_that_fails_at_the_stop_names_the_path_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    timeline.start(path)
    path.mkdir()  # a folder took the file's name during the recording
    with pytest.raises(IsADirectoryError, match=r"^A timeline needs a file it can write\. Received: '.*/t\.json' "
                                                r"\(a folder"):
        timeline.stop()
    assert os.listdir(tmp_path) == ["t.json"] and os.listdir(path) == []
    path.rmdir()

    def failing_replace(source, target):
        raise OSError(5, "Input/output error")

    timeline.start(path)
    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match=r"^A timeline needs a file it can write\. Received: '.*/t\.json' "
                                      r"\(Input/output error\)\.$"):
        timeline.stop()
    assert os.listdir(tmp_path) == [] and timeline.recording is None


def test_nothing_is_recorded_while_off(tmp_path):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.ones(3)))
    assert timeline.recording is None
    strategy.start_timeline(tmp_path / "t.json")
    path = strategy.stop_timeline()
    assert complete_events(json.loads(open(path).read())) == []


def test_spans_become_nvtx_ranges_when_registered(tmp_path, monkeypatch):
    ranges = []
    monkeypatch.setattr(timeline, "_nvtx", (lambda name: ranges.append(("push", name)),
                                            lambda: ranges.append(("pop",))))
    timeline.start(tmp_path / "t.json")
    try:
        with timeline.span("outer", "test"):
            with timeline.span("inner", "test"):
                pass
    finally:
        timeline.stop()
    assert ranges == [("push", "outer"), ("push", "inner"), ("pop",), ("pop",)]


def test_every_backends_collectives_are_on_the_timeline_once_and_cost_nothing_while_none_records(tmp_path):
    from distrib.backends.base import TIMED
    from distrib.backends.cpu import CpuBackend
    from distrib.backends.mpi import MpiBackend

    classes = [CpuBackend, MpiBackend]
    if importlib.util.find_spec("cupy") is not None:  # the CUDA backend imports without a GPU
        from distrib.backends.cuda.backend import CudaBackend

        classes.append(CudaBackend)
    timing = timeline.timed(lambda self: None, "probe", "test").__code__

    def wrappers(cls, name):
        chain = [getattr(cls, name)]  # the method, and what each wrapper (error translation...) wraps
        while hasattr(chain[-1], "__wrapped__"):
            chain.append(chain[-1].__wrapped__)
        return sum(f.__code__ is timing for f in chain)

    timeline.start(tmp_path / "t.json")
    try:
        assert {(cls, name): wrappers(cls, name) for cls in classes for name in TIMED} == \
            {(cls, name): 1 for cls in classes for name in TIMED}
    finally:
        timeline.stop()
    assert {(cls, name): wrappers(cls, name) for cls in classes for name in TIMED} == \
        {(cls, name): 0 for cls in classes for name in TIMED}


def test_the_timeline_benchmark_runs_and_finds_the_backend_unwrapped_while_off(tmp_path, monkeypatch):
    # bench/timeline_bench.py measures what README's timeline section claims; it must keep running as the timeline
    # changes (it once read a wrapper that no longer exists while off)
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # its `measure` helpers, as when it runs as a script
    spec = importlib.util.spec_from_file_location("timeline_bench", ROOT / "bench" / "timeline_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    hooks = bench.hook_costs(str(tmp_path))
    assert set(hooks) == {"span_off_ns", "backend_hook_recording_ns", "pack_one_array_ns"}
    steps = bench.per_step(1, 0.005, str(tmp_path))
    assert set(steps) == {"empty_merge_call", "allreduce_1m", "batch_200x1000"}
    assert all(row["spans_per_step"] > 0 and row["off_us"] > 0 for row in steps.values())
    assert steps["allreduce_1m"]["backend_hooks_per_step"] > 0
    assert timeline.recording is None
