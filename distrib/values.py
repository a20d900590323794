"""DistributedValues, PerReplica and Mirrored, and the regroup / select_replica rules that move between them."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import optree

from distrib import context

# Structures are nested lists, tuples, namedtuples and dicts; everything else (arrays, distributed values,
# numbers) is a leaf. None is an empty node, as in tf.nest.
_NAMESPACE = "distrib"


def flatten(structure: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """Leaves of a nested structure and the spec that rebuilds it."""
    return optree.tree_flatten(structure, namespace=_NAMESPACE)


def flatten_with_paths(structure: Any) -> tuple[list[tuple], list[Any], optree.PyTreeSpec]:
    """(paths, leaves, spec) of a nested structure; a path is the tuple of keys from the root."""
    return optree.tree_flatten_with_path(structure, namespace=_NAMESPACE)


def unflatten(spec: optree.PyTreeSpec, leaves: Sequence[Any]) -> Any:
    return optree.tree_unflatten(spec, leaves)


def map_structure(fn: Callable[[Any], Any], structure: Any) -> Any:
    return optree.tree_map(fn, structure, namespace=_NAMESPACE)


def format_path(path: tuple) -> str:
    """A structure path as Python indexing, e.g. ('b', 0) -> "['b'][0]"; the root is '<root>'."""
    return "".join(f"[{key!r}]" for key in path) or "<root>"


class DistributedValues:
    """One value per replica; the base of PerReplica and Mirrored.

    Args:
      values: the per-replica components, in replica order.
    """

    __slots__ = ("_values",)

    def __init__(self, values: Sequence[Any]):
        values = tuple(values)
        if not values:
            raise ValueError(f"{type(self).__name__} needs at least one component.")
        self._values = values

    @property
    def values(self) -> tuple:
        """The components, one per replica (or per destination device)."""
        return self._values

    def _get(self) -> Any:
        """The current replica's component in a replica context, else the first (primary) one."""
        ctx = context.get_replica_context()
        if ctx is not None and ctx.num_replicas_in_sync == len(self._values):
            return self._values[ctx.replica_id_in_sync_group]
        return self._values[0]

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        body = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n{body}\n}}"


class PerReplica(DistributedValues):
    """Values that differ per replica, as returned by `Strategy.run`.

    Example:
      >>> import numpy as np
      >>> PerReplica([np.float32(1), np.float32(2)]).values
      (1.0, 2.0)
    """

    __slots__ = ()


class Mirrored(DistributedValues):
    """Values that are equal on every replica, as returned by cross-device reductions."""

    __slots__ = ()

    def __array__(self, dtype=None, copy=None):
        import numpy as np

        return np.asarray(self._get(), dtype=dtype)


def is_distributed_variable(value: Any) -> bool:
    """True for distributed variables (MirroredVariable, SyncOnReadVariable), which select_replica keeps whole."""
    return getattr(value, "_is_distributed_variable", False)


def select_replica(replica_id: int, structure: Any) -> Any:
    """The structure as replica `replica_id` sees it: each DistributedValues leaf becomes its component."""

    def pick(leaf):
        if isinstance(leaf, DistributedValues) and not is_distributed_variable(leaf):
            return leaf.values[replica_id]
        return leaf

    return map_structure(pick, structure)


def regroup(per_replica: Sequence[Any], wrap_class: type = PerReplica, always_wrap: bool = False) -> Any:
    """Combines one structure per replica into one structure of distributed values (TensorFlow's rules).

    At each leaf the first matching rule wins: the same distributed variable everywhere -> it; the same object
    everywhere -> it, unwrapped (unless `always_wrap`); the components of one distributed variable -> the
    variable; otherwise `wrap_class(values)`.

    Raises:
      ValueError: the replicas' structures differ; the message names the replica and the path.
    """
    first_paths, first_leaves, spec = flatten_with_paths(per_replica[0])
    columns = [first_leaves]
    for replica_id, structure in enumerate(per_replica[1:], start=1):
        paths, leaves, other_spec = flatten_with_paths(structure)
        if other_spec != spec:
            raise ValueError(_structure_mismatch("Every replica must return the same structure", replica_id,
                                                 first_paths, paths, spec, other_spec))
        columns.append(leaves)
    return unflatten(spec, [_regroup_leaf(values, wrap_class, always_wrap) for values in zip(*columns)])


def _regroup_leaf(values: tuple, wrap_class: type, always_wrap: bool) -> Any:
    first = values[0]
    if all(v is first for v in values):
        if is_distributed_variable(first) or not always_wrap:
            return first
    container = getattr(first, "_distributed_container", None)
    if container is not None:
        container = container()  # a weak reference, as in TensorFlow
        if container is not None and tuple(values) == tuple(container.values):
            return container
    return wrap_class(values)


def _structure_mismatch(rule: str, replica_id: int, first_paths: list, paths: list, spec, other_spec) -> str:
    """Error text naming the first path where replica `replica_id` differs from replica 0."""
    first, other = set(first_paths), set(paths)
    only_first = [p for p in first_paths if p not in other]
    only_other = [p for p in paths if p not in first]
    if only_first or only_other:
        where = only_first[0] if only_first else only_other[0]
        side = "replica 0" if only_first else f"replica {replica_id}"
        detail = f"path {format_path(where)} exists only on {side}"
    else:
        detail = f"structure {other_spec} vs {spec}"
    return f"{rule}. Received: replica {replica_id}, {detail}."
