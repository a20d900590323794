NAME = "variable_none_aggregation_assign_in_replica"
DESCRIPTION = "MirroredVariable with aggregation NONE: assign_add(replica_id + 1) in a replica context, then the copies"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        v = distrib.Variable(np.float32(0.0), aggregation=distrib.VariableAggregation.NONE)
    strategy.run(lambda: v.assign_add(np.float32(distrib.get_replica_context().replica_id_in_sync_group + 1)))
    return {"copies": [np.asarray(c) for c in strategy.experimental_local_results(v)]}
