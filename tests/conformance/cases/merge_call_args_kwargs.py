NAME = "merge_call_args_kwargs"
DESCRIPTION = "merge_call(fn, args=(x,), kwargs={'y': y}): the merge_fn gets PerReplica x and y and reduces both"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])

    def merge_fn(s, x, y=None):
        return s.reduce("SUM", x, axis=None), s.reduce("MEAN", y, axis=None)

    def step():
        rid = distrib.get_replica_context().replica_id_in_sync_group
        return distrib.get_replica_context().merge_call(
            merge_fn, args=(np.float32(rid),), kwargs={"y": np.array([rid, 1.0], np.float32)})

    total, mean = strategy.run(step)
    return {"sum": [np.asarray(t) for t in strategy.experimental_local_results(total)],
            "mean": [np.asarray(t) for t in strategy.experimental_local_results(mean)]}
