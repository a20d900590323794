NAME = "reduce_mean_int_axis0"
DESCRIPTION = "strategy.reduce(MEAN, PerReplica int32 vectors, axis=0): the integer mean over every element of every replica"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array([1, 2, 4], np.int32) * (ctx.replica_id_in_sync_group + 1))
    return {"mean": np.asarray(strategy.reduce("MEAN", value, axis=0)),
            "sum": np.asarray(strategy.reduce("SUM", value, axis=0))}
