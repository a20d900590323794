"""distrib.runner: the TF-GNN runner's ParameterServerStrategy wrapper, built from TF_CONFIG."""

from __future__ import annotations

from distrib.cluster_resolver import TFConfigClusterResolver
from distrib.parameter_server.partitioners import MinSizePartitioner
from distrib.parameter_server.strategy import ParameterServerStrategy as _ParameterServerStrategy

__all__ = ["ParameterServerStrategy"]


class ParameterServerStrategy(_ParameterServerStrategy):
    """A `ParameterServerStrategy` convenience wrapper: the cluster from `TF_CONFIG`, variables split by size.

    It builds the strategy with `TFConfigClusterResolver()` and
    `MinSizePartitioner(min_shard_bytes or 256 << 10, max_shards=<number of ps tasks>)`, as TF-GNN's
    `runner.ParameterServerStrategy` does: every shard holds at least `min_shard_bytes`, each server at most one
    shard of a variable.

    Args:
      min_shard_bytes: the smallest shard in bytes; None means 256 KiB.

    Example:
      >>> import distrib, distrib.runner, json, os, numpy as np
      >>> os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": ["w0:1"], "ps": ["p0:1", "p1:1"]},
      ...                                       "task": {"type": "chief", "index": 0}})
      >>> strategy = distrib.runner.ParameterServerStrategy(min_shard_bytes=64)
      >>> with strategy.scope():
      ...     table = distrib.Variable(np.zeros((10, 4), np.float32))  # 160 bytes: 2 shards of at least 64
      >>> [v.shape for v in table.variables]
      [(5, 4), (5, 4)]
      >>> del os.environ["TF_CONFIG"]
    """

    def __init__(self, min_shard_bytes: int | None = None):
        resolver = TFConfigClusterResolver()
        if not resolver.cluster_spec():
            raise ValueError("runner.ParameterServerStrategy reads the cluster from TF_CONFIG, which is not set. Set "
                             "it (a \"cluster\" with \"worker\" and \"ps\" tasks), or use "
                             "distrib.ParameterServerStrategy with a RayClusterResolver.")
        partitioner = MinSizePartitioner(min_shard_bytes=min_shard_bytes or 256 << 10,
                                         max_shards=max(1, resolver.num_tasks("ps")))
        super().__init__(resolver, partitioner)
