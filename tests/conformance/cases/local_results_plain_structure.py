NAME = "local_results_plain_structure"
DESCRIPTION = "experimental_local_results of a run() result that is a dict or list of Python values (no distributed leaves) gives one copy per replica"


def run_distrib(distrib, np):
    strategy = distrib.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    local = strategy.experimental_local_results
    as_dict = local(strategy.run(lambda: {"rate": 0.5, "steps": [1, 2]}))
    as_list = local(strategy.run(lambda: [3.0, 4.0]))
    return {"dict": [{"rate": d["rate"], "steps": list(d["steps"])} for d in as_dict],
            "list": [list(item) for item in as_list]}
