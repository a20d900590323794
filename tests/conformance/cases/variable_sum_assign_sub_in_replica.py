NAME = "variable_sum_assign_sub_in_replica"
DESCRIPTION = "MirroredVariable (SUM): each replica assign_subs [replica_id, 1]; the summed update [6, 4] is subtracted from every copy"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    with strategy.scope():
        v = distrib.Variable(np.array([10.0, 10.0], np.float32), aggregation=distrib.VariableAggregation.SUM)

    def step():
        rid = distrib.get_replica_context().replica_id_in_sync_group
        v.assign_sub(np.array([rid, 1.0], np.float32))

    strategy.run(step)
    return {"copies": [np.asarray(c) for c in strategy.experimental_local_results(v)]}
