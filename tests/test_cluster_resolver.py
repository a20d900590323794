"""Cluster resolvers: TF_CONFIG read as TensorFlow reads it, with clear errors for a malformed one; the MPI
launcher's environment and Slurm's, with TensorFlow's names."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from distrib.cluster_resolver import (MPIClusterResolver, RayClusterResolver, SlurmClusterResolver,
                                      TFConfigClusterResolver, expand_hostlist, expand_tasks_per_node)


def test_tf_config_gives_the_cluster_and_this_task(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["c:1"], "worker": ["w0:1", "w1:1", "w2:1"], "ps": {"0": "p0:1", "1": "p1:1"}},
        "task": {"type": "worker", "index": 2}, "rpc_layer": "grpc"}))
    resolver = TFConfigClusterResolver()
    assert resolver.cluster_spec() == {"chief": ["c:1"], "worker": ["w0:1", "w1:1", "w2:1"], "ps": ["p0:1", "p1:1"]}
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 2, "grpc")
    assert resolver.num_tasks("ps") == 2 and resolver.num_tasks("evaluator") == 0
    assert TFConfigClusterResolver(task_type="chief", task_id=0).task_type == "chief"
    assert repr(resolver) == "<TFConfigClusterResolver {'chief': 1, 'worker': 3, 'ps': 2} task=worker:2>"


def test_no_tf_config_is_an_empty_cluster(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert TFConfigClusterResolver().cluster_spec() == {}


@pytest.mark.parametrize("raw, message", [
    ("{not json", "TF_CONFIG must be JSON. Received: '{not json'"),
    (json.dumps({"cluster": ["w0:1"]}), "TF_CONFIG needs a \"cluster\" object mapping job names to lists"),
    (json.dumps({"cluster": {"worker": "w0:1"}}), "TF_CONFIG needs a \"cluster\" object mapping job names to lists"),
])
def test_a_malformed_tf_config_says_what_is_wrong(monkeypatch, raw, message):
    monkeypatch.setenv("TF_CONFIG", raw)
    with pytest.raises(ValueError, match=f"^{message}"):
        TFConfigClusterResolver()


def test_ray_resolver_counts_must_be_positive():
    with pytest.raises(ValueError, match="^num_workers must be a positive integer or None. Received: 0"):
        RayClusterResolver(num_workers=0)


LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                      "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
                      "PMIX_RANK", "PMIX_SIZE")


@pytest.fixture
def no_launcher(monkeypatch):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_tf_config_gives_the_master_address_and_accelerators(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["w0:2222", "w1:2222"]},
                                                "task": {"type": "worker", "index": 1}, "rpc_layer": "grpc"}))
    resolver = TFConfigClusterResolver()
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.cluster_spec() == {"worker": ["w0:2222", "w1:2222"]}
    assert resolver.master() == "grpc://w1:2222"
    assert resolver.master("worker", 0, rpc_layer="") == "grpc://w0:2222"
    with pytest.raises(ValueError, match=r"no task ps:0. Received: jobs \{'worker': 2\}"):
        resolver.master("ps", 0)
    assert resolver.num_accelerators() == {}  # no GPU on this machine


@pytest.mark.parametrize("environment", [
    {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
     "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
    {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},  # MPICH's Hydra
], ids=["openmpi", "mpich"])
def test_mpi_resolver_reads_each_launchers_environment(no_launcher, environment):
    for name, value in environment.items():
        no_launcher.setenv(name, value)
    resolver = MPIClusterResolver()
    assert (resolver.task_type, resolver.task_id, resolver.local_rank, resolver.local_size) == ("worker", 3, 1, 2)
    assert resolver.cluster_spec() == {"worker": ["mpi:0", "mpi:1", "mpi:2", "mpi:3"]}
    assert resolver.master() == "mpi:3"


def test_mpi_resolver_outside_a_launcher_is_one_task(no_launcher):
    resolver = MPIClusterResolver()
    assert (resolver.task_id, resolver.num_tasks("worker"), resolver.launcher) == (0, 1, None)
    assert repr(resolver) == "<MPIClusterResolver {'worker': 1} task=worker:0>"


def test_mpi_resolver_rejects_a_rank_outside_the_job(no_launcher):
    no_launcher.setenv("PMI_RANK", "4")
    no_launcher.setenv("PMI_SIZE", "4")
    with pytest.raises(ValueError, match="The MPI rank must lie in"):
        MPIClusterResolver()


def slurm(monkeypatch, procid, tasks, nodes, per_node):
    for name, value in (("SLURM_PROCID", procid), ("SLURM_STEP_NUM_TASKS", tasks), ("SLURM_STEP_NODELIST", nodes),
                        ("SLURM_STEP_TASKS_PER_NODE", per_node)):
        monkeypatch.setenv(name, value)


def test_slurm_resolver_spreads_tasks_over_nodes_and_jobs(monkeypatch):
    slurm(monkeypatch, "3", "5", "gpu[07-08],cpu1", "2(x2),1")
    resolver = SlurmClusterResolver(jobs={"chief": 1, "worker": 4}, port_base=9000, gpus_per_node=8)
    assert resolver.cluster_spec() == {"chief": ["gpu07:9000"],
                                       "worker": ["gpu07:9001", "gpu08:9000", "gpu08:9001", "cpu1:9000"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 2)
    assert resolver.num_accelerators() == {"GPU": 8}


def test_slurm_resolver_outside_slurm_and_with_inconsistent_counts(monkeypatch):
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    with pytest.raises(ValueError, match="SlurmClusterResolver needs Slurm's environment"):
        SlurmClusterResolver()
    slurm(monkeypatch, "0", "3", "n[1-2]", "1(x2)")
    with pytest.raises(ValueError, match="Slurm's node list and tasks per node must describe 3 tasks"):
        SlurmClusterResolver()


def test_slurm_host_lists_and_task_counts_expand():
    assert expand_hostlist("node[008-010,12],login-a") == ["node008", "node009", "node010", "node12", "login-a"]
    assert expand_tasks_per_node("4,2(x2)") == [4, 2, 2]
    with pytest.raises(ValueError, match="Slurm's tasks per node look like"):
        expand_tasks_per_node("2x3")


@pytest.mark.parametrize("tf_config, refusal", [
    ({"cluster": {"worker": ["w0:2222"]}, "task": {"type": "worker", "index": 5}},
     r"The cluster has no task worker:5. Received: jobs {'worker': 1}."),
    ({"cluster": {"worker": ["w0:2222", "w1:2222"]}, "task": {"type": "worker", "index": 0}},
     r"The cluster resolver must describe the MPI job's 1 processes. Received: 2 chief and worker tasks"),
])
def test_multi_worker_strategy_refuses_a_resolver_that_does_not_describe_the_job(tf_config, refusal):
    pytest.importorskip("mpi4py", reason="MultiWorkerMirroredStrategy needs mpi4py (pip install '.[mpi]')")
    program = ("import distrib\n"
               "try:\n"
               "    distrib.MultiWorkerMirroredStrategy(distrib.cluster_resolver.TFConfigClusterResolver())\n"
               "except ValueError as error:\n"
               "    print(error)\n")  # a plain `python` run: an MPI job of one process
    env = dict(os.environ, TF_CONFIG=json.dumps(tf_config), DISTRIB_BACKEND="cpu")
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and refusal in done.stdout, done.stdout + done.stderr
