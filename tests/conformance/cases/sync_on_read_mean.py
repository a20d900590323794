NAME = "sync_on_read_mean"
DESCRIPTION = "SyncOnReadVariable (ON_READ, MEAN): replicas write 1..4 to their own copies; a cross-replica read gives the mean 2.5"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    with strategy.scope():
        v = distrib.Variable(np.array([0.0, 0.0], np.float32), synchronization=distrib.VariableSynchronization.ON_READ,
                             aggregation=distrib.VariableAggregation.MEAN)

    def step():
        rid = distrib.get_replica_context().replica_id_in_sync_group
        v.assign(np.array([rid + 1.0, 2.0 * rid], np.float32))
        return v.read_value()

    local = strategy.experimental_local_results(strategy.run(step))
    with strategy.scope():
        read = np.asarray(v.read_value())
    return {"replica_reads": [np.asarray(t) for t in local], "cross_replica_read": read}
