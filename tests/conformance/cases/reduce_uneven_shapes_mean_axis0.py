NAME = "reduce_uneven_shapes_mean_axis0"
DESCRIPTION = "strategy.reduce(MEAN, axis=0) of per-replica batches of 3, 1, 2 and 0 rows: the mean over the 6 rows"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    rows = [3, 1, 2, 0]
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.arange(2 * rows[ctx.replica_id_in_sync_group], dtype=np.float32).reshape(-1, 2)
        + 10 * ctx.replica_id_in_sync_group)
    return {"mean": np.asarray(strategy.reduce("MEAN", value, axis=0)),
            "sum": np.asarray(strategy.reduce("SUM", value, axis=0))}
