"""The Ray actors of one ParameterServerStrategy: its parameter servers, and its workers once a coordinator starts."""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import numpy as np

from distrib import ray_runtime
from distrib.parameter_server.server import ParameterServer
from distrib.parameter_server.variable import ParameterServerVariable, resolve
from distrib.parameter_server.worker import Worker
from distrib.variables import VariableAggregation

_keys = itertools.count()  # variable keys, unique in this process: handles of two strategies never compare equal


class Cluster:
    """Starts `num_ps` parameter-server actors now and `num_workers` worker actors on `start_workers()`.

    Actors ask for no CPUs, so they fit any cluster, and are spread over its nodes. A worker is restarted by
    Ray when its process dies (its running call fails, later calls reach the new process); a parameter
    server is not, since its variables died with it. The actors end when the strategy is garbage collected.
    """

    def __init__(self, num_ps: int, num_workers: int):
        ray = ray_runtime.ensure_cluster()
        self.num_ps, self.num_workers = num_ps, num_workers
        server = ray.remote(ParameterServer).options(num_cpus=0, max_restarts=0, scheduling_strategy="SPREAD")
        self.servers = [server.remote(index) for index in range(num_ps)]
        self.workers: list[Any] | None = None
        self._next_ps = itertools.count()
        self._actors = list(self.servers)
        self._finalizer = weakref.finalize(self, _kill, ray, self._actors)

    def start_workers(self) -> list[Any]:
        if self.workers is None:
            ray = ray_runtime.require_ray()
            worker = ray.remote(Worker).options(num_cpus=0, max_restarts=-1, max_task_retries=0,
                                                scheduling_strategy="SPREAD")
            self.workers = [worker.remote(index) for index in range(self.num_workers)]
            self._actors.extend(self.workers)
        return self.workers

    def next_ps(self) -> int:
        """The parameter server for the next unpartitioned variable: round robin."""
        return next(self._next_ps) % self.num_ps

    def create_variable(self, ps_index: int, value: np.ndarray, name: str, trainable: bool,
                        aggregation: VariableAggregation) -> ParameterServerVariable:
        key = next(_keys)
        server = self.servers[ps_index]
        resolve(server.create.remote(key, value, name), ps_index)
        return ParameterServerVariable(server, ps_index, key, value.shape, value.dtype, name, trainable, aggregation)

    def forget(self, closure_ids: list[int]) -> None:
        for server in self.servers:
            server.forget.remote(closure_ids)

    def shutdown(self) -> None:
        """Ends every actor now."""
        self._finalizer()


def _kill(ray: Any, actors: list[Any]) -> None:
    if not ray.is_initialized():
        return
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - already gone
            pass
