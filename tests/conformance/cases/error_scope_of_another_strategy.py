NAME = "error_scope_of_another_strategy"
DESCRIPTION = "Entering another strategy's scope inside one strategy's scope raises RuntimeError"


def run_distrib(distrib, np):
    first = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    second = distrib.MirroredStrategy(["CPU:0", "CPU:1"])
    with first.scope():
        with second.scope():
            return distrib.Variable(np.float32(1.0))
