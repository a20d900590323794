"""distrib.experimental.partitioners: how ParameterServerStrategy splits variables along their first axis."""

from distrib.parameter_server.partitioners import (FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner,
                                                   Partitioner)

__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner"]
