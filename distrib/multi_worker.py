"""MultiWorkerMirroredStrategy: MirroredStrategy over the processes of an MPI job, every replica in one sync group.

Each process (launched by `mpirun` or `srun`) drives its own replicas with the replica threads of
MirroredStrategy; every collective spans every replica of every process: on GPUs one NCCL communicator over
every GPU of every process, on the CPU emulator the same plans over MPI. Reductions to one device become
all-reduces (CollectiveAllReduce), as in TensorFlow, since the other processes' values are not here.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from distrib import context
from distrib.backends import get_multi_process_backend
from distrib.cluster_resolver import ClusterResolver, MPIClusterResolver
from distrib.cross_device_ops import CollectiveAllReduce
from distrib.input.contexts import InputWorkers
from distrib.mirrored import MirroredExtended, checked_communication_options
from distrib.options import CommunicationOptions, ReduceOp
from distrib.reduce_inputs import REDUCIBLE, check_reduce_inputs
from distrib.replica_context import check_gather_shapes
from distrib.strategy import Strategy
from distrib.values import Mirrored, PerReplica, flatten, local_components, unflatten


class MultiWorkerExtended(MirroredExtended):
    """StrategyExtended of MultiWorkerMirroredStrategy: this process's replicas, collectives over all processes."""

    def __init__(self, container_strategy: Strategy, backend: Any, communication_options: CommunicationOptions,
                 execution: str | None = None):
        self._group = backend.group
        self._first_local_replica = self._group.first_replica
        # where some process has one replica, its `run` returns plain values: see `_local_components`
        self._plain_values_are_components = 1 in self._group.replica_counts
        super().__init__(container_strategy, backend, backend.default_devices(), CollectiveAllReduce(),
                         communication_options, execution)

    def reduce_to(self, reduce_op: Any, value: Any, destinations: Any, options: CommunicationOptions | None = None
                  ) -> Any:
        """As StrategyExtended's. The usual call of a step, a PerReplica of one NumPy array onto itself (one
        emulated replica in this process), goes straight to the all-reduce: the general route's checks for it in
        four Python calls fewer, each of which costs microseconds right after a large transfer has left the
        caches cold (the same sum, in the same Mirrored)."""
        arrays = value._values if type(value) is PerReplica and destinations is value else None
        if arrays is None or len(arrays) != 1 or type(arrays[0]) is not np.ndarray or len(self._devices) != 1 or \
                not self._host_arrays:
            return self._refusing(super().reduce_to, reduce_op, value, destinations, options)
        context.require_cross_replica("reduce_to", self._strategy_ref())
        op = ReduceOp.from_value(reduce_op)
        if arrays[0].dtype not in REDUCIBLE:
            self._refusing(check_reduce_inputs, arrays, 0)
        reduced = self._cross_device_ops.batch_all_reduce(self._backend, op, [[arrays[0]]], self._devices,
                                                          self._options if options is None else
                                                          self._options.merge(options))
        result = Mirrored.__new__(Mirrored)  # `Mirrored._wrap` inline
        result._values = (reduced[0][0],)
        return result

    # A process that refuses a collective's values before making it (its replicas disagree, a value cannot be
    # reduced) says so to the others: they raise CollectiveMismatchError at that collective instead of making it,
    # and its next collective cannot pair with theirs (which summed the wrong values, or waited for good).

    def _refuse_collective(self) -> None:
        self._group.collectives.refuse(self._options.timeout)

    def _refusing(self, collective: Callable[..., Any], *args: Any) -> Any:
        """`collective(*args)`, refusing it where it raises ValueError or TypeError before announcing anything."""
        channel = self._group.collectives
        sequence = channel.sequence
        try:
            return collective(*args)
        except (ValueError, TypeError):
            if channel.sequence == sequence:
                self._refuse_collective()
            raise

    def _rendezvous(self, replica_id, kind, merge, payload, options):
        if kind != "merge_call":  # a merge_call's function is the program's: its errors are not a refusal
            merge = functools.partial(self._refusing, merge)
        return super()._rendezvous(replica_id, kind, merge, payload, options)

    # `_batch_reduce_to` is called only by `reduce_to` (above), `batch_reduce_to` and `_reduce_to_host`: each of them
    # refuses what it raises too
    def batch_reduce_to(self, reduce_op, value_destination_pairs, options=None):
        return self._refusing(super().batch_reduce_to, reduce_op, value_destination_pairs, options)

    def _reduce_to_host(self, op, leaves, axis):
        return self._refusing(super()._reduce_to_host, op, leaves, axis)

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process writes checkpoints: only the chief (rank 0) does."""
        return self._group.rank == 0

    def _barrier(self, what: str) -> None:
        self._group.barrier(what, self._options.timeout)

    def _create_variable(self, initial_value: Any, *args: Any, **kwargs: Any) -> Any:
        """As MirroredStrategy's, every process starting from the chief's initial value (TensorFlow broadcasts it
        too, so that workers seeded differently still train one model)."""
        if callable(initial_value):
            initial_value = initial_value()
        return super()._create_variable(self._first_replica_value(initial_value), *args, **kwargs)

    def _local_components(self, value: Any) -> tuple | None:
        # A process with one replica gets plain values from `run`: they are its replica's, and are reduced across
        # the processes (batched with the rest), as TensorFlow does with one replica per worker. Zero too: whether
        # a process takes part in a collective must not depend on its value (one replica's 0 beside the others' 1s
        # left that process a collective behind the rest, which then waited for it for good). The choice must be
        # the same on every process, or one would wait in a collective that another never makes: so where any
        # process has one replica, a plain value is every local replica's value on every process (a constant's
        # SUM is then the constant times the replicas, as with one replica per process).
        components = local_components(value)
        if components is None and self._plain_values_are_components:
            return (value,) * len(self._devices)
        return components

    def _first_replica_value(self, value: Any) -> Any:
        array = self._backend.to_device(value, self._devices[0])
        return self._backend.broadcast(array, self._devices[:1], timeout=self._options.timeout)[0]

    def _input_workers(self) -> InputWorkers:
        group = self._group

        def any_worker_has_data(local: bool) -> bool:  # every worker stops on the same step
            return group.any_rank_has(local, self._options.timeout)

        return InputWorkers(self._backend, self._devices, group.size, group.rank, any_worker_has_data,
                            group.first_replica, group.num_replicas)


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over several processes (and machines): MirroredStrategy's API, every
    replica of every process in one sync group.

    Launch one process per host (or per GPU) with `mpirun -np N python train.py` or `srun`; every process runs
    the same program. `num_replicas_in_sync` counts every process's replicas; `experimental_local_results`
    returns this process's. On GPUs each process drives its share of the host's GPUs; on the CPU emulator it
    drives `$DISTRIB_CPU_REPLICAS` (default 2) emulated replicas. The chief (rank 0) writes checkpoints.

    Args:
      cluster_resolver: where this process sits in the job; default `MPIClusterResolver()` (the launcher's
        environment). A `TFConfigClusterResolver` or `SlurmClusterResolver` is accepted when its task count
        matches the MPI job's.
      communication_options: default `CommunicationOptions` for every collective (its timeout bounds how long
        a rank waits for a failed or stalled peer).
      replica_execution: how this process's replicas run, as for `MirroredStrategy`: "threads" or
        "cooperative" (emulated replicas only); None reads `$DISTRIB_REPLICA_EXECUTION`.

    Example:
      >>> import distrib, numpy as np
      >>> strategy = distrib.MultiWorkerMirroredStrategy()   # a plain `python` run: one worker
      >>> out = strategy.run(lambda: distrib.get_replica_context().all_reduce("SUM", np.float32(1)))
      >>> float(strategy.reduce("SUM", out, axis=None)) == strategy.num_replicas_in_sync ** 2
      True
    """

    def __init__(self, cluster_resolver: ClusterResolver | None = None,
                 communication_options: CommunicationOptions | None = None, *,
                 replica_execution: str | None = None):
        if cluster_resolver is None:
            cluster_resolver = MPIClusterResolver()
        elif not isinstance(cluster_resolver, ClusterResolver):
            raise TypeError(f"cluster_resolver must be a distrib cluster resolver such as MPIClusterResolver(). "
                            f"Received: {type(cluster_resolver).__name__}.")
        communication_options = checked_communication_options(communication_options)
        backend = get_multi_process_backend()
        group = backend.group
        tasks = sum(len(t) for job, t in cluster_resolver.cluster_spec().items() if job in ("chief", "worker"))
        if tasks not in (0, group.size):
            raise ValueError(f"The cluster resolver must describe the MPI job's {group.size} processes. Received: "
                             f"{tasks} chief and worker tasks in {cluster_resolver!r}.")
        if tasks and cluster_resolver.task_type in ("chief", "worker"):
            cluster_resolver.master()  # raises where its own task is not in its cluster (TF_CONFIG's index past it)
        if tasks:
            _check_task_is_rank(cluster_resolver, group.rank)
        self._cluster_resolver = cluster_resolver
        super().__init__(MultiWorkerExtended(self, backend, communication_options, replica_execution))

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas are kept in sync: every replica of every process."""
        return self._extended._group.num_replicas

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates every replica's component of every process along `axis` into one host NumPy array."""
        self._extended._require_cross_replica("Strategy.gather", hint="inside a replica function use "
                                              "distrib.get_replica_context().all_gather(value, axis)")
        extended = self._extended
        devices = extended.worker_devices
        leaves, spec = flatten(value)
        per_leaf = []
        for leaf, path in zip(leaves, spec.paths()):
            arrays = [extended.backend.to_device(c, d) for c, d in zip(local_components(leaf) or (leaf,) * len(devices),
                                                                      devices)]
            extended._refusing(check_gather_shapes, "Strategy.gather", [a.shape for a in arrays],
                               [a.dtype for a in arrays], axis, path, extended._first_local_replica)
            per_leaf.append(arrays)
        if not per_leaf:
            return unflatten(spec, [])
        gathered = extended._batch_all_gather([list(values) for values in zip(*per_leaf)], axis, extended._options)
        return unflatten(spec, [extended.backend.to_host(array) for array in gathered[0]])

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """Where this process sits in the job: `task_type`, `task_id`, `cluster_spec()`, `num_accelerators()`."""
        return self._cluster_resolver

    def __repr__(self) -> str:
        group = self._extended._group
        return (f"<MultiWorkerMirroredStrategy rank={group.rank} of {group.size}, "
                f"devices={self._extended.worker_devices}, replicas={self.num_replicas_in_sync}>")


def _check_task_is_rank(resolver: ClusterResolver, rank: int) -> None:
    """ValueError unless the resolver's task is this MPI rank's: the chief (else worker 0) is rank 0, as MPI's
    rank 0 checkpoints, then the workers in order. Without the check a TF_CONFIG that names another task (or
    every process worker 0) trains as given, and code that writes where `task_id == 0`, as TensorFlow's examples
    do, disagrees with `should_checkpoint`; an evaluator or a parameter server would train as a worker."""
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type not in ("chief", "worker"):
        raise ValueError(f"MultiWorkerMirroredStrategy trains on chief and worker tasks; a task of type "
                         f"{task_type!r} does not join its replicas (run it without the strategy). Received: task "
                         f"{task_type}:{task_id} for MPI rank {rank}, from {resolver!r}.")
    chiefs = len(resolver.cluster_spec().get("chief", ()))
    position = 0 if task_type == "chief" else chiefs + int(task_id)
    if position != rank:
        expected = ("chief:0" if chiefs else "worker:0") if rank == 0 else f"worker:{rank - chiefs}"
        raise ValueError(f"The cluster resolver's task must be this process's: MPI rank {rank} is {expected} (the "
                         f"chief, else worker 0, is rank 0, then the workers in order). Received: task "
                         f"{task_type}:{task_id} from {resolver!r}; set TF_CONFIG's task index per process, or leave "
                         f"the resolver out (MPIClusterResolver reads the rank).")

