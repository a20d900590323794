"""The parameter server: a Ray actor holding variables as NumPy arrays and applying each tagged update once."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Tuple

import numpy as np
import optree

from distrib.variables import Variable, scatter_rows

# A write made by a scheduled closure carries a tag (see write_tags.py). A closure that runs again after its worker
# died makes the same writes with the same tags; the server applies each tag once.
Tag = Optional[Tuple[int, Any]]  # (closure id, (variable key, n-th write to it in the closure))


class ParameterServer:
    """Variables by key, as CPU `distrib.Variable`s; reads, writes, row lookups, scatters and fns run in place.

    Ray runs one call at a time on an actor, so each update is atomic with respect to every other.

    Args:
      index: this server's task index in the cluster (`/job:ps/task:<index>`).
    """

    def __init__(self, index: int):
        self.index = index
        self._variables: dict[int, Variable] = {}
        self._applied: dict[int, set] = {}  # closure id -> its writes already applied

    def create(self, key: int, value: np.ndarray, name: str) -> None:
        self._variables[key] = Variable(value, name=name)

    def read(self, key: int) -> np.ndarray:
        return self._variables[key].read_value()  # Ray copies it into the object store

    def read_rows(self, key: int, rows: np.ndarray) -> np.ndarray:
        return self._variables[key].read_value()[rows]

    def write(self, key: int, method: str, value: Any, tag: Tag) -> None:
        if self._claim(tag):
            getattr(self._variables[key], method)(value)

    def scatter(self, key: int, method: str, rows: np.ndarray, updates: np.ndarray, tag: Tag) -> None:
        """Row updates `method` ("scatter_add", ...), as distrib.Variable's; the handle checked the operands and cast
        `updates` to the variable's dtype."""
        if not self._claim(tag):
            return
        scatter_rows(np, self._variables[key]._writable(), method, rows, updates)  # in place unless a view lives

    def call(self, fn: Callable, args: tuple, kwargs: dict, tag: Tag) -> Any:
        """Runs `fn(*args, **kwargs)` here, each of this server's variable handles in them swapped for the variable."""
        if not self._claim(tag):
            return None
        args, kwargs = optree.tree_map(self._local, (tuple(args), dict(kwargs)), none_is_leaf=True)
        return self._returnable(fn, fn(*args, **kwargs))

    def _returnable(self, fn: Callable, result: Any) -> Any:
        """`result` ready to travel back: this server's variables in it become `ServerVariable(key)` (the caller
        swaps the handle back in: `update(v, lambda x: x.assign(...))` returns the variable, as in TensorFlow).
        Anything else that cannot be pickled raises a TypeError here, naming it, instead of a raw pickling error
        from Ray; fn's writes stand then, as they would had fn raised after them."""
        keys = {id(variable): key for key, variable in self._variables.items()}
        result = optree.tree_map(lambda leaf: ServerVariable(keys[id(leaf)]) if id(leaf) in keys else leaf, result,
                                 none_is_leaf=True)
        from ray import cloudpickle  # a server is a Ray actor: Ray is there

        try:
            cloudpickle.dumps(result)
        except Exception as exc:  # noqa: BLE001 - pickling fails in many types
            name = getattr(fn, "__name__", type(fn).__name__)
            raise TypeError(f"A function run on parameter server {self.index} returned a value that cannot travel "
                            f"back (its writes were applied): return arrays, numbers, None, or the variable it was "
                            f"given. Received: {type(result).__name__} from {name!r} ({exc}).") from None
        return result

    def forget(self, closure_ids: list[int]) -> None:
        """Drops the tags of closures that finished: they never run again."""
        for closure_id in closure_ids:
            self._applied.pop(closure_id, None)

    def pid(self) -> int:
        return os.getpid()

    def _claim(self, tag: Tag) -> bool:
        """True the first time a tag is seen (and for untagged writes); False when it was applied already."""
        if tag is None:
            return True
        closure_id, write = tag
        done = self._applied.setdefault(closure_id, set())
        if write in done:
            return False
        done.add(write)
        return True

    def _local(self, leaf: Any) -> Any:
        from distrib.parameter_server.variable import ParameterServerVariable

        if isinstance(leaf, ParameterServerVariable):
            if leaf._ps_index != self.index:
                raise ValueError(f"A function run on a parameter server may use only that server's variables. "
                                 f"Received: {leaf!r} on ps {leaf._ps_index}, run on ps {self.index}.")
            return self._variables[leaf._key]
        return leaf


class ServerVariable:
    """A variable of the server in a function's result, by key: the caller holds its handle."""

    def __init__(self, key: int):
        self.key = key
