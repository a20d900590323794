"""Cluster resolvers: which tasks (workers, parameter servers) a cluster has, from TF_CONFIG or from Ray."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["ClusterResolver", "RayClusterResolver", "TFConfigClusterResolver"]


class ClusterResolver:
    """The base of cluster resolvers: `cluster_spec()` maps each job name to its task addresses."""

    task_type: str | None = None
    task_id: int | None = None
    rpc_layer: str | None = None

    def cluster_spec(self) -> dict[str, list[str]]:
        raise NotImplementedError

    def num_tasks(self, job: str) -> int:
        """How many tasks the job `job` ("worker", "ps", "chief") has; 0 when the cluster has no such job."""
        return len(self.cluster_spec().get(job, []))

    def __repr__(self) -> str:
        counts = {job: len(tasks) for job, tasks in self.cluster_spec().items()}
        return f"<{type(self).__name__} {counts} task={self.task_type}:{self.task_id}>"


class TFConfigClusterResolver(ClusterResolver):
    """Reads the cluster from the `TF_CONFIG` environment variable, as TensorFlow does.

    `TF_CONFIG` is JSON: `{"cluster": {"worker": [...], "ps": [...], "chief": [...]}, "task": {"type": ...,
    "index": ...}, "rpc_layer": ...}`. With a `ParameterServerStrategy` on Ray, the lengths of `worker` and `ps`
    decide how many worker and parameter-server actors start; Ray places them on its nodes.

    Args:
      task_type, task_id, rpc_layer: override the values TF_CONFIG's `task` and `rpc_layer` give.

    Example:
      >>> import distrib, json, os
      >>> os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]},
      ...                                       "task": {"type": "chief", "index": 0}})
      >>> resolver = distrib.cluster_resolver.TFConfigClusterResolver()
      >>> resolver.num_tasks("worker"), resolver.num_tasks("ps"), resolver.task_type
      (2, 1, 'chief')
      >>> del os.environ["TF_CONFIG"]
    """

    def __init__(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None):
        config = _tf_config()
        task = config.get("task", {})
        self.task_type = task_type if task_type is not None else task.get("type")
        self.task_id = task_id if task_id is not None else task.get("index")
        self.rpc_layer = rpc_layer if rpc_layer is not None else config.get("rpc_layer")
        self._cluster = config.get("cluster", {})

    def cluster_spec(self) -> dict[str, list[str]]:
        return {job: list(tasks) for job, tasks in self._cluster.items()}


def _tf_config() -> dict[str, Any]:
    raw = os.environ.get("TF_CONFIG", "")
    if not raw.strip():
        return {}
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"TF_CONFIG must be JSON. Received: {raw[:80]!r} ({exc}).") from None
    cluster = config.get("cluster", {}) if isinstance(config, dict) else None
    if not isinstance(cluster, dict) or not all(isinstance(tasks, (list, dict)) for tasks in cluster.values()):
        raise ValueError(f"TF_CONFIG needs a \"cluster\" object mapping job names to lists of addresses. Received: "
                         f"{raw[:80]!r}.")
    config["cluster"] = {job: list(tasks.values()) if isinstance(tasks, dict) else tasks
                         for job, tasks in cluster.items()}
    return config


class RayClusterResolver(ClusterResolver):
    """Reads the cluster from Ray (joining `RAY_ADDRESS`, or starting a local cluster): one task per node by default.

    Parameter servers default to one per alive node; workers to half the cluster's CPUs (at least one), so a
    closure's NumPy work has a core. Tasks are named by the node they would land on first; Ray decides.

    Args:
      num_workers: how many workers, instead of the default.
      num_ps: how many parameter servers, instead of the default.

    Example:
      >>> import distrib
      >>> resolver = distrib.cluster_resolver.RayClusterResolver(num_workers=2, num_ps=1)
      >>> resolver.num_tasks("worker"), resolver.num_tasks("ps")
      (2, 1)
    """

    def __init__(self, num_workers: int | None = None, num_ps: int | None = None):
        for argument, value in (("num_workers", num_workers), ("num_ps", num_ps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{argument} must be a positive integer or None. Received: {value!r}.")
        self._num_workers, self._num_ps = num_workers, num_ps
        self._spec: dict[str, list[str]] | None = None
        self.task_type, self.task_id = "chief", 0

    def cluster_spec(self) -> dict[str, list[str]]:
        if self._spec is None:
            from distrib.parameter_server.ray_runtime import ensure_cluster

            ray = ensure_cluster()
            nodes = [node["NodeManagerAddress"] for node in ray.nodes() if node.get("Alive")] or ["localhost"]
            cpus = int(ray.cluster_resources().get("CPU", 1))
            num_ps = self._num_ps or len(nodes)
            num_workers = self._num_workers or max(1, cpus // 2)
            self._spec = {"chief": [nodes[0]], "worker": [nodes[i % len(nodes)] for i in range(num_workers)],
                          "ps": [nodes[i % len(nodes)] for i in range(num_ps)]}
        return {job: list(tasks) for job, tasks in self._spec.items()}
