NAME = "error_reduce_to_non_distributed_sum"
DESCRIPTION = "extended.reduce_to(SUM) of a non-distributed value onto an array's device raises (the sum over 4 replicas of one value is ambiguous)"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    destination = distrib.Variable(np.zeros(2, np.float32)).read_value()  # an array (a tensor in TensorFlow)
    return strategy.extended.reduce_to("SUM", destination * 2.0, destinations=destination)
