"""Optimizers under a ParameterServerStrategy: slots beside their variables, each update applied on its server."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from distrib.backends.cpu import to_numpy
from distrib.parameter_server.sharded_variable import ShardedVariable
from distrib.parameter_server.variable import ParameterServerVariable, Pending
from distrib.parameter_server.write_tags import next_tag
from distrib.training_dtypes import check_trainable_dtype, compute_dtype
from distrib.values import DistributedValues


def build(strategy: Any, optimizer: Any, variables: list) -> None:
    """Creates the optimizer's `iterations` and its slots for `variables` (on the coordinator, in scope)."""
    for position, var in enumerate(variables):
        _check_variable(var, position)
    optimizer._build(strategy, variables)


def apply(strategy: Any, optimizer: Any, grads: list, variables: list) -> Any:
    """One step of `optimizer`: each server updates its variables and their slots in one call, all in parallel.

    The step number (Adam's bias correction) comes from incrementing `iterations` on its server, atomically,
    so concurrent workers each get their own. Returns `iterations`.
    """
    for position, var in enumerate(variables):
        _check_variable(var, position)
    if optimizer._iterations is None or any(var not in optimizer._slots for var in variables):
        if strategy._on_worker:
            raise ValueError(f"{optimizer.name} has no slots for some variables on this worker: call "
                             f"optimizer.build(variables) inside strategy.scope() on the coordinator before "
                             f"scheduling steps (variables are created only there).")
        build(strategy, optimizer, variables)
    iterations = optimizer.iterations
    step = call_on_server(iterations, _increment, (iterations,), {}, ("step", iterations._key)).result()
    if step is None:  # a re-run closure whose increment was applied by its first run
        step = int(iterations.read_value())
    rule = _update_rule(optimizer)
    by_server: dict[int, list] = {}
    for grad, var in zip(grads, variables):
        grad = to_numpy(grad.values[0] if isinstance(grad, DistributedValues) else grad)
        if grad.shape != tuple(var.shape):
            raise ValueError(f"A gradient must have its variable's shape. Received: shape {grad.shape} for "
                             f"variable {var.name!r} of shape {var.shape}.")
        slots = [optimizer._slots[var][name] for name in optimizer.slot_names]
        if isinstance(var, ShardedVariable):
            for i, (shard, a, b) in enumerate(zip(var.variables, var._offsets, var._offsets[1:])):
                by_server.setdefault(shard._ps_index, []).append((shard, grad[a:b], [s.variables[i] for s in slots]))
        else:
            by_server.setdefault(var._ps_index, []).append((var, grad, slots))
    dtypes = {compute_dtype(var.dtype) for items in by_server.values() for var, _, _ in items}
    coefficients = {dtype.str: optimizer._coefficients(dtype, step) for dtype in dtypes}
    pending = [call_on_server(items[0][0], _update_on_server, (rule, items, coefficients), {},
                              ("apply", iterations._key, ps_index)) for ps_index, items in sorted(by_server.items())]
    for p in pending:
        p.result()
    return iterations


def _check_variable(var: Any, position: int) -> None:
    if not isinstance(var, (ParameterServerVariable, ShardedVariable)):
        raise TypeError(f"Under a ParameterServerStrategy, optimizers update variables created in its scope. "
                        f"Received: {type(var).__name__} at position {position}.")
    check_trainable_dtype(var)


def _update_rule(optimizer: Any) -> Any:
    """A copy of the optimizer with its hyperparameters and none of its variables: what travels to the servers."""
    rule = copy.copy(optimizer)
    rule._strategy, rule._iterations, rule._slots, rule._slot_list = None, None, {}, []
    return rule


def call_on_server(handle: ParameterServerVariable, fn: Any, args: tuple, kwargs: dict, tag_key: Any) -> Pending:
    """Runs `fn(*args, **kwargs)` on `handle`'s server, the handles in them that live there swapped for the
    variables."""
    return Pending(handle._server.call.remote(fn, args, kwargs, next_tag(tag_key)), handle._ps_index)


# -- run on a parameter server ------------------------------------------------------------------------------

def _increment(iterations: Any) -> int:
    iterations.assign_add(1)
    return int(iterations.read_value())


def _update_on_server(rule: Any, items: list, coefficients: dict) -> None:
    groups: dict[np.dtype, list] = {}
    for var, grad, slots in items:
        dtype = compute_dtype(var.dtype)
        groups.setdefault(dtype, []).append((var, to_numpy(grad).astype(dtype, copy=False), tuple(slots)))
    for dtype, group in groups.items():
        rule._update_device(np, group, coefficients[dtype.str])
