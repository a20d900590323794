"""MultiWorkerMirroredStrategy under `mpirun -np 2` on this machine: 2 processes x 2 emulated replicas behave as
one process with 4 (the API, the conformance programs, training and its checkpoint), and a rank that dies or
stalls gives the other a typed error naming it."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest
from support import (MPIRUN, OPEN_MPI_5, assert_one_process_with_two_replicas, default_sigint, mpirun_env,
                     needs_mpirun)

import distrib

HERE = pathlib.Path(__file__).parent / "multi_worker"
EXAMPLES = pathlib.Path(__file__).parents[1] / "examples"
sys.path.insert(0, str(HERE))
import training  # noqa: E402
from nested_values import ragged_nested, same_shaped  # noqa: E402
from test_conformance import DELIBERATE_DIFFERENCES  # noqa: E402

pytestmark = needs_mpirun
# Documented differences from one process, not failures: see README's multi-worker section.
BY_DESIGN = {"datasets_from_function": "each worker runs its own input pipeline (num_input_pipelines=2)",
             "datasets_from_function_input_context": "each worker runs its own input pipeline (num_input_pipelines=2)",
             **DELIBERATE_DIFFERENCES}


def mpirun(program: str, *args: str, timeout: float = 120, replicas: int = 2, processes: int = 2,
           **env: str) -> subprocess.CompletedProcess:
    """`program` (in tests/multi_worker) on `processes` processes x `replicas` emulated replicas; `env` added."""
    return subprocess.run([MPIRUN, "-np", str(processes), sys.executable, str(HERE / program), *args],
                          env=mpirun_env(DISTRIB_CPU_REPLICAS=str(replicas), **env),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("job")
    done = mpirun("job.py", str(folder / "report.json"), str(folder / "half.ckpt"), str(folder / "run"))
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((folder / "report.json").read_text()), folder / "half.ckpt", done.stdout


def test_every_replica_of_every_process_is_in_one_sync_group(job):
    report, _, _ = job
    assert report["repr"] == "<MultiWorkerMirroredStrategy rank=0 of 2, devices=('CPU:0', 'CPU:1'), replicas=4>"
    assert report["num_replicas_in_sync"] == 4 and report["local_results"] == 2
    assert report["ids"] == [0, 1, 2, 3]
    assert report["sum"] == [10.0] * 4  # 1 + 2 + 3 + 4
    assert report["mean_int"] == [[1.5, 2.5, 3.5]] * 4
    assert report["gathered_rows"] == [10] * 4  # 1 + 2 + 3 + 4 rows, of ragged lengths
    assert report["merged"] == [6.0, 6.0]  # merge_fn's reduce spans the processes too
    assert report["resolver"] == ["worker", 0, {"worker": ["mpi:0", "mpi:1"]}]


def test_reduce_gather_and_input_split_as_one_process_with_four_replicas(job):
    report, _, _ = job
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full((2, 2), ctx.replica_id_in_sync_group, np.float32))
    np.testing.assert_array_equal(report["reduce_mean_axis0"], strategy.reduce("MEAN", values, axis=0))
    np.testing.assert_array_equal(report["gather"], strategy.gather(values, axis=0))
    batch = next(iter(strategy.experimental_distribute_dataset([np.zeros((7, 2))])))
    assert report["batch_rows"] == [len(b) for b in strategy.experimental_local_results(batch)] == [2, 2, 2, 1]
    # AutoShardPolicy.OFF: each worker reads the batch of 7 rows and rebatches it into 4 pieces of 2, 2, 2, 1 (as
    # TensorFlow does, whatever the policy), its 2 replicas taking 2 pieces a step: every worker covers the batch
    # in 2 steps, and a step holds the global batch's worth of rows over the 4 replicas, not 7 per worker
    assert report["batch_rows_off"] == [[2, 2, 2, 2], [2, 1, 2, 1]]


def as_json(value):
    """`value` as the job's report holds it."""
    return json.loads(json.dumps(value, default=lambda a: np.asarray(a).tolist()))


def test_nested_values_gather_and_reduce_as_one_process_with_four_replicas(job):
    report, _, _ = job
    # each process: one host exchange of every leaf's layout (a row per local replica), then one all_gather per dtype
    # (2 replicas, 5 leaves x 7 ints each), and no int64 all_gather of them on the devices
    assert report["nested_all_gather_dtypes"] == ["bool", "float16", "float32", "int32", "sizes (2, 35)"]
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    out = strategy.run(lambda: distrib.get_replica_context().all_gather(
        ragged_nested(distrib.get_replica_context().replica_id_in_sync_group), axis=0))
    assert report["nested_all_gather"] == as_json(list(strategy.experimental_local_results(out)))
    assert report["nested_all_gather"][0]["i32"] == [0, 0, 1, 0, 1, 2]  # ragged: 0, 1, 2 and 3 rows
    nested = strategy.experimental_distribute_values_from_function(
        lambda ctx: ragged_nested(ctx.replica_id_in_sync_group))
    assert report["nested_gather"] == as_json(strategy.gather(nested, axis=0))
    assert report["nested_gather_of_a_scalar"].startswith("Strategy.gather needs values of rank >= 1 to concatenate "
                                                          "along axis 0. Received: a scalar at path ['scalar'].")
    assert report["all_gather_across_processes_of_other_shapes"] == [
        "all_gather needs the same dtype, axis and shape off the gather axis on every replica. Received: replica 2, "
        "value 0, rank 2 gathered along axis 0, with 4 elements per row of dtype f4 vs rank 2 gathered along axis 0, "
        "with 3 elements per row of dtype f4."] * 2
    numbers = {key: nested[key] for key in ("f32", "f16", "i32")}
    assert report["nested_reduce_mean_axis0"] == as_json(strategy.reduce("MEAN", numbers, axis=0))
    assert report["nested_reduce_sum_axis0"] == as_json(strategy.reduce("SUM", numbers, axis=0))
    same = strategy.experimental_distribute_values_from_function(lambda ctx: same_shaped(ctx.replica_id_in_sync_group))
    assert report["nested_reduce_mean"] == as_json(strategy.reduce("MEAN", same, axis=None))


def test_conformance_programs_give_one_processs_results(job):
    report, _, _ = job
    outcomes = report["conformance"]
    ran = {name: outcome for name, outcome in outcomes.items() if not outcome.startswith("skipped")}
    assert len(ran) >= 25, outcomes
    wrong = {name: outcome for name, outcome in ran.items() if outcome != "ok" and name not in BY_DESIGN}
    assert not wrong, wrong


# With one replica per process a plain value is that process's replica's (reduced across the processes, as
# TensorFlow does with several workers), and the test's gathering of every process's local results cannot tell a
# value on one device from one per replica.
ONE_REPLICA_BY_DESIGN = {
    "error_reduce_to_non_distributed_sum": "a plain value is this process's replica's: reduced across the processes",
    "local_results": "a plain value's local results, gathered from every process: one per process",
    "merge_call_args_kwargs": "a merge_fn's plain result, gathered from every process: one per process",
    "reduce_to_array_destinations": "a value on one device, gathered from every process: one per process",
}


@pytest.mark.parametrize("processes, at_least", [(2, 8), (4, 35)])
def test_conformance_programs_with_one_replica_per_process_give_one_processs_results(tmp_path, processes, at_least):
    # as one process per GPU runs: the cases for 2 (or 4) replicas on 2 (or 4) processes of one replica each
    done = mpirun("conformance_on_workers.py", str(tmp_path / "outcomes.json"), replicas=1, processes=processes)
    assert done.returncode == 0, done.stdout + done.stderr
    outcomes = json.loads((tmp_path / "outcomes.json").read_text())
    ran = {name: outcome for name, outcome in outcomes.items() if not outcome.startswith("skipped")}
    assert len(ran) >= at_least, outcomes
    wrong = {name: outcome for name, outcome in ran.items()
             if outcome != "ok" and name not in BY_DESIGN and name not in ONE_REPLICA_BY_DESIGN}
    assert not wrong, wrong


def test_two_processes_train_to_the_weights_of_one_process_with_four_replicas(job):
    report, _, _ = job
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    w, b, optimizer = training.build(strategy, seed=0)
    losses = training.train(strategy, w, b, optimizer, training.batches())
    # the same rows and updates; sums are grouped by process, so floats agree to rounding
    np.testing.assert_allclose(report["losses"], losses, rtol=1e-5)
    np.testing.assert_allclose(report["w"], w.numpy(), rtol=1e-5)
    np.testing.assert_allclose(report["b"], b.numpy(), rtol=1e-5)


def test_the_chiefs_checkpoint_resumes_in_one_process(job):
    report, checkpoint, _ = job
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    w, b, optimizer = training.build(strategy, seed=123)
    metadata = distrib.Checkpoint(w=w, b=b, optimizer=optimizer, step=0).restore(checkpoint)
    done = metadata["step"]
    training.train(strategy, w, b, optimizer, training.batches(training.STEPS - done, first=done))
    np.testing.assert_allclose(w.numpy(), report["w"], rtol=1e-5)
    assert not [p.name for p in checkpoint.parent.iterdir() if p.name.endswith(".tmp")]  # no temporary file left


def test_distrib_train_under_mpirun_reports_once_and_resumes_in_one_process(job, capsys):
    report, checkpoint, printed = job
    run = checkpoint.parent / "run"
    assert report["distrib_train"] == 0
    # plain lines, though mpirun gives rank 0 a pseudo-terminal: a live bar's redraws depend on timing
    assert "\x1b[" not in printed
    # the chief's epoch line and summary; rank 1 prints nothing
    reported = [line for line in printed.splitlines() if "test accuracy" in line]
    assert len(reported) == 2 and reported[0].startswith("epoch 1/1  loss") and reported[1].startswith("test accuracy")
    assert "<MultiWorkerMirroredStrategy rank=0 of 2, devices=('CPU:0', 'CPU:1'), replicas=4>: 4 replicas" in printed
    assert sorted(p.name for p in run.iterdir()) == ["ckpt", "history.json", "loss.png"]
    from distrib.cli.train import main as distrib_train

    # the same epoch in one process with the same 4 replicas: the same losses, to rounding
    assert distrib_train(["--replicas", "4", "--epochs", "1", "--out", str(run.parent / "one"), "--seed", "3"]) == 0
    two, one = (json.loads((folder / "history.json").read_text()) for folder in (run, run.parent / "one"))
    np.testing.assert_allclose(two["step_loss"], one["step_loss"], rtol=1e-4)
    assert two["test_accuracy"] == one["test_accuracy"]
    # and the 2-process run resumes in one process with 3 replicas (another count)
    assert distrib_train(["--replicas", "3", "--epochs", "2", "--global-batch-size", "63", "--out", str(run),
                          "--resume", "--seed", "3"]) == 0
    assert "epoch 2/2" in capsys.readouterr().out


@pytest.mark.parametrize("announcements", ["shared-memory", "messages"])
@pytest.mark.parametrize("fault, error", [("kill", "WorkerFailedError"), ("stall", "DeadlineExceededError")])
def test_a_failed_rank_gives_the_other_a_typed_error_naming_it(tmp_path, fault, error, announcements):
    done = mpirun("faults.py", fault, str(tmp_path / "error.json"), "2", timeout=60,
                  DISTRIB_MPI_ANNOUNCEMENTS=announcements)
    assert done.returncode != 0  # the job ends, it does not hang
    report = json.loads((tmp_path / "error.json.0").read_text())
    assert report["type"] == error
    assert report["message"].startswith("rank 1 (pid" if fault == "kill" else "all_reduce across processes timed out")
    assert "rank 1 (pid" in report["message"]
    assert (report["ranks"] if fault == "kill" else report["missing_ranks"]) == [1]
    assert report["seconds"] < 2 + 5  # within the timeout (2 s), plus the launcher's reaction
    later = (tmp_path / "error.json.0.later").read_text()
    assert later.startswith("all_reduce cannot run: this MPI job already failed.")


def test_a_rank_that_raises_ends_the_job_at_once_and_every_rank_writes_its_timeline(tmp_path):
    # rank 1's program raises at the 3rd step; without the abort at exit rank 0 would wait out its 600 s timeout
    done = mpirun("faults.py", "raise", str(tmp_path / "error.json"), "600", timeout=60,
                  DISTRIB_TIMELINE=str(tmp_path / "trace.json"))
    assert done.returncode != 0
    assert "ValueError: a bug in rank 1's program" in done.stderr
    report = json.loads((tmp_path / "error.json.0").read_text())
    assert report["type"] == "WorkerFailedError" and report["ranks"] == [1]
    assert report["message"].startswith("rank 1 (pid ") and " died, and the MPI launcher is ending the job" in \
        report["message"]
    assert report["seconds"] < 10
    # one trace per rank, each named for its rank, written by the failing rank and its peer alike
    for rank in (0, 1):
        events = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())["traceEvents"]
        assert [e["args"]["name"] for e in events if e["name"] == "process_name"] == [f"distrib rank {rank}"]
        assert [e for e in events if e["name"] == "run"]
    assert not (tmp_path / "trace.json").exists()


@pytest.mark.parametrize("api", ["Strategy.reduce", "Strategy.reduce along an axis", "Strategy.gather",
                                 "broadcast_to", "reduce_to a device"])
def test_the_strategys_timeout_bounds_collectives_outside_run(tmp_path, api):
    # each of these waited out the 600 s default instead of the strategy's 1 s
    done = mpirun("timeouts_outside_run.py", api, str(tmp_path / "error.json"), timeout=60)
    assert done.returncode != 0  # the job ends, it does not hang
    report = json.loads((tmp_path / "error.json").read_text())
    assert report["missing_ranks"] == [1] and "timed out after 1 s" in report["message"], report
    assert report["seconds"] < 1 + 3


@pytest.mark.parametrize("announcements", ["shared-memory", "messages"])
def test_a_rank_that_ends_early_gives_the_other_an_error_naming_it_at_once(tmp_path, announcements):
    # rank 1's program calls sys.exit(3) before the 3rd step: rank 0 must not wait out its 600 s timeout there
    done = mpirun("faults.py", "exit", str(tmp_path / "error.json"), "600", timeout=60,
                  DISTRIB_MPI_ANNOUNCEMENTS=announcements)
    assert done.returncode != 0
    report = json.loads((tmp_path / "error.json.0").read_text())
    assert report["type"] == "WorkerFailedError" and report["ranks"] == [1]
    assert report["message"].startswith("all_reduce across processes cannot complete: rank 1 (pid ")
    assert "left the job after collective #2 (its program ended: sys.exit" in report["message"]
    assert "this rank is at collective #3 of the job's collectives" in report["message"]
    assert report["seconds"] < 10
    later = (tmp_path / "error.json.0.later").read_text()
    assert later.startswith("all_reduce cannot run: this MPI job already failed.")


def test_the_quickstart_example_runs_its_replicas_per_process(tmp_path):
    done = subprocess.run([MPIRUN, "-np", "2", sys.executable, str(EXAMPLES / "quickstart.py"), "--replicas", "1",
                           "--steps", "3", "--rows", "64"], env=mpirun_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "replicas=2>, 2 replicas, 64 rows" in done.stdout  # --replicas 1 in each of 2 processes
    assert done.stdout.count("max |w - w_1 replica|") == 1  # rank 0 alone reports


def test_a_rank_killed_inside_a_transfer_ends_the_other_with_an_error_naming_it(tmp_path):
    # rank 1 is SIGKILLed while both ranks are inside the MPI call of a 32 MB all-reduce; the timeout is long, so
    # only the watchdog can end rank 0 before the subprocess timeout: no hang
    done = mpirun("faults.py", "kill-mid", str(tmp_path / "error.json"), "600", timeout=60)
    assert done.returncode != 0
    printed = done.stdout + done.stderr
    error = next(line for line in printed.splitlines() if line.startswith("distrib.errors."))
    assert error.startswith("distrib.errors.WorkerFailedError: rank 1 (pid ")
    assert "while rank 0 was inside the MPI call" in error
    assert not (tmp_path / "error.json.0").exists()  # no Python code of the stuck thread ran again


def test_ctrl_c_at_mpirun_ends_every_rank_with_an_error_that_says_so():
    env = dict(os.environ, DISTRIB_BACKEND="cpu", DISTRIB_CPU_REPLICAS="2", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    process = subprocess.Popen([MPIRUN, "-np", "2", sys.executable, str(HERE / "steps_until_stopped.py")], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=default_sigint)
    try:
        for line in process.stdout:  # after each rank's backend line
            if line.strip() == "stepping":
                break
        process.send_signal(signal.SIGINT)  # what Ctrl-C in mpirun's terminal does
        printed = process.communicate(timeout=30)[0]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode != 0, printed
    if OPEN_MPI_5:  # its mpirun discards what the ranks print after the Ctrl-C (README): only the job's end shows
        return
    errors = [line for line in printed.splitlines() if line.startswith("distrib.errors.WorkerFailedError")]
    # every rank runs here and none died: the error can say that no rank failed (mpirun may splice another rank's
    # output into a line, so the whole sentence is looked for once, and no error may say that a rank died or left)
    assert errors and "no rank failed: mpirun itself was interrupted (Ctrl-C) or killed" in printed, printed
    assert not any("died during" in line or "left the job" in line for line in errors), printed


def test_a_rank_stopped_inside_a_transfer_aborts_the_job_past_the_timeout(tmp_path):
    done = mpirun("faults.py", "stop-mid", str(tmp_path / "error.json"), "2", timeout=60)
    assert done.returncode != 0
    printed = done.stdout + done.stderr
    error = next(line for line in printed.splitlines() if line.startswith("distrib.errors."))
    assert error.startswith("distrib.errors.DeadlineExceededError: all_reduce across processes did not complete "
                            "within 2 s")
    assert "rank 1 (pid " in error and "stopped" in error  # and MPI_Abort ended the job: no hang



@pytest.fixture(scope="module", params=["shared-memory", "messages", "messages asked by one rank"])
def one_replica_each(request, tmp_path_factory):
    """The report of one_replica.py, with the ranks announcing collectives through shared memory (as peers on one
    host do) or by message (as peers on other hosts do; also when only one rank of the host asks for messages)."""
    report = tmp_path_factory.mktemp("one_replica") / "report.json"
    env = {"ONE_RANK_WANTS_MESSAGES": "1"} if request.param == "messages asked by one rank" else \
        {"DISTRIB_MPI_ANNOUNCEMENTS": request.param}
    done = mpirun("one_replica.py", str(report), timeout=60, **env)
    assert done.returncode == 0, done.stdout + done.stderr
    return request.param.split()[0], json.loads(report.read_text())


def test_one_replica_per_process_all_reduces_as_one_process(one_replica_each):
    _, report = one_replica_each
    checks = {name: ok for name, ok in report.items() if name not in ("flood", "lead", "left")}
    assert len(checks) == 16 and all(checks.values()), checks


def assert_every_check_passes(program: str, tmp_path, checks: int, replicas: int, **env: str) -> None:
    """`program` (rank 0 writes {check: passed} to the JSON file it is given) made `checks` checks, all passed."""
    done = mpirun(program, str(tmp_path / "report.json"), replicas=replicas, **env)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report) == checks and all(report.values()), [name for name, ok in report.items() if not ok]


def test_one_replica_fast_paths_give_the_general_routes_results(tmp_path):
    assert_every_check_passes("one_replica_fast_paths.py", tmp_path, 92, replicas=1)


@pytest.mark.parametrize("replicas", [1, 2])
def test_values_in_the_other_byte_order_reduce_gather_and_broadcast_as_native_ones(tmp_path, replicas):
    assert_every_check_passes("byte_order.py", tmp_path, 17, replicas)


@pytest.mark.parametrize("replicas", [1, 2])
def test_arrays_past_mpis_count_limit_travel_in_pieces_with_the_same_results(tmp_path, replicas):
    assert_every_check_passes("count_limit.py", tmp_path, 28, replicas)


def test_announcements_far_ahead_of_a_peer_all_arrive_in_order(one_replica_each):
    announcements, report = one_replica_each
    flood = report["flood"]
    if announcements == "messages":
        assert flood["by message"] == [1] and flood["in shared memory"] == []
        assert flood["sent_while_in_flight"] > 0  # the peer's queue filled: some went out beside the persistent send
    else:  # the peer shares this host: its slot holds its last announcement, and no message is sent
        assert flood["by message"] == [] and flood["in shared memory"] == [1]
        assert flood["sent_while_in_flight"] == 0
    assert flood["missing"] == [] and flood["sum after"] == 3.0
    assert flood["boards left behind"] == []  # the slots' file is removed once every rank has mapped it


def test_a_peer_waiting_for_a_rank_that_left_names_it_as_gone(one_replica_each):
    _, report = one_replica_each
    left = report["left"]
    assert left["missing"] == [1] and left["type"] == "WorkerFailedError" and left["ranks"] == [1]
    assert "rank 1 (pid " in left["message"] and "left the job after collective #" in left["message"]
    # two launches past its last collective are allowed (the lead); the third names it
    assert left["launch"]["launched"] == 2 and left["launch"]["ranks"] == [1], left["launch"]
    assert left["launch"]["message"].startswith("a launch across processes cannot complete: rank 1 (pid ")


def test_launches_run_at_most_two_collectives_ahead_of_the_slowest_peer(one_replica_each):
    _, report = one_replica_each
    assert report["lead"]["waited"] >= 0.4  # rank 0's third launch waited for rank 1's first


def test_one_replica_per_process_reduces_gathers_and_updates_variables_as_one_process(tmp_path):
    done = mpirun("one_replica_strategy.py", str(tmp_path / "report.json"), replicas=1)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):  # a variable written in a run with a plain value: each process's replica's, combined
        assert_one_process_with_two_replicas(json.loads((tmp_path / f"report.json.{rank}").read_text()))


def test_sparse_writes_of_every_aggregation_end_as_one_processes_do(tmp_path):
    done = mpirun("sparse_writes.py", str(tmp_path / "job.json"))  # 2 processes x 2 replicas
    assert done.returncode == 0, done.stdout + done.stderr
    alone = subprocess.run([sys.executable, str(HERE / "sparse_writes.py"), str(tmp_path / "alone.json")],
                           env=mpirun_env(DISTRIB_CPU_REPLICAS="4"), capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    one = json.loads((tmp_path / "alone.json.0").read_text())
    for rank in (0, 1):
        job = json.loads((tmp_path / f"job.json.{rank}").read_text())
        for case, copies in job.items():
            if case.split()[1] == "scatter_mul" and case.split()[0] in ("SUM", "MEAN"):  # one process only
                assert copies == "NotImplementedError", case
            elif isinstance(copies, str):
                assert copies == one[case], case
            else:  # this process's copies: global replicas 2 * rank and 2 * rank + 1
                assert copies == one[case][2 * rank:2 * rank + 2], case
    assert one["SUM scatter_add"][0] == [[8.0, 8.0], [4.0, 4.0], [8.0, 8.0], [6.0, 6.0]]  # by hand: 1 + the rows
    assert one["ONLY_FIRST_REPLICA scatter_add"][0] == [[3.0, 3.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    assert one["SUM scatter_update"] == "NotImplementedError"


def mpirun_uneven(program: str, replicas: tuple[int, ...], *args: str) -> subprocess.CompletedProcess:
    """`program` (in tests/multi_worker) on one process per entry of `replicas`, each with that many replicas."""
    command = [MPIRUN]
    for count in replicas:
        command += [":"] * (len(command) > 1) + ["-np", "1", "-x", f"DISTRIB_CPU_REPLICAS={count}", sys.executable,
                                                  str(HERE / program), *args]
    return subprocess.run(command, env=mpirun_env(), capture_output=True, text=True, timeout=60)


def test_processes_with_different_replica_counts_split_batches_reduce_and_train_as_one_process(tmp_path):
    done = mpirun_uneven("uneven_replicas.py", (1, 3), str(tmp_path / "report.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    first, rest = (json.loads((tmp_path / f"report.json.{rank}").read_text()) for rank in (0, 1))
    # global batches of 7 then 5 rows over 4 replicas: pieces of 2, 2, 2, 1 then 2, 2, 1, 0, replica 0 on rank 0
    assert first["batches"] == [[[0.0, 1.0]], [[7.0, 8.0]]]
    assert rest["batches"] == [[[2.0, 3.0], [4.0, 5.0], [6.0]], [[9.0, 10.0], [11.0], []]]
    expected = {"rows": [[r, r] for r in range(4) for _ in range(r + 1)], "ids": [0.0, 1.0, 2.0, 3.0]}
    assert first["gathered"] == [expected] and rest["gathered"] == [expected] * 3
    alone = [[0, 0, 1, 1, 2, 2, 3, 3]]
    assert first["gathered_alone"] == [alone] and rest["gathered_alone"] == [alone] * 3
    sums = {name: [4.0 if "SUM" in name else 1.0] * 3 for name in first["sums"]}
    assert len(sums) == 5 and first["sums"] == {k: [v] for k, v in sums.items()}
    assert rest["sums"] == {k: [v] * 3 for k, v in sums.items()}
    # the process of one replica reduces and writes its plain values as its replica's (before, it refused a SUM,
    # or took a MEAN as it was, while the other process waited in the collective)
    for report in (first, rest):
        assert report["reduced"] == report["written"] == [10.0, 2.5]  # replicas' 1 + 2 + 3 + 4, and their mean
        assert report["constant"] == [8.0, 2.0]  # a plain value is each local replica's, on every process alike
    assert first["merged"] == [2.5] and rest["merged"] == [2.5] * 3
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    w, b, optimizer = training.build(strategy, seed=0)
    losses = training.train(strategy, w, b, optimizer, training.batches())
    for report in (first, rest):  # the chief's initial values, the same updates as one process of four replicas
        np.testing.assert_allclose(report["losses"], losses, rtol=1e-5)
        np.testing.assert_allclose(report["w"], w.numpy(), rtol=1e-5)
        np.testing.assert_allclose(report["b"], b.numpy(), rtol=1e-5)


def test_each_rank_records_its_own_timeline_and_merged_they_line_up(tmp_path, monkeypatch, capsys):
    from distrib.cli import main

    monkeypatch.setenv("DISTRIB_TIMELINE", str(tmp_path / "trace.json"))
    done = mpirun("timeline_job.py")
    assert done.returncode == 0, done.stderr
    ranks = sorted(tmp_path.glob("trace.rank*.json"))
    assert [p.name for p in ranks] == ["trace.rank0.json", "trace.rank1.json"]  # not one file written twice
    assert main(["timeline", "merge", *map(str, ranks), "-o", str(tmp_path / "trace.json")]) == 0
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "distrib rank 0", 1: "distrib rank 1"}
    caller = {pid: min(e["tid"] for e in events if e["pid"] == pid and e["name"] == "run") for pid in names}
    runs = {pid: sorted(e["ts"] for e in events if (e["pid"], e.get("tid")) == (pid, caller[pid]) and
                        e["name"] == "run") for pid in names}  # the calling thread's track: one span per run
    assert len(runs[0]) == len(runs[1]) == 3
    assert abs(runs[0][-1] - runs[1][-1]) < 1e6  # one clock for both ranks: their last steps within a second


def test_merging_something_that_is_not_a_trace_says_which_file(tmp_path, capsys):
    from distrib.cli import main

    (tmp_path / "notes.json").write_text("[1, 2]")
    assert main(["timeline", "merge", str(tmp_path / "notes.json"), "-o", str(tmp_path / "out.json")]) == 2
    assert "A timeline to merge must be a trace distrib wrote" in capsys.readouterr().err
    assert main(["timeline", "merge", str(tmp_path / "missing.json"), "-o", str(tmp_path / "out.json")]) == 2
    assert "must be a file that can be read. Received: " in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("announcements", ["shared-memory", "messages"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_processes_that_pass_different_values_to_a_collective_all_raise_and_go_on(tmp_path, replicas, announcements):
    # each process's replicas agree with each other, so only the processes' announcements can tell: before, an
    # all_reduce returned wrong sums, or raised MPI_ERR_TRUNCATE on one rank only and left the other waiting; and a
    # process that refused its values before a collective left the others one collective behind it
    assert_every_check_passes("mismatches.py", tmp_path, 29, replicas, DISTRIB_MPI_ANNOUNCEMENTS=announcements)


def test_a_tf_config_task_must_be_the_processes_rank_and_the_chief_rank_0(tmp_path):
    # before: a TF_CONFIG that swapped the workers' indices trained as given, rank 0 checkpointing as worker:1 while
    # code that writes where task_id == 0 (TensorFlow's pattern) wrote on rank 1; an evaluator trained as a worker
    def outcomes(case):
        done = mpirun("tf_config_tasks.py", case, str(tmp_path / "out.json"), replicas=1)
        assert done.returncode == 0, done.stdout + done.stderr
        return [json.loads((tmp_path / f"out.json.{rank}").read_text()) for rank in (0, 1)]

    assert outcomes("in rank order") == [{"task": "worker:0", "chief": True}, {"task": "worker:1", "chief": False}]
    assert outcomes("a chief") == [{"task": "chief:0", "chief": True}, {"task": "worker:0", "chief": False}]
    first, second = outcomes("swapped")
    assert first["error"].startswith("The cluster resolver's task must be this process's: MPI rank 0 is worker:0")
    assert "Received: task worker:0" in second["error"] and "MPI rank 1 is worker:1" in second["error"]
    assert "a task of type 'evaluator' does not join its replicas" in outcomes("an evaluator")[1]["error"]


@pytest.mark.parametrize("execution", ["threads", "cooperative"])
def test_a_run_that_fails_while_a_replica_waits_at_a_collective_makes_the_peers_raise_and_go_on(tmp_path, execution):
    # before: rank 1's replica raised (or returned) while its sibling waited at the all_reduce; rank 0's all_reduce
    # then paired with rank 1's next one and both summed wrong values, without an error
    assert_every_check_passes("abandoned_collectives.py", tmp_path, 2, 2, DISTRIB_REPLICA_EXECUTION=execution)


def test_processes_of_one_and_two_replicas_that_pass_different_values_all_raise_and_go_on(tmp_path):
    # the process of one replica sums straight from its array, the other packs first: their signatures must
    # agree where the values do, and differ where they do not
    done = mpirun_uneven("mismatches.py", (1, 2), str(tmp_path / "report.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report) == 29 and all(report.values()), [name for name, ok in report.items() if not ok]


def test_a_slot_overwritten_by_a_later_collective_reads_as_no_mismatch_and_a_refusal_waits(tmp_path):
    # before, a peer two collectives ahead (its refusal did not wait) left another collective's signature where
    # this rank read the one it compared: a false CollectiveMismatchError at a broadcast, and the job hung
    done = mpirun("slot_cells.py", str(tmp_path / "report.json"), replicas=1,
                  DISTRIB_MPI_ANNOUNCEMENTS="shared-memory")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    first, second = report["rank 0"], report["rank 1"]
    assert first["slots"] and second["slots"]
    assert second["made"] == ["first", "third"]
    assert "rank 0 (pid " in second["refused"] and "refused it" in second["refused"]
    assert second["refusal waited"] >= 0.25  # until rank 0, 0.3 s late, reached the refused collective
    assert "rank 1 (pid " in first["peer of the refusal"] and "refused it" in first["peer of the refusal"]
    assert first["sum after"] == second["sum after"] == 3.0


def test_a_worker_whose_input_is_empty_from_the_start_makes_every_worker_raise_at_the_same_step(tmp_path):
    # it cannot shape empty batches without an element: before, it raised alone and the others, at their next
    # collective, got a WorkerFailedError and the job was aborted
    done = mpirun("empty_shards.py", str(tmp_path / "report.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    first, second = (json.loads((tmp_path / f"report.json.{rank}").read_text()) for rank in (0, 1))
    for case, start in (("by file", "A worker's shard of the dataset is empty"),
                        ("from function", "A worker's pipelines produced no element")):
        assert first[case]["steps"] == second[case]["steps"] == 0
        assert first[case]["error"].startswith(start) and second[case]["error"].startswith(start)
        assert first[case]["error"].endswith("Received: no element on another worker before its first step.")
        assert second[case]["error"].endswith("no element on this worker (index 1 of 2) before its first step.")
        assert first[case]["after"] == second[case]["after"] == 4.0
    # files 0 and 2 against file 1, each of 4 rows rebatched into 4 pieces, 2 a step: rank 1 gets empty batches
    # in steps 3 and 4
    later = {"steps": 4, "error": None, "after": 4.0}
    assert first["runs out later"] == second["runs out later"] == later


REBATCH_JOB = "rebatch_job.py"  # FILE, AUTO, OFF and DATA epochs; global batches of 2 rows a replica


def pieces(*rows):
    """Pieces of 2 consecutive rows starting at each of `rows`, as the job reports them."""
    return [[float(r), float(r + 1)] for r in rows]


def test_by_file_and_off_a_step_holds_one_global_batch_over_every_workers_replicas(tmp_path):
    # TensorFlow rebatches each worker's batches into num_replicas_in_sync pieces whatever the shard policy
    # ("rebatch, then shard"); before, each worker split its batch over its own replicas only: a step held
    # W x G rows and a loss divided by G came out W times too large
    done = mpirun(REBATCH_JOB, str(tmp_path / "report.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["G"] == 8  # 4 files (or batches) of 8 rows, 0..31; replicas in order: rank 0's 2, rank 1's 2
    assert report["FILE"] == report["AUTO"] == [  # rank 0 reads files 0 and 2, rank 1 files 1 and 3
        {"rows": pieces(0, 2, 8, 10), "processed": 8.0}, {"rows": pieces(4, 6, 12, 14), "processed": 8.0},
        {"rows": pieces(16, 18, 24, 26), "processed": 8.0}, {"rows": pieces(20, 22, 28, 30), "processed": 8.0}]
    # OFF: every worker reads both batches, so the epoch takes W x 2 steps of G rows, each row taken by every worker
    assert report["OFF"] == [{"rows": pieces(r, r + 2) * 2, "processed": 8.0} for r in (0, 4, 8, 12)]
    assert report["DATA"] == [{"rows": pieces(0, 2, 4, 6), "processed": 8.0},  # unchanged: one batch a step
                              {"rows": pieces(8, 10, 12, 14), "processed": 8.0}]


def test_by_file_and_off_processes_of_one_and_two_replicas_take_their_pieces_at_their_own_pace(tmp_path):
    # 3 replicas, batches of 6 rows in pieces of 2: rank 0 takes 1 piece a step, rank 1 takes 2 (across batch
    # boundaries), then gets empty batches until rank 0 is out too
    done = mpirun_uneven(REBATCH_JOB, (1, 2), str(tmp_path / "report.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["G"] == 6
    alone = [{"rows": pieces(r) + [[], []], "processed": 2.0} for r in (12, 14, 16)]
    assert report["FILE"] == report["AUTO"] == [  # rank 0: files 0 and 2 (rows 0..5, 12..17), rank 1: 1 and 3
        {"rows": pieces(0, 6, 8), "processed": 6.0}, {"rows": pieces(2, 10, 18), "processed": 6.0},
        {"rows": pieces(4, 20, 22), "processed": 6.0}] + alone
    assert report["OFF"] == [  # every rank reads rows 0..11
        {"rows": pieces(0, 0, 2), "processed": 6.0}, {"rows": pieces(2, 4, 6), "processed": 6.0},
        {"rows": pieces(4, 8, 10), "processed": 6.0}] + [{"rows": pieces(r) + [[], []], "processed": 2.0}
                                                         for r in (6, 8, 10)]
    assert report["DATA"] == [{"rows": pieces(0, 2, 4), "processed": 6.0},
                              {"rows": pieces(6, 8, 10), "processed": 6.0}]
