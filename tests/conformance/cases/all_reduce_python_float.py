NAME = "all_reduce_python_float"
DESCRIPTION = "ReplicaContext.all_reduce(SUM) of a 0-d float32 replica value and of a [2] float64 array: each keeps its dtype"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])

    def step():
        ctx = distrib.get_replica_context()
        rid = ctx.replica_id_in_sync_group
        return ctx.all_reduce("SUM", np.float32(rid) * 0.5), ctx.all_reduce("MEAN", np.array([rid, 1.0]))

    a, b = strategy.run(step)
    return {"f32": np.asarray(strategy.experimental_local_results(a)[0]),
            "f64_mean": np.asarray(strategy.experimental_local_results(b)[3])}
