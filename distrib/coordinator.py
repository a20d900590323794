"""distrib.coordinator: TensorFlow's tf.distribute.coordinator names (ClusterCoordinator, RemoteValue)."""

from distrib.parameter_server.coordinator import ClusterCoordinator, RemoteValue
from distrib.parameter_server.worker import PerWorkerDataset, PerWorkerIterator, PerWorkerValues

__all__ = ["ClusterCoordinator", "PerWorkerDataset", "PerWorkerIterator", "PerWorkerValues", "RemoteValue"]
