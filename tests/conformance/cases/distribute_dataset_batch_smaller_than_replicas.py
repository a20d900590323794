NAME = "distribute_dataset_batch_smaller_than_replicas"
DESCRIPTION = "Global batches of 3 then 1 over 4 replicas: sizes 1,1,1,0 then 1,0,0,0 (empty pieces keep the row shape)"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    data = np.arange(8, dtype=np.float32).reshape(4, 2)
    dist = strategy.experimental_distribute_dataset([data[0:3], data[3:4]])
    return [[np.asarray(t) for t in strategy.experimental_local_results(batch)] for batch in dist]
