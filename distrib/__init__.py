"""distrib: TensorFlow's tf.distribute programming model on CuPy and NCCL, with a NumPy CPU emulator."""

from distrib import cluster_resolver, coordinator, errors, experimental, optimizers, runner
from distrib._version import __version__
from distrib.checkpoint import Checkpoint
from distrib.cross_device_ops import (CollectiveAllReduce, CrossDeviceOps, HierarchicalCopyAllReduce, NcclAllReduce,
                                     ReductionToOneDevice)
from distrib.context import (get_cross_replica_context, get_replica_context, get_strategy, has_strategy,
                             in_cross_replica_context)
from distrib.distributed_variables import DistributedVariable, MirroredVariable, SyncOnReadVariable
from distrib.extended import StrategyExtended
from distrib.input import (DistributedDataset, DistributedDatasetsFromFunction, DistributedIterator, InputContext,
                           ValueContext)
from distrib.mirrored import MirroredStrategy
from distrib.multi_worker import MultiWorkerMirroredStrategy
from distrib.options import (AutoShardPolicy, CommunicationImplementation, CommunicationOptions, InputOptions,
                             InputReplicationMode, ReduceOp, RunOptions)
from distrib.parameter_server.sharded_variable import ShardedVariable
from distrib.parameter_server.strategy import ParameterServerStrategy
from distrib.replica_context import ReplicaContext
from distrib.strategy import Strategy
from distrib.values import DistributedValues, Mirrored, PerReplica
from distrib.variables import IndexedSlices, Variable, VariableAggregation, VariableSynchronization

__all__ = [
    "__version__",
    "AutoShardPolicy",
    "Checkpoint",
    "CollectiveAllReduce",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "DistributedValues",
    "DistributedVariable",
    "HierarchicalCopyAllReduce",
    "IndexedSlices",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "Mirrored",
    "MirroredStrategy",
    "MirroredVariable",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "ParameterServerStrategy",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "RunOptions",
    "ShardedVariable",
    "Strategy",
    "StrategyExtended",
    "SyncOnReadVariable",
    "ValueContext",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "cluster_resolver",
    "coordinator",
    "errors",
    "experimental",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "optimizers",
    "runner",
]
