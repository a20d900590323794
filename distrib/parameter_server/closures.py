"""A scheduled closure pickled once, on the coordinator: what cannot travel is named there, not in Ray's dump."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

from distrib.parameter_server.worker import run_in_scope
from distrib.variables import _ArrayOperators


def function_name(fn: Any) -> str:
    """The name to show for a scheduled callable: its `__name__` (of the function a partial wraps), else its type."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def pack(scope: Callable[[], Any], fn: Callable, args: tuple, kwargs: dict) -> bytes:
    """`fn(*args, **kwargs)` run under the strategy `scope()` makes on the worker, pickled as Ray would pickle it.

    Pickled here, once, so a closure that cannot travel fails at `schedule` (a re-run sends the same bytes).

    Raises:
      TypeError: something in fn, its captured and global names, or its arguments cannot be pickled; the
        message names it (a `distrib.Variable` created outside the strategy's scope is the usual one).
    """
    from ray import cloudpickle  # the coordinator has Ray: its strategy started the actors

    try:
        return cloudpickle.dumps((functools.partial(run_in_scope, scope, fn), args, kwargs))
    except Exception as exc:  # noqa: BLE001 - pickling fails in many types
        where, culprit = _find_unpicklable(cloudpickle, fn, args, kwargs)
        name = function_name(fn)
        if isinstance(culprit, _ArrayOperators):
            raise TypeError(f"Scheduled function {name!r} uses a variable created outside the strategy's scope, "
                            f"which lives in this process and cannot travel to the workers: create it under "
                            f"strategy.scope(). Received: {culprit!r} as {where}.") from None
        raise TypeError(f"Scheduled function {name!r} cannot be sent to a worker: {where} cannot be pickled. "
                        f"Received: {type(culprit).__name__} ({exc}).") from None


def _find_unpicklable(cloudpickle: Any, fn: Any, args: tuple, kwargs: dict) -> tuple[str, Any]:
    """(where, object): the innermost part that does not pickle, looking into fn's captured and global names."""
    for where, value in [*((f"args[{i}]", a) for i, a in enumerate(args)),
                         *((f"kwargs[{k!r}]", v) for k, v in kwargs.items()), ("the function", fn)]:
        if not _pickles(cloudpickle, value):
            return _inside(cloudpickle, where, value, depth=3)
    return "the function", fn  # each part pickles alone: name the whole


def _inside(cloudpickle: Any, where: str, value: Any, depth: int) -> tuple[str, Any]:
    if depth:
        for name, part in _parts(value):
            if not _pickles(cloudpickle, part):
                return _inside(cloudpickle, f"{name!r} (used by {function_name(value)})", part, depth - 1)
    return where, value


def _parts(fn: Any) -> Iterator[tuple[str, Any]]:
    """The names a function uses that cloudpickle sends with it: captured cells, then globals, then defaults."""
    while isinstance(fn, functools.partial):
        yield from ((f"argument {i}", a) for i, a in enumerate(fn.args))
        fn = fn.func
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            yield name, cell.cell_contents
        except ValueError:  # an empty cell
            pass
    names = set(code.co_names)
    yield from ((name, value) for name, value in fn.__globals__.items() if name in names)
    yield from ((f"default {i}", d) for i, d in enumerate(fn.__defaults__ or ()))


def _pickles(cloudpickle: Any, value: Any) -> bool:
    try:
        cloudpickle.dumps(value)
        return True
    except Exception:  # noqa: BLE001
        return False
