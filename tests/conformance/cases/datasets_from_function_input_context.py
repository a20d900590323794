NAME = "datasets_from_function_input_context"
DESCRIPTION = "distribute_datasets_from_function: the InputContext one process sees (1 pipeline, id 0, 4 replicas, per-replica batch 16 / 4 = 4)"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    seen = []

    def dataset_fn(ctx):
        seen.append({"num_input_pipelines": ctx.num_input_pipelines, "input_pipeline_id": ctx.input_pipeline_id,
                     "num_replicas_in_sync": ctx.num_replicas_in_sync,
                     "per_replica_batch": ctx.get_per_replica_batch_size(16)})
        data = np.arange(16, dtype=np.int64)
        return [data[0:4], data[4:8]]

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    first = next(iter(dist))
    return {"contexts": seen, "first": [np.asarray(t) for t in strategy.experimental_local_results(first)]}
