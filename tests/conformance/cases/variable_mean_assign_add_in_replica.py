NAME = "variable_mean_assign_add_in_replica"
DESCRIPTION = "MirroredVariable (MEAN): each replica assign_adds replica_id + 1 in a run; the mean update 2.5 is added to every copy"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    with strategy.scope():
        v = distrib.Variable(np.float32(1.0), aggregation=distrib.VariableAggregation.MEAN)

    def step():
        v.assign_add(np.float32(distrib.get_replica_context().replica_id_in_sync_group + 1))
        return v.read_value()

    local = strategy.experimental_local_results(strategy.run(step))
    return {"replica_reads": [np.asarray(t) for t in local], "copies": [np.asarray(c) for c in strategy.experimental_local_results(v)]}
