NAME = "all_gather_nested"
DESCRIPTION = "ReplicaContext.all_gather of a dict of a [2] vector and a [1, 3] matrix along axis 0: every replica gets both stacked"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])

    def step():
        rid = distrib.get_replica_context().replica_id_in_sync_group
        value = {"a": np.array([rid, rid + 10], np.float32), "b": np.full((1, 3), rid, np.int32)}
        return distrib.get_replica_context().all_gather(value, 0)

    out = strategy.run(step)
    return {key: [np.asarray(t) for t in strategy.experimental_local_results(out[key])] for key in ("a", "b")}
