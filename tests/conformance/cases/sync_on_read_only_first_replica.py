NAME = "sync_on_read_only_first_replica"
DESCRIPTION = "SyncOnReadVariable (ON_READ, ONLY_FIRST_REPLICA): a cross-replica read gives replica 0's copy"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    with strategy.scope():
        v = distrib.Variable(np.float32(0.0), synchronization=distrib.VariableSynchronization.ON_READ,
                             aggregation=distrib.VariableAggregation.ONLY_FIRST_REPLICA)

    def step():
        v.assign(np.float32(distrib.get_replica_context().replica_id_in_sync_group + 5))

    strategy.run(step)
    with strategy.scope():
        read = np.asarray(v.read_value())
    return {"cross_replica_read": read}
