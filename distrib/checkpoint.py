"""Checkpoint: variables, optimizer slots and metadata in one safetensors file, saved atomically, restored anywhere."""

from __future__ import annotations

import json
import os
import weakref
from typing import Any

import numpy as np

from distrib import checkpoint_file, context
from distrib.distributed_variables import DistributedVariable, MirroredVariable, SyncOnReadVariable
from distrib.errors import CheckpointError, ContextError
from distrib.parameter_server.sharded_variable import ShardedVariable
from distrib.parameter_server.variable import ParameterServerVariable
from distrib.variables import Variable, VariableAggregation

# What a checkpoint saves as one variable: a ShardedVariable saves its full value, so it restores into any shard count.
_VARIABLES = (Variable, DistributedVariable, ShardedVariable, ParameterServerVariable)

# Saved values of variables their owner (an optimizer) had not created yet: owner -> {name: (key, array)}.
_DEFERRED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Checkpoint:
    """Saves variables, optimizers and small metadata to one file, and restores them under any strategy.

    Keyword arguments name what the checkpoint holds: variables (plain, Mirrored or SyncOnRead), objects with
    a `variables()` method (optimizers: their iterations and slots, keyed by variable name), other
    Checkpoints, and dicts or lists of these. Any other argument is metadata: JSON values (numbers, strings,
    lists, dicts), kept in `metadata`, saved with the variables and updated by `restore` (JSON turns tuples
    into lists and NumPy scalars into Python numbers).

    Values are saved as TensorFlow saves them: a MirroredVariable its primary copy, a SyncOnReadVariable its
    aggregate (SUM the sum, MEAN the mean, ONLY_FIRST_REPLICA replica 0's). Restoring assigns them back, so a
    file written with 4 replicas restores into 2, 1 or no strategy, on either backend; a SyncOnRead SUM
    variable gets `value / n` on each copy (integers truncate: 7 over 2 replicas is 3 + 3).

    Args:
      **objects: what to save, by name.

    Attributes:
      metadata: the metadata, by name (a dict you may change before saving).

    Example:
      >>> import distrib, numpy as np, os, tempfile
      >>> w = distrib.Variable(np.arange(3, dtype=np.float32), name="w")
      >>> ckpt = distrib.Checkpoint(w=w, step=10)
      >>> path = ckpt.save(os.path.join(tempfile.mkdtemp(), "model.ckpt"))
      >>> _ = w.assign(np.zeros(3, np.float32))
      >>> ckpt.metadata["step"] = 0
      >>> ckpt.restore(path)
      {'step': 10}
      >>> w.numpy()
      array([0., 1., 2.], dtype=float32)
    """

    def __init__(self, **objects: Any):
        self._objects: dict[str, Any] = {}
        self.metadata: dict[str, Any] = {}
        for name, value in objects.items():
            if _holds_variables(value):
                self._objects[name] = value
            else:
                _check_metadata(name, value)
                self.metadata[name] = value
        self._collect()  # a wrong kind of object, or a key used twice, fails here rather than at save

    def save(self, path: str | os.PathLike) -> str:
        """Writes every variable and the metadata to the file `path` (parent folders are created); returns it.

        The file is a safetensors file: each variable a tensor named by its key ("w", "opt/velocity/w"), the
        manifest (each variable's kind, aggregation and owner; the metadata) and a SHA-256 of it all in the
        header's `__metadata__`, so `safetensors.numpy.load_file(path)` reads the weights without distrib.
        It is written under a temporary name in the same folder, flushed to disk and renamed onto `path`, so a
        crash leaves the previous checkpoint intact; an exception leaves no temporary file, and temporaries
        left by saves of `path` that were killed are removed.

        Raises:
          TypeError: a variable's dtype is not one a safetensors file holds (complex, strings, bfloat16), or
            `path` is not a str, bytes or os.PathLike.
          OSError: `path` is a folder (IsADirectoryError) or lies under a file (NotADirectoryError), refused
            before anything is written; or the file cannot be written (PermissionError...). Each names `path`.
          ContextError (a RuntimeError): called inside a replica function.
        """
        _require_cross_replica("Checkpoint.save")
        from distrib._version import __version__

        variables, owners, checkpoints = self._collect()
        for path_, checkpoint in checkpoints.items():
            for name, value in checkpoint.metadata.items():
                _check_metadata(f"{path_}/{name}" if path_ else name, value)
        entries, arrays = [], {}
        for key, (variable, owner, name) in variables.items():
            arrays[key] = np.asarray(_saved_value(key, variable))
            entries.append({"key": key, "variable": type(variable).__name__, "aggregation": variable.aggregation.name,
                            "owner": owner, "name": name})
        metadata = {path_: checkpoint.metadata for path_, checkpoint in checkpoints.items()}
        manifest = {"distrib_version": __version__, "entries": entries,
                    "owners": {key: type(owner).__name__ for key, owner in owners.items()},
                    "metadata": json.loads(json.dumps(metadata, default=_json_default))}
        extended = _strategy_of(variables).extended
        if extended.should_checkpoint:  # in a multi-worker job only the chief writes; the others wait for it
            checkpoint_file.write(path, arrays, manifest)
        extended._barrier("Checkpoint.save")
        return checkpoint_file.decode(path)

    def restore(self, path: str | os.PathLike, allow_partial: bool = False) -> dict[str, Any]:
        """Loads the file `path` into the objects; returns `metadata`, updated with the saved values.

        Call it in a cross-replica context (inside or outside `strategy.scope()`). Every saved key must name
        an object and every object must be saved, with the same shape and a dtype that casts safely; nothing
        is assigned unless all of them do. Saved optimizer slots the optimizer has not created yet are kept
        and assigned when it creates them (it calls `restore_deferred`); saved state that the optimizer can
        never create (another kind of optimizer saved it, or one with other slots or another name) is refused.

        Args:
          path: a file written by `save`.
          allow_partial: restore the keys the file and the objects share instead of raising on the others.

        Raises:
          CheckpointError (a ValueError): the file is corrupt, truncated, not a distrib checkpoint (another
            safetensors file, a zip, an empty file: the message says which) or has a malformed manifest, or
            it does not match the objects (missing or extra keys, another shape, a dtype that does not cast
            safely, optimizer state the optimizer never creates).
          ContextError (a RuntimeError): called inside a replica function.
        """
        _require_cross_replica("Checkpoint.restore")
        manifest, arrays = checkpoint_file.read(path)
        variables, owners, checkpoints = self._collect()
        saved = {entry["key"]: entry for entry in manifest["entries"]}
        deferred = [key for key, entry in saved.items() if key not in variables and entry.get("owner") in owners]
        # deferred keys wait for their owner to create them: one an optimizer never creates would wait forever
        for owner_key, owner in owners.items():
            never = [key for key in deferred if saved[key]["owner"] == owner_key
                     and not _creates(owner, saved[key]["name"])]
            if never and not allow_partial:
                raise CheckpointError(_foreign_state_message(path, manifest, owner_key, owner, never))
            deferred = [key for key in deferred if key not in never]
        missing = sorted(variables.keys() - saved.keys())
        extra = sorted(saved.keys() - variables.keys() - set(deferred))
        if (missing or extra) and not allow_partial:
            raise CheckpointError(f"restore needs every object in the file and every saved key in the Checkpoint. "
                                  f"Received: {checkpoint_file.decode(path)!r}; missing from the file: {missing}; "
                                  f"in the file but not in the Checkpoint: {extra}. Pass allow_partial=True to "
                                  f"restore the others.")
        matched = [(key, variables[key][0], arrays[key]) for key in saved if key in variables]
        for key, variable, array in matched:
            _check_compatible(key, array, variable)
        for key, variable, array in matched:
            variable.assign(array.astype(variable.dtype, copy=False), read_value=False)  # no read back
        for owner_key, owner in owners.items():
            pending = {saved[key]["name"]: (key, arrays[key].copy())
                       for key in deferred if saved[key]["owner"] == owner_key}
            if pending:
                _DEFERRED[owner] = pending
            else:
                _DEFERRED.pop(owner, None)
        for path_, checkpoint in checkpoints.items():
            checkpoint.metadata.update(manifest["metadata"].get(path_, {}))
        return self.metadata

    def _collect(self) -> tuple[dict[str, tuple], dict[str, Any], dict[str, "Checkpoint"]]:
        """Every variable by key, as (variable, owner key, name in owner); the owners and the Checkpoints by key."""
        variables: dict[str, tuple] = {}
        owners: dict[str, Any] = {}
        checkpoints: dict[str, Checkpoint] = {}

        def add(key: str, variable: Any, owner: str | None = None, name: str | None = None) -> None:
            if key in variables:
                raise ValueError(f"A Checkpoint needs a distinct key for every variable. Received: {key!r} twice.")
            variables[key] = (variable, owner, name)

        def visit(obj: Any, key: str, outer: tuple) -> None:
            if isinstance(obj, Checkpoint):
                if any(obj is checkpoint for checkpoint in outer):
                    raise ValueError(f"A Checkpoint cannot contain itself. Received: one at {key!r}.")
                checkpoints[key] = obj
                for child_name, child in obj._objects.items():
                    visit(child, _join(key, child_name), outer + (obj,))
            elif isinstance(obj, _VARIABLES):
                add(key, obj)
            elif isinstance(obj, dict):
                for child_name, child in obj.items():
                    visit(child, _join(key, str(child_name)), outer)
            elif isinstance(obj, (list, tuple)):
                for index, child in enumerate(obj):
                    visit(child, _join(key, str(index)), outer)
            elif _is_owner(obj):
                owners[key] = obj
                for name, variable in _owner_variables(obj).items():
                    add(_join(key, name), variable, key, name)
            else:
                raise TypeError(f"A Checkpoint holds variables, objects with variables(), Checkpoints, and dicts or "
                                f"lists of them. Received: {type(obj).__name__} at {key!r}; pass plain values as "
                                f"their own keyword argument (metadata).")

        visit(self, "", ())
        return variables, owners, checkpoints

    def __repr__(self) -> str:
        return f"<Checkpoint objects={list(self._objects)} metadata={list(self.metadata)}>"


def restore_deferred(owner: Any) -> list[str]:
    """Assigns the values a restored checkpoint held for variables `owner` had not created yet; returns their names.

    An optimizer calls it after creating slot variables, so that slots restored before the first training
    step get their saved values. Names still missing stay pending; a later restore replaces them.

    Args:
      owner: the object with `variables()` that was in the Checkpoint.

    Example:
      >>> import distrib, numpy as np, os, tempfile
      >>> from distrib.checkpoint import restore_deferred
      >>> class Lazy:  # creates its variables on first use, as an optimizer creates its slots
      ...     def __init__(self):
      ...         self.created = []
      ...     def variables(self):
      ...         return self.created
      >>> saved = Lazy()
      >>> saved.created.append(distrib.Variable(np.float32(3), name="velocity"))
      >>> path = distrib.Checkpoint(opt=saved).save(os.path.join(tempfile.mkdtemp(), "opt.ckpt"))
      >>> fresh = Lazy()
      >>> _ = distrib.Checkpoint(opt=fresh).restore(path)  # nothing to restore into yet
      >>> fresh.created.append(distrib.Variable(np.float32(0), name="velocity"))
      >>> restore_deferred(fresh), float(fresh.created[0].numpy())
      (['velocity'], 3.0)
    """
    pending = _DEFERRED.get(owner)
    if not pending:
        return []
    _require_cross_replica("restore_deferred")
    variables = _owner_variables(owner)
    ready = [name for name in pending if name in variables]
    for name in ready:
        _check_compatible(pending[name][0], pending[name][1], variables[name])
    for name in ready:
        variables[name].assign(pending.pop(name)[1].astype(variables[name].dtype, copy=False), read_value=False)
    if not pending:
        del _DEFERRED[owner]
    return ready


# -- objects ------------------------------------------------------------------------------------------------

def _is_owner(obj: Any) -> bool:
    return not isinstance(obj, type) and callable(getattr(obj, "variables", None))


def _creates(owner: Any, name: str) -> bool:
    """Whether `owner` may create a variable named `name` later: what an optimizer says (`may_create`); any other
    owner may."""
    may_create = getattr(owner, "may_create", None)
    return may_create is None or may_create(name)


def _foreign_state_message(path: Any, manifest: dict, owner_key: str, owner: Any, keys: list[str]) -> str:
    saved_kind = manifest.get("owners", {}).get(owner_key, "an optimizer")  # earlier files do not record it
    saved_name = next((entry["name"][:-len("/iterations")] for entry in manifest["entries"]
                       if entry["owner"] == owner_key and entry["name"].endswith("/iterations")), None)
    saved = saved_kind if saved_name is None else f"{saved_kind} {saved_name!r}"
    current = f"{type(owner).__name__} {owner.name!r} with slots {list(owner.slot_names)}"
    return (f"restore needs an optimizer that creates the state the file saved for it, or that state is lost. "
            f"Received: {checkpoint_file.decode(path)!r} holds the state of {saved} at {owner_key!r}, which the "
            f"Checkpoint's {current} never creates: {keys}. Restore into the kind of optimizer that saved it, with "
            f"the same name and slots, or pass allow_partial=True to start the optimizer afresh.")


def _holds_variables(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_holds_variables(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_variables(v) for v in value)
    return isinstance(value, _VARIABLES + (Checkpoint,)) or _is_owner(value)


def _owner_variables(owner: Any) -> dict[str, Any]:
    """`owner.variables()` by name; a repeated name gets `_1`, `_2`, ... in the order they come."""
    named: dict[str, Any] = {}
    tried: dict[str, int] = {}  # base name -> the last suffix taken: every smaller one is taken too
    for variable in owner.variables():
        if not isinstance(variable, _VARIABLES):
            raise TypeError(f"{type(owner).__name__}.variables() must return distrib variables. Received: "
                            f"{type(variable).__name__}.")
        name = base = variable.name
        if name in named:  # resume after the last suffix: retrying from _1 made n unnamed slots cost n^2 / 2 probes
            count = tried.get(base, 0)
            while name in named:
                count += 1
                name = f"{base}_{count}"
            tried[base] = count
        named[name] = variable
    return named


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def _require_cross_replica(api: str) -> None:
    top = context.current()
    if top.replica_context is not None and not context.is_default(top.strategy):
        raise ContextError(f"{api} must be called in a cross-replica context (inside or outside strategy.scope(), "
                           f"outside strategy.run), not inside a replica function.")


def _saved_value(key: str, variable: Any) -> np.ndarray:
    """What TensorFlow saves: the primary copy of a MirroredVariable, the aggregate of a SyncOnReadVariable."""
    if isinstance(variable, SyncOnReadVariable) and variable.aggregation is VariableAggregation.NONE:
        raise ValueError(f"A SyncOnReadVariable is saved as its aggregate, which aggregation NONE does not define. "
                         f"Received: {key!r}; give it aggregation SUM, MEAN or ONLY_FIRST_REPLICA.")
    if isinstance(variable, MirroredVariable):
        return variable.values[0].numpy()
    return variable.numpy()


def _check_compatible(key: str, array: np.ndarray, variable: Any) -> None:
    if array.shape != tuple(variable.shape):
        raise CheckpointError(f"restore needs the shape the variable has. Received: {key!r}, shape {array.shape} in "
                              f"the file vs {tuple(variable.shape)} in the variable.")
    if not np.can_cast(array.dtype, variable.dtype, casting="safe"):
        raise CheckpointError(f"restore casts only to a dtype that holds every value. Received: {key!r}, dtype "
                              f"{array.dtype} in the file vs {variable.dtype} in the variable.")


# -- metadata -----------------------------------------------------------------------------------------------

def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def _check_metadata(name: str, value: Any) -> None:
    try:
        json.dumps(value, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"Checkpoint metadata must be JSON values (numbers, strings, lists, dicts with string keys). "
                        f"Received: {type(value).__name__} for {name!r}; hold arrays in a distrib.Variable.") from exc


def _strategy_of(variables: dict) -> Any:
    """The strategy the variables are distributed by (the current one when none is distributed)."""
    for variable, _, _ in variables.values():
        if getattr(variable, "_strategy", None) is not None:
            return variable._strategy
    return context.get_strategy()
