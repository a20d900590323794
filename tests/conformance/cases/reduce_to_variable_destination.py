NAME = "reduce_to_variable_destination"
DESCRIPTION = "extended.reduce_to(SUM, PerReplica, destinations=a MirroredVariable): a Mirrored value on the variable's devices"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    with strategy.scope():
        v = distrib.Variable(np.zeros(2, np.float32))
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array([ctx.replica_id_in_sync_group, 1.0], np.float32))
    reduced = strategy.extended.reduce_to("SUM", value, destinations=v)
    return {"type": type(reduced).__name__, "values": [np.asarray(t) for t in strategy.experimental_local_results(reduced)]}
