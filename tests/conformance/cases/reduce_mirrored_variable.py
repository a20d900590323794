NAME = "reduce_mirrored_variable"
DESCRIPTION = "strategy.reduce of a MirroredVariable holding [1, 2]: MEAN gives the value; SUM along axis 0 sums each copy, then the 4 copies"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    with strategy.scope():
        v = distrib.Variable(np.array([1.0, 2.0], np.float32))
    return {"mean": np.asarray(strategy.reduce("MEAN", v, axis=None)),
            "sum_axis0": np.asarray(strategy.reduce("SUM", v, axis=0))}
