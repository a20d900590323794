"""strategy_bench.py's nested workloads: all_gather and Strategy.reduce of 50 leaves of 3 dtypes, checked, timed."""

from __future__ import annotations

from functools import partial

import numpy as np

import distrib
from measure import per_step_us

NESTED_LEAVES, NESTED_ROWS, NESTED_COLUMNS = 50, 8, 16  # replica r's leaves: (NESTED_ROWS + r) x NESTED_COLUMNS
NESTED_DTYPES = (np.float32, np.float16, np.int32)  # in turn, leaf by leaf
NESTED_WORKLOADS = ("all_gather_50", "reduce_50", "reduce_mean_axis0_50")


def nested_leaves(replica: int, ragged: bool) -> list[np.ndarray]:
    """Replica `replica`'s leaves, leaf k filled with k; `ragged`: lengths along axis 0 differ between replicas."""
    rows = NESTED_ROWS + replica if ragged else NESTED_ROWS
    return [np.full((rows, NESTED_COLUMNS), k, NESTED_DTYPES[k % len(NESTED_DTYPES)]) for k in range(NESTED_LEAVES)]


def all_gather_step(leaves):
    return distrib.get_replica_context().all_gather(leaves, axis=0)


def measure_nested(replicas: int, repeats: int, min_seconds: float) -> dict[str, dict]:
    """µs per call of each nested workload on `replicas` emulated replicas, after checking its result."""
    strategy = distrib.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    ragged, even = (strategy.experimental_distribute_values_from_function(
        lambda ctx, ragged=ragged: nested_leaves(ctx.replica_id_in_sync_group, ragged)) for ragged in (True, False))
    rows = sum(NESTED_ROWS + r for r in range(replicas))
    calls = {"all_gather_50": partial(strategy.run, all_gather_step, args=(ragged,)),
             "reduce_50": partial(strategy.reduce, "SUM", even, axis=None),
             "reduce_mean_axis0_50": partial(strategy.reduce, "MEAN", ragged, axis=0)}
    expected = {"all_gather_50": lambda k: np.full((rows, NESTED_COLUMNS), k),
                "reduce_50": lambda k: np.full((NESTED_ROWS, NESTED_COLUMNS), k * replicas),
                "reduce_mean_axis0_50": lambda k: np.full(NESTED_COLUMNS, k)}
    results = {}
    for name, call in calls.items():
        out = call()
        first = strategy.experimental_local_results(out)[0] if name == "all_gather_50" else out
        for k, leaf in enumerate(first):
            if not np.array_equal(leaf, expected[name](k)):
                raise SystemExit(f"distrib's {name} gave a wrong leaf {k}: {leaf}.")
        us = per_step_us(call, repeats, min_seconds)
        results[name] = {"distrib_us": us, "us_per_leaf": round(us / NESTED_LEAVES, 2)}
    strategy.close()
    return results
