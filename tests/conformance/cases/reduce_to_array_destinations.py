NAME = "reduce_to_array_destinations"
DESCRIPTION = "extended.reduce_to(SUM/MEAN, PerReplica, destinations=<an array>): the array's device is the destination"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array([1.0, 2.0], np.float32) * np.float32(ctx.replica_id_in_sync_group + 1))
    destination = distrib.Variable(np.zeros(2, np.float32)).read_value()  # an array (a tensor in TensorFlow)
    local = strategy.experimental_local_results
    total = strategy.extended.reduce_to("SUM", value, destinations=destination)
    mean = strategy.extended.reduce_to(distrib.ReduceOp.MEAN, value, destinations=destination)
    return {"sum": [np.asarray(t) for t in local(total)], "mean": [np.asarray(t) for t in local(mean)]}
