NAME = "error_scope_object_reentered"
DESCRIPTION = "The same strategy.scope() object entered again after it exited raises (TensorFlow's scope is single-use: AttributeError)"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    scope = strategy.scope()
    with scope:
        distrib.Variable(np.float32(1.0))
    with scope:
        return distrib.Variable(np.float32(3.0))
