"""Cluster resolvers read as TensorFlow's do: Slurm host lists expanded or refused as `expand_hostlist` does, a
Slurm rank inside the job, TF_CONFIG's task index read with int(), and `cluster_spec()` a `ClusterSpec` with
TensorFlow's methods and errors."""

from __future__ import annotations

import json
import pickle

import pytest

from distrib.cluster_resolver import (ClusterSpec, MPIClusterResolver, SlurmClusterResolver,
                                      TFConfigClusterResolver, expand_hostlist)


@pytest.mark.parametrize("hostlist, hosts", [
    ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
    ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
    ("n[09-11]", ["n09", "n10", "n11"]),
    ("node001,node[002-003]", ["node001", "node002", "node003"]),
    ("rack-1-node[1,3]", ["rack-1-node1", "rack-1-node3"]),
    ("[1-2]", ["1", "2"]),
    ("n[1-2],", ["n1", "n2"]),  # a trailing comma adds no host, as in TensorFlow
])
def test_host_lists_expand_as_tensorflow_expands_them(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", [
    "rack[1-2]-node[01-02]", "node[1-3]-ib", "node[01-02", "n]1", "n[1-2]]", "n[]", "n[[1]]", "n[a-b]", "n[1-2-3]",
    "n[3-1]", "n[1,,2]", ",n1", "n1,,n2",
])
def test_a_host_list_tensorflow_cannot_read_is_refused(hostlist):
    with pytest.raises(ValueError, match=r"^Invalid hostlist format " + repr(hostlist).replace("[", r"\[")):
        expand_hostlist(hostlist)


def slurm(monkeypatch, procid, tasks, nodes, per_node):
    for name, value in (("SLURM_PROCID", procid), ("SLURM_STEP_NUM_TASKS", tasks), ("SLURM_STEP_NODELIST", nodes),
                        ("SLURM_STEP_TASKS_PER_NODE", per_node)):
        monkeypatch.setenv(name, value)


def test_slurm_resolver_refuses_a_node_list_it_cannot_read(monkeypatch):
    slurm(monkeypatch, "3", "4", "rack[1-2]-node[01-02]", "1(x4)")
    with pytest.raises(ValueError, match=r"^Invalid hostlist format 'rack\[1-2\]-node\[01-02\]'"):
        SlurmClusterResolver()


@pytest.mark.parametrize("procid", ["3", "7", "-1"])
def test_slurm_rank_must_lie_in_the_job(monkeypatch, procid):
    slurm(monkeypatch, procid, "3", "n[1-3]", "1(x3)")
    with pytest.raises(ValueError, match=rf"^The Slurm rank \(SLURM_PROCID\) must lie in \[0, size\). Received: "
                                         rf"rank {procid} of 3 tasks."):
        SlurmClusterResolver()


def test_slurm_job_counts_must_be_counts(monkeypatch):
    slurm(monkeypatch, "0", "3", "n[1-3]", "1(x3)")
    with pytest.raises(ValueError, match="^jobs must map job names to task counts"):
        SlurmClusterResolver(jobs={"ps": -1, "worker": 4})


def tf_config(monkeypatch, task, cluster=None):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster or {"worker": ["w0:1", "w1:1"]}, "task": task}))


@pytest.mark.parametrize("index", ["1", 1, 1.0, " 1"])
def test_tf_config_task_index_is_read_with_int(monkeypatch, index):
    tf_config(monkeypatch, {"type": "worker", "index": index})
    resolver = TFConfigClusterResolver()
    assert resolver.task_id == 1 and type(resolver.task_id) is int
    assert resolver.master() == "w1:1"


@pytest.mark.parametrize("index", ["one", "1.5", 1.5, True, None, [1]])
def test_tf_config_task_index_that_is_not_an_integer_is_refused(monkeypatch, index):
    tf_config(monkeypatch, {"type": "worker", "index": index})
    with pytest.raises(ValueError, match=r"^TF_CONFIG's task index must be an integer. Received: "):
        TFConfigClusterResolver()


@pytest.mark.parametrize("task", [["worker", 0], "worker:0", 3])
def test_tf_config_task_that_is_not_an_object_is_refused(monkeypatch, task):
    tf_config(monkeypatch, task)
    with pytest.raises(ValueError, match=r"^TF_CONFIG's \"task\" must be an object like"):
        TFConfigClusterResolver()


def test_tf_config_task_type_must_be_a_name(monkeypatch):
    tf_config(monkeypatch, {"type": 0, "index": 0})
    with pytest.raises(ValueError, match=r"^TF_CONFIG's task type must be a job name"):
        TFConfigClusterResolver()


def test_tf_config_tasks_given_by_index_are_put_in_index_order(monkeypatch):
    tf_config(monkeypatch, {"type": "worker", "index": 0}, cluster={"worker": {"1": "b:1", "0": "a:1"}})
    resolver = TFConfigClusterResolver()
    assert resolver.cluster_spec() == {"worker": ["a:1", "b:1"]} and resolver.master() == "a:1"
    tf_config(monkeypatch, {"type": "worker", "index": 3}, cluster={"worker": {"3": "b:1"}})
    with pytest.raises(ValueError, match=r"^TF_CONFIG's job 'worker' must number its tasks 0, 1, ... without gaps"):
        TFConfigClusterResolver()


def test_cluster_spec_has_tensorflows_methods(monkeypatch):
    tf_config(monkeypatch, {"type": "worker", "index": 1},
              cluster={"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p0:1"]})
    spec = TFConfigClusterResolver().cluster_spec()
    assert isinstance(spec, ClusterSpec) and isinstance(spec, dict)
    assert spec.as_dict() == {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p0:1"]}
    assert type(spec.as_dict()) is dict
    assert spec.jobs == ["chief", "worker", "ps"]
    assert (spec.num_tasks("worker"), spec.task_indices("worker")) == (2, [0, 1])
    assert spec.task_address("worker", 1) == "w1:1" and spec.job_tasks("worker") == ["w0:1", "w1:1"]
    assert spec and not ClusterSpec({}) and ClusterSpec({"ps": []}).as_dict() == {"ps": {}}
    assert spec == {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p0:1"]}  # still a dict
    assert pickle.loads(pickle.dumps(spec)) == spec
    spec["worker"].append("mutated")  # a copy: the resolver's cluster is unchanged
    assert TFConfigClusterResolver().cluster_spec().num_tasks("worker") == 2


@pytest.mark.parametrize("call, message", [
    (lambda spec: spec.num_tasks("evaluator"), "No such job in cluster: 'evaluator'"),
    (lambda spec: spec.task_indices("evaluator"), "No such job in cluster: 'evaluator'"),
    (lambda spec: spec.job_tasks("evaluator"), "No such job in cluster: 'evaluator'"),
    (lambda spec: spec.task_address("evaluator", 0), "No such job in cluster: 'evaluator'"),
    (lambda spec: spec.task_address("worker", 2), "No task with index 2 in job 'worker'"),
    (lambda spec: spec.task_address("worker", -1), "No task with index -1 in job 'worker'"),
])
def test_cluster_spec_raises_tensorflows_errors(call, message):
    spec = ClusterSpec({"worker": ["w0:1", "w1:1"]})
    with pytest.raises(ValueError, match=f"^{message}$"):
        call(spec)


def test_cluster_spec_refuses_tasks_that_are_not_a_list():
    with pytest.raises(TypeError, match="The tasks for job 'worker' must be a list of addresses"):
        ClusterSpec({"worker": "w0:1"})


def test_every_resolver_gives_a_cluster_spec(monkeypatch):
    for name in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "PMIX_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert MPIClusterResolver().cluster_spec().as_dict() == {"worker": ["mpi:0"]}
    slurm(monkeypatch, "1", "2", "gpu[07-08]", "1(x2)")
    assert SlurmClusterResolver().cluster_spec().task_address("worker", 1) == "gpu08:8888"
    monkeypatch.delenv("TF_CONFIG", raising=False)
    empty = TFConfigClusterResolver().cluster_spec()
    assert isinstance(empty, ClusterSpec) and not empty and empty.jobs == []
    import distrib
    assert distrib.cluster_resolver.ClusterSpec is ClusterSpec
