NAME = "scope_object_nested"
DESCRIPTION = "The same strategy.scope() object entered again inside itself: variables made in either are mirrored"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    scope = strategy.scope()
    with scope:
        with scope:
            inner = distrib.Variable(np.float32(1.0))
            in_inner = distrib.get_strategy() is strategy
        outer = distrib.Variable(np.float32(2.0))
        in_outer = distrib.get_strategy() is strategy
    local = strategy.experimental_local_results
    return {"types": [type(inner).__name__, type(outer).__name__],
            "values": [[np.asarray(t) for t in local(v)] for v in (inner, outer)],
            "in_scope": [in_inner, in_outer, distrib.has_strategy()]}
