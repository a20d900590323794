"""Cluster resolvers: TF_CONFIG read as TensorFlow reads it, with clear errors for a malformed one."""

from __future__ import annotations

import json

import pytest

from distrib.cluster_resolver import RayClusterResolver, TFConfigClusterResolver


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
