NAME = "distribute_dataset_three_replicas"
DESCRIPTION = "Global batches of 8 then 2 over 3 replicas: pieces of ceil(B/3), sizes 3,3,2 then 1,1,0"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    data = np.arange(20, dtype=np.float32).reshape(10, 2)
    dist = strategy.experimental_distribute_dataset([data[0:8], data[8:10]])
    return [[np.asarray(t) for t in strategy.experimental_local_results(batch)] for batch in dist]
