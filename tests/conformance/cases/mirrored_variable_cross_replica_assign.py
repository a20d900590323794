NAME = "mirrored_variable_cross_replica_assign"
DESCRIPTION = "MirroredVariable (MEAN) assign, assign_add and assign_sub in the cross-replica context write every copy alike"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    with strategy.scope():
        v = distrib.Variable(np.array([1.0, 2.0], np.float32), aggregation=distrib.VariableAggregation.MEAN)
        v.assign(np.array([5.0, 6.0], np.float32))
        after_assign = [np.asarray(c) for c in strategy.experimental_local_results(v)]
        v.assign_add(np.array([1.0, 1.0], np.float32))
        v.assign_sub(np.array([0.5, 3.0], np.float32))
    return {"after_assign": after_assign, "copies": [np.asarray(c) for c in strategy.experimental_local_results(v)]}
