"""Parameter-server training on Ray: partitioners, ShardedVariable, ParameterServerStrategy, ClusterCoordinator."""
