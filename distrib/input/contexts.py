"""What input functions are told: ValueContext, InputContext, and InputWorkers (where this process's input goes)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Callable

from distrib.backends.base import Backend


class ValueContext:
    """What `experimental_distribute_values_from_function` tells `value_fn`: which replica, out of how many."""

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"ValueContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


@dataclass(frozen=True)
class InputContext:
    """What `distribute_datasets_from_function` tells `dataset_fn`: which pipeline it builds, out of how many.

    Its fields are read-only, as TensorFlow's: a dataset_fn that changed them would change what later calls are told.

    Example:
      >>> InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=4).get_per_replica_batch_size(8)
      2
    """

    num_input_pipelines: int = 1  # one per worker
    input_pipeline_id: int = 0  # the one this call builds
    num_replicas_in_sync: int = 1  # across every worker

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """`global_batch_size // num_replicas_in_sync`; ValueError unless it divides evenly."""
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, numbers.Integral):
            raise TypeError(f"The global batch size must be an int. Received: {global_batch_size!r}.")
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(f"The global batch size ({global_batch_size}) must be divisible by the number of "
                             f"replicas in sync ({self.num_replicas_in_sync}).")
        return global_batch_size // self.num_replicas_in_sync


@dataclass(frozen=True)
class InputWorkers:
    """Where this process's input goes: its replicas' devices, and its place among the input workers.

    A multi-worker strategy sets `num_workers`/`worker_index`, the global id of this worker's first replica and
    every worker's replica count (workers may drive different numbers of devices), and `any_worker_has_data`,
    which must return True while any worker still has data, so that every worker stops on the same step.
    """

    backend: Backend
    devices: tuple[str, ...]  # this worker's replicas
    num_workers: int = 1
    worker_index: int = 0
    any_worker_has_data: Callable[[bool], bool] = field(default=lambda local: local)
    first_replica: int | None = None  # the global replica id of devices[0] (None: as if workers were alike)
    all_replicas: int | None = None  # every worker's replicas (None: this worker's, times num_workers)

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self.devices) * self.num_workers if self.all_replicas is None else self.all_replicas

    @property
    def wraps_values(self) -> bool:
        """Whether steps come as PerReplica values: TensorFlow yields one replica's batch in one process as is."""
        return self.num_workers > 1 or len(self.devices) > 1

    @property
    def first_local_replica(self) -> int:
        return self.worker_index * len(self.devices) if self.first_replica is None else self.first_replica
