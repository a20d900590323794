"""One local Ray cluster for every test that needs one: starting Ray costs seconds, so it starts once."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster (2 CPUs, a small object store, no dashboard), shared by the whole test session.

    The test modules travel with their closures (pickled by value): Ray's processes do not have the tests
    on their path, as a real cluster would not have a program's own modules without a `runtime_env`.
    """
    ray = pytest.importorskip("ray")
    for name, module in list(sys.modules.items()):
        if name.startswith(("test_coordinator", "test_ps_strategy")):
            ray.cloudpickle.register_pickle_by_value(module)
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=80 << 20,
                 configure_logging=False)
    return ray
