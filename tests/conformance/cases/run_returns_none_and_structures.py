NAME = "run_returns_none_and_structures"
DESCRIPTION = "strategy.run returning a tuple of None, a per-replica scalar and a dict: the structure is kept, None stays None"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1"])

    def step():
        rid = distrib.get_replica_context().replica_id_in_sync_group
        return None, np.float32(rid), {"k": np.array([rid, rid], np.int64)}

    nothing, scalar, mapping = strategy.run(step)
    return {"none_is_none": str(nothing is None),
            "scalar": [np.asarray(t) for t in strategy.experimental_local_results(scalar)],
            "dict": [np.asarray(t) for t in strategy.experimental_local_results(mapping["k"])]}
