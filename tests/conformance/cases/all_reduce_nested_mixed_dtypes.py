NAME = "all_reduce_nested_mixed_dtypes"
DESCRIPTION = "ReplicaContext.all_reduce of a dict of float32, float64 and int64 leaves, SUM and MEAN"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])

    def step():
        ctx = distrib.get_replica_context()
        rid = ctx.replica_id_in_sync_group
        value = {"f32": np.array([rid, 0.5], np.float32), "f64": np.float64(rid * 0.25),
                 "nested": [np.array([rid + 1], np.int64), np.array([[1.0, rid]], np.float32)]}
        return ctx.all_reduce("SUM", value), ctx.all_reduce("MEAN", {"f32": value["f32"], "f64": value["f64"]})

    summed, mean = strategy.run(step)
    first = lambda v: np.asarray(strategy.experimental_local_results(v)[0])
    return {"sum": {"f32": first(summed["f32"]), "f64": first(summed["f64"]),
                    "nested": [first(summed["nested"][0]), first(summed["nested"][1])]},
            "mean": {"f32": first(mean["f32"]), "f64": first(mean["f64"])}}
