"""Cluster resolvers: which tasks (workers, parameter servers) a cluster has, from TF_CONFIG, MPI, Slurm or Ray."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from distrib.mpi_env import mpi_environment

__all__ = ["ClusterResolver", "ClusterSpec", "MPIClusterResolver", "RayClusterResolver", "SlurmClusterResolver",
           "TFConfigClusterResolver"]


class ClusterSpec(dict):
    """A cluster as TensorFlow's `tf.train.ClusterSpec` describes it: each job name mapped to its task addresses.

    It is a dict (`spec["worker"]` is the list of worker addresses) with TensorFlow's methods: `as_dict()`,
    `jobs`, `num_tasks(job)`, `task_indices(job)`, `task_address(job, index)` and `job_tasks(job)`, which raise
    TensorFlow's ValueError for a job or task the cluster does not have.

    Example:
      >>> spec = ClusterSpec({"worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]})
      >>> spec.jobs, spec.num_tasks("worker"), spec.task_address("ps", 0)
      (['worker', 'ps'], 2, 'p0:2222')
    """

    def __init__(self, cluster: Any = None):
        super().__init__()
        for job, tasks in (cluster or {}).items():
            if not isinstance(tasks, (list, tuple)):
                raise TypeError(f"The tasks for job {job!r} must be a list of addresses. Received: {tasks!r}.")
            self[job] = list(tasks)

    def as_dict(self) -> dict[str, Any]:
        """A plain dict of job name to its list of addresses ({} for a job without tasks, as TensorFlow gives)."""
        return {job: list(tasks) if tasks else {} for job, tasks in self.items()}

    @property
    def jobs(self) -> list[str]:
        """The job names of this cluster."""
        return list(self)

    def _job(self, job_name: str) -> list[str]:
        try:
            return self[job_name]
        except (KeyError, TypeError):
            raise ValueError(f"No such job in cluster: {job_name!r}") from None

    def num_tasks(self, job_name: str) -> int:
        """How many tasks the job has. Raises ValueError for a job the cluster does not have."""
        return len(self._job(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """The task indices of the job, in order. Raises ValueError for a job the cluster does not have."""
        return list(range(len(self._job(job_name))))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The address of task `task_index` of the job. Raises ValueError for an unknown job or task index."""
        tasks = self._job(job_name)
        if isinstance(task_index, bool) or not isinstance(task_index, int) or not 0 <= task_index < len(tasks):
            raise ValueError(f"No task with index {task_index!r} in job {job_name!r}")
        return tasks[task_index]

    def job_tasks(self, job_name: str) -> list[str]:
        """The job's addresses, indexed by task. Raises ValueError for a job the cluster does not have."""
        return list(self._job(job_name))

    def __bool__(self) -> bool:
        return bool(len(self))


class ClusterResolver:
    """The base of cluster resolvers: `cluster_spec()` maps each job name to its task addresses."""

    task_type: str | None = None
    task_id: int | None = None
    rpc_layer: str | None = None

    def cluster_spec(self) -> ClusterSpec:
        raise NotImplementedError

    def num_tasks(self, job: str) -> int:
        """How many tasks the job `job` ("worker", "ps", "chief") has; 0 when the cluster has no such job."""
        return len(self.cluster_spec().get(job, []))

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The address of task `task_type:task_id` (default: this task), prefixed `rpc_layer://` when one is set;
        '' where no task is named.

        Raises:
          ValueError: the cluster does not list that task, as TensorFlow's ClusterSpec.task_address does.
        """
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        if task_type is None or task_id is None:
            return ""
        tasks = self.cluster_spec().get(task_type, [])
        if not 0 <= task_id < len(tasks):
            raise ValueError(f"The cluster has no task {task_type}:{task_id}. Received: jobs "
                             f"{ {job: len(t) for job, t in self.cluster_spec().items()} }.")
        layer = rpc_layer or self.rpc_layer
        return f"{layer}://{tasks[task_id]}" if layer else tasks[task_id]

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        """Accelerators this task can use, as TensorFlow reports them: {"GPU": n}, or {} without GPUs."""
        return local_accelerators()

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
        self.task_id = task_id if task_id is not None else task.get("index")  # an int: _tf_config converts it
        self.rpc_layer = rpc_layer if rpc_layer is not None else config.get("rpc_layer")
        self._cluster = config.get("cluster", {})

    def cluster_spec(self) -> ClusterSpec:
        return ClusterSpec(self._cluster)


def local_accelerators() -> dict[str, int]:
    """{"GPU": n} for the GPUs NVML sees under CUDA_VISIBLE_DEVICES (no CUDA context is created); {} for none."""
    try:
        import pynvml  # noqa: F401 - without NVML, counting would initialise CUDA: report none instead
        from distrib.backends.cuda.devices import discover

        count = len(discover())
    except Exception:  # no NVML library, no driver: no GPU this task can use
        count = 0
    return {"GPU": count} if count else {}


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
    config["cluster"] = {job: _task_list(job, tasks, raw) for job, tasks in cluster.items()}
    task = config.get("task", {})
    if not isinstance(task, dict):
        raise ValueError(f"TF_CONFIG's \"task\" must be an object like {{\"type\": \"worker\", \"index\": 0}}. "
                         f"Received: {task!r}.")
    if task.get("type") is not None and not isinstance(task["type"], str):
        raise ValueError(f"TF_CONFIG's task type must be a job name (a string). Received: {task['type']!r}.")
    if "index" in task:  # TensorFlow reads int(task["index"]): "1" is task 1
        task = config["task"] = dict(task, index=_task_index(task["index"]))
    return config


def _task_index(index: Any) -> int:
    if isinstance(index, int) and not isinstance(index, bool):
        return index
    if isinstance(index, str) and re.fullmatch(r"\s*[-+]?\d+\s*", index):
        return int(index)
    if isinstance(index, float) and index.is_integer():
        return int(index)
    raise ValueError(f"TF_CONFIG's task index must be an integer. Received: {index!r}.")


def _task_list(job: str, tasks: list | dict, raw: str) -> list:
    """A job's addresses as a list; a {"0": address, "1": ...} object is put in the order of its indices."""
    if isinstance(tasks, list):
        return tasks
    try:
        indexed = {_task_index(index): address for index, address in tasks.items()}
    except ValueError:
        indexed = None
    if indexed is None or sorted(indexed) != list(range(len(indexed))):
        raise ValueError(f"TF_CONFIG's job {job!r} must number its tasks 0, 1, ... without gaps. Received: "
                         f"{list(tasks)}.")
    return [indexed[index] for index in range(len(indexed))]


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

    def cluster_spec(self) -> ClusterSpec:
        if self._spec is None:
            from distrib.ray_runtime import ensure_cluster

            ray = ensure_cluster()
            nodes = [node["NodeManagerAddress"] for node in ray.nodes() if node.get("Alive")] or ["localhost"]
            cpus = int(ray.cluster_resources().get("CPU", 1))
            num_ps = self._num_ps or len(nodes)
            num_workers = self._num_workers or max(1, cpus // 2)
            self._spec = {"chief": [nodes[0]], "worker": [nodes[i % len(nodes)] for i in range(num_workers)],
                          "ps": [nodes[i % len(nodes)] for i in range(num_ps)]}
        return ClusterSpec(self._spec)


class MPIClusterResolver(ClusterResolver):
    """Reads this process's place in an MPI job from the launcher's environment (Open MPI, MPICH, PMI, PMIx).

    Every rank is a "worker" task (rank 0 is the chief); task addresses are `mpi:<rank>`, since MPI itself
    connects the processes. Outside an MPI launcher the job has one task, this process.

    Args:
      task_type: the job name of every rank (default "worker").

    Example:
      >>> import distrib
      >>> resolver = distrib.cluster_resolver.MPIClusterResolver()   # a plain `python` run: one task
      >>> resolver.task_id, resolver.num_tasks("worker"), resolver.local_rank
      (0, 1, 0)
    """

    def __init__(self, task_type: str = "worker"):
        found = mpi_environment()
        self.launcher, self.task_id, self.size, self.local_rank, self.local_size = found or (None, 0, 1, 0, 1)
        if not 0 <= self.task_id < self.size:
            raise ValueError(f"The MPI rank must lie in [0, size). Received: rank {self.task_id} of {self.size} "
                             f"({self.launcher} environment).")
        self.task_type = task_type

    def cluster_spec(self) -> ClusterSpec:
        return ClusterSpec({self.task_type: [f"mpi:{rank}" for rank in range(self.size)]})


class SlurmClusterResolver(ClusterResolver):
    """Reads the cluster from Slurm's environment inside `srun` (or `sbatch`): tasks, nodes and this task's rank.

    Tasks are spread over the nodes of `SLURM_STEP_NODELIST` (or `SLURM_JOB_NODELIST`) as
    `SLURM_STEP_TASKS_PER_NODE` says, and addressed `node:port`, ports counting up from `port_base` on each node.

    Args:
      jobs: job name to task count (default: every task is a "worker").
      port_base: the first port on each node.
      gpus_per_node: GPUs reported by `num_accelerators` (default: what the node's NVML sees).
      rpc_layer: prefix of `master()`.

    Example:
      >>> import distrib, os
      >>> os.environ.update(SLURM_PROCID="1", SLURM_STEP_NUM_TASKS="4", SLURM_STEP_NODELIST="gpu[07-08]",
      ...                   SLURM_STEP_TASKS_PER_NODE="2(x2)")
      >>> resolver = distrib.cluster_resolver.SlurmClusterResolver()
      >>> resolver.cluster_spec(), resolver.task_id
      ({'worker': ['gpu07:8888', 'gpu07:8889', 'gpu08:8888', 'gpu08:8889']}, 1)
      >>> for name in ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE"):
      ...     del os.environ[name]
    """

    def __init__(self, jobs: dict[str, int] | None = None, port_base: int = 8888, gpus_per_node: int | None = None,
                 rpc_layer: str | None = None):
        rank, size = _slurm_int("SLURM_PROCID"), _slurm_int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        if not 0 <= rank < size:
            raise ValueError(f"The Slurm rank (SLURM_PROCID) must lie in [0, size). Received: rank {rank} of {size} "
                             f"tasks.")
        nodes = expand_hostlist(_slurm("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"))
        per_node = expand_tasks_per_node(_slurm("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
        if len(per_node) != len(nodes) or sum(per_node) != size:
            raise ValueError(f"Slurm's node list and tasks per node must describe {size} tasks. Received: nodes "
                             f"{nodes}, tasks per node {per_node}.")
        addresses = [f"{node}:{port_base + k}" for node, count in zip(nodes, per_node) for k in range(count)]
        jobs = {"worker": size} if jobs is None else dict(jobs)
        if any(isinstance(count, bool) or not isinstance(count, int) or count < 0 for count in jobs.values()):
            raise ValueError(f"jobs must map job names to task counts (integers >= 0). Received: {jobs}.")
        if sum(jobs.values()) != size:
            raise ValueError(f"jobs must account for every one of the {size} Slurm tasks. Received: {jobs}.")
        self._cluster, first = {}, 0
        for job, count in jobs.items():
            self._cluster[job] = addresses[first:first + count]
            if first <= rank < first + count:
                self.task_type, self.task_id = job, rank - first
            first += count
        self._gpus_per_node, self.rpc_layer = gpus_per_node, rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        return ClusterSpec(self._cluster)

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None) -> dict[str, int]:
        if self._gpus_per_node is None:
            return local_accelerators()
        return {"GPU": self._gpus_per_node} if self._gpus_per_node else {}


def _slurm(*names: str) -> str:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    raise ValueError(f"SlurmClusterResolver needs Slurm's environment ({' or '.join(names)}); run it inside "
                     f"srun or sbatch. Received: no {names[0]}.")


def _slurm_int(*names: str) -> int:
    raw = _slurm(*names)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{names[0]} must be an integer. Received: {raw!r}.") from None


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list expanded: "gpu[01-02,05],login" -> ["gpu01", "gpu02", "gpu05", "login"].

    As TensorFlow's SlurmClusterResolver reads it: each comma-separated item (commas inside brackets do not split)
    is a prefix and at most one bracketed list of N or N-M ranges, which keep their zero padding.

    Raises:
      ValueError: the list is not of that form ("rack[1-2]-node[01-02]", "node[01-02", "n]1", "n[3-1]").

    Example:
      >>> expand_hostlist("n[1-3],m7")
      ['n1', 'n2', 'n3', 'm7']
    """
    def invalid(why: str) -> ValueError:
        return ValueError(f"Invalid hostlist format {hostlist!r}: {why}. Slurm host lists look like "
                          f"'gpu[01-03,7],login'.")

    items, item, in_brackets = [], "", False
    for char in hostlist:
        if char == "[":
            if in_brackets:
                raise invalid("a '[' inside brackets")
            in_brackets = True
        elif char == "]":
            in_brackets = False  # a ']' without its '[' is refused by the item's pattern below
        elif char == "," and not in_brackets:
            if not item:
                raise invalid("an empty host name")
            items.append(item)
            item = ""
            continue
        item += char
    if in_brackets:
        raise invalid("a '[' without its ']'")
    if item:  # a trailing comma adds no host, as in TensorFlow
        items.append(item)
    hosts = []
    for item in items:
        match = re.fullmatch(r"([^,\[\]]*)(?:\[([^\]]+)\])?", item)
        if match is None:
            raise invalid(f"{item!r} is not a host name with at most one bracketed range list at its end")
        prefix, ranges = match.groups()
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            bounds = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
            if bounds is None or int(bounds.group(2) or bounds.group(1)) < int(bounds.group(1)):
                raise invalid(f"the range {part!r} is not N or N-M with N <= M")
            low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
            hosts.extend(f"{prefix}{n:0{len(low)}d}" for n in range(int(low), int(high) + 1))
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """Slurm's tasks-per-node list expanded: "2(x3),1" -> [2, 2, 2, 1].

    Example:
      >>> expand_tasks_per_node("2(x3),1")
      [2, 2, 2, 1]
    """
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(f"Slurm's tasks per node look like '2(x3),1'. Received: {spec!r}.")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts
