"""The parameter server's bookkeeping, in process: each tagged write is applied once, untagged ones always."""

from __future__ import annotations

import numpy as np

from distrib.parameter_server.server import ParameterServer
from distrib.parameter_server.variable import ParameterServerVariable
from distrib.parameter_server.write_tags import closure_writes, next_tag


def test_a_closure_run_again_applies_each_of_its_writes_once():
    server = ParameterServer(index=0)
    server.create(7, np.zeros(4, np.float32), "v")

    def closure(delta):  # the writes a closure makes, tagged as a worker tags them
        server.write(7, "assign_add", np.full(4, delta, np.float32), next_tag(7))
        server.scatter(7, "scatter_add", np.array([0, 0]), np.array([1, 1], np.float32), next_tag(7))

    with closure_writes(closure_id=1):
        closure(1.0)
    with closure_writes(closure_id=1):  # its worker died; the re-run computes other values, same tags
        closure(5.0)
    assert server.read(7).tolist() == [3.0, 1.0, 1.0, 1.0]
    with closure_writes(closure_id=2):  # another closure's writes are new
        closure(1.0)
    assert server.read(7).tolist() == [6.0, 2.0, 2.0, 2.0]
    server.write(7, "assign", np.zeros(4, np.float32), next_tag(7))  # outside a closure: untagged, applied
    assert next_tag(7) is None and not server.read(7).any()


def test_a_branch_taken_in_one_run_only_does_not_shift_the_other_variables_tags():
    server = ParameterServer(index=0)
    server.create(1, np.zeros(1), "a")
    server.create(2, np.zeros(1), "b")
    with closure_writes(closure_id=9):
        server.write(1, "assign_add", np.ones(1), next_tag(1))  # first run: writes a, then dies
    with closure_writes(closure_id=9):
        server.write(2, "assign_add", np.ones(1), next_tag(2))  # the re-run writes b first ...
        server.write(1, "assign_add", np.ones(1), next_tag(1))  # ... then a, already applied
    assert (server.read(1)[0], server.read(2)[0]) == (1.0, 1.0)


def test_finished_closures_are_forgotten_and_functions_see_the_servers_variables():
    server = ParameterServer(index=3)
    server.create(5, np.arange(3.0), "w")
    with closure_writes(closure_id=4):
        server.write(5, "assign_sub", np.ones(3), next_tag(5))
    server.forget([4])
    assert server._applied == {}
    handle = ParameterServerVariable(None, 3, 5, (3,), np.float64, "w", True, None)  # what a closure passes
    doubled = server.call(lambda v, k: v.assign(v.read_value() * k).numpy().tolist(), (handle, 2.0), {}, None)
    assert doubled == [-2.0, 0.0, 2.0]  # the function got the server's own variable
