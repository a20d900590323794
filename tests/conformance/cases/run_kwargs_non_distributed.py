NAME = "run_kwargs_non_distributed"
DESCRIPTION = "strategy.run(fn, args=(PerReplica,), kwargs={'scale': 3.0, 'offset': PerReplica}): plain arguments reach every replica as they are"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array([ctx.replica_id_in_sync_group + 1.0], np.float32))
    offset = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(10 * ctx.replica_id_in_sync_group))
    out = strategy.run(lambda v, scale, offset: v * scale + offset, args=(x,), kwargs={"scale": 3.0, "offset": offset})
    return [np.asarray(t) for t in strategy.experimental_local_results(out)]
