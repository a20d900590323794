"""DistributedValues, PerReplica and Mirrored, and the regroup / select_replica rules that move between them."""

from __future__ import annotations

import itertools
import numbers
import operator
from typing import Any, Callable, Sequence

import numpy as np
import optree

from distrib import context

# Structures are nested lists, tuples, namedtuples and dicts; everything else (arrays, distributed values,
# numbers) is a leaf. None is an empty node, so that reductions and collectives pass it through; tf.nest has it a
# leaf, which `regroup` follows where it shows (None on some replicas only, or values wrapped always).
_NAMESPACE = "distrib"


# Types that are never nodes; a flat list or tuple of only these skips optree's per-leaf dispatch (~150 ns a
# leaf), which matters when a step all-reduces hundreds of gradients.
LEAF_TYPES: set[type] = {int, float, complex, bool, str, bytes}
_FLAT_SPECS: dict[tuple[type, int], optree.PyTreeSpec] = {}
_DICT_SPECS: dict[tuple[str, ...], tuple[optree.PyTreeSpec, list[str]]] = {}
_SPECS_KEPT = 256  # each cache is emptied when full: keys that change every step (metrics by step) must not grow it
LEAF_SPEC = optree.tree_structure(0, namespace=_NAMESPACE)  # what flatten gives for one leaf


def register_leaf_type(cls: type) -> None:
    """Marks `cls` as a leaf type for the fast path (array classes register themselves here)."""
    LEAF_TYPES.add(cls)


def flatten(structure: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """Leaves of a nested structure and the spec that rebuilds it."""
    kind = type(structure)
    if kind in LEAF_TYPES:  # one array: the usual argument and result of a step
        return [structure], LEAF_SPEC
    if (kind is list or kind is tuple) and LEAF_TYPES.issuperset(map(type, structure)):  # the test runs in C
        key = (kind, len(structure))
        spec = _FLAT_SPECS.get(key)
        if spec is None:
            if len(_FLAT_SPECS) >= _SPECS_KEPT:
                _FLAT_SPECS.clear()
            spec = _FLAT_SPECS[key] = optree.tree_structure(kind([0] * len(structure)), namespace=_NAMESPACE)
        return list(structure), spec
    if kind is dict and all(type(k) is str for k in structure) and \
            LEAF_TYPES.issuperset(map(type, structure.values())):  # e.g. {"x": ..., "y": ...} batches
        keys = tuple(structure)
        cached = _DICT_SPECS.get(keys)
        if cached is None:
            if len(_DICT_SPECS) >= _SPECS_KEPT:
                _DICT_SPECS.clear()
            cached = _DICT_SPECS[keys] = (optree.tree_structure(dict.fromkeys(keys, 0), namespace=_NAMESPACE),
                                          sorted(keys))  # optree orders a dict's leaves by sorted key
        return [structure[k] for k in cached[1]], cached[0]
    return optree.tree_flatten(structure, namespace=_NAMESPACE)


def unflatten(spec: optree.PyTreeSpec, leaves: Sequence[Any]) -> Any:
    if spec is LEAF_SPEC and len(leaves) == 1:  # one array: the usual value of a collective
        return leaves[0]
    return optree.tree_unflatten(spec, leaves)


def map_structure(fn: Callable[[Any], Any], structure: Any) -> Any:
    return optree.tree_map(fn, structure, namespace=_NAMESPACE)


def format_path(path: tuple) -> str:
    """A structure path as Python indexing, e.g. ('b', 0) -> "['b'][0]"; the root is '<root>'."""
    return "".join(f"[{key!r}]" for key in path) or "<root>"


class DistributedValues:
    """One value per replica; the base of PerReplica and Mirrored (a leaf of nested structures).

    Args:
      values: the per-replica components, in replica order.
    """

    __slots__ = ("_values",)

    def __init__(self, values: Sequence[Any]):
        values = tuple(values)
        if not values:
            raise ValueError(f"{type(self).__name__} needs at least one component.")
        self._values = values

    @classmethod
    def _wrap(cls, values: tuple) -> "DistributedValues":
        """Wraps a non-empty tuple without copying or checking it (regroup's hot path)."""
        instance = object.__new__(cls)
        instance._values = values
        return instance

    @classmethod
    def _wrap_all(cls, tuples: Sequence[tuple]) -> list["DistributedValues"]:
        """`_wrap` of each tuple, for a batch of results: the instances made in one C-level pass, then filled."""
        instances = list(map(object.__new__, itertools.repeat(cls, len(tuples))))
        for instance, values in zip(instances, tuples):
            instance._values = values
        return instances

    @property
    def values(self) -> tuple:
        """The components, one per replica (or per destination device)."""
        return self._values

    def _get(self) -> Any:
        """The current replica's component in a replica context, else the first (primary) one."""
        ctx = context.get_replica_context()
        if ctx is not None and len(ctx._host.worker_devices) == len(self._values):
            return self._values[ctx._replica_id]  # this process's replica: the index into local components
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
      >>> [float(x) for x in PerReplica([np.float32(1), np.float32(2)]).values]
      [1.0, 2.0]
    """

    __slots__ = ()


class Mirrored(DistributedValues):
    """Values that are equal on every replica, as returned by cross-device reductions."""

    __slots__ = ()

    def __array__(self, dtype=None, copy=None):
        import numpy as np

        return np.asarray(self._get(), dtype=dtype)

    # the components are equal, so one of them is the value: `float(reduce_to(..., "/cpu:0"))` works as it does on
    # the tensor TensorFlow returns there
    def __float__(self) -> float:
        return float(self._get())

    def __int__(self) -> int:
        return int(self._get())


_PLAIN_DISTRIBUTED = (PerReplica, Mirrored)  # never variables: select_replica takes their components


def is_distributed_variable(value: Any) -> bool:
    """True for distributed variables (MirroredVariable, SyncOnReadVariable), which select_replica keeps whole."""
    return getattr(value, "_is_distributed_variable", False)


def select_replica(replica_id: int, structure: Any) -> Any:
    """The structure as replica `replica_id` sees it: each DistributedValues leaf becomes its component."""
    return _select(structure, (replica_id,), replica_id + 1)[0]


def _is_empty(structure: Any) -> bool:
    """None, () or {}: a structure with no leaf, which the replica paths pass through as it is."""
    return structure is None or (type(structure) in (tuple, dict) and not structure)


def select_replicas(structure: Any, count: int, exact: bool = True) -> list[Any]:
    """`[select_replica(i, structure) for i in range(count)]`, flattening the structure only once.

    Raises ValueError when a distributed leaf has not exactly `count` components (with `exact`; else fewer).
    """
    if structure is None or (type(structure) in (tuple, dict) and not structure):  # no args; a merge_fn's None
        return [structure] * count
    if count == 1 and type(structure) is tuple:  # run()'s args with one local replica (one per process)
        selected = one_replica_args(structure, exact)
        if selected is not None:
            return [selected]
    return _select(structure, range(count), count, exact=exact)


def one_replica_args(args: tuple, exact: bool) -> tuple | None:
    """The only replica's `args` when each is a one-component distributed value or an array or number, else None."""
    selected = []
    for arg in args:
        kind = type(arg)
        if kind in _PLAIN_DISTRIBUTED and (len(arg._values) == 1 or not exact and arg._values):
            selected.append(arg._values[0])
        elif kind in LEAF_TYPES and kind not in _PLAIN_DISTRIBUTED and not isinstance(arg, DistributedValues):
            selected.append(arg)
        else:
            return None
    return tuple(selected)


def _select(structure: Any, replica_ids: Sequence[int], count: int, exact: bool = False,
            path: tuple = ()) -> list[Any]:
    """select_replicas' work; `path` is where `structure` sits in what the user passed (for error messages)."""
    if type(structure) in _PLAIN_DISTRIBUTED:  # one PerReplica or Mirrored: its components, no structure walk
        if _on_one_device(structure, count):
            return [structure._values[0]] * len(replica_ids)
        problem = _missing_components(structure, count, exact)
        if problem is not None:
            raise ValueError(f"{problem} at path {format_path(path)}.")
        return [structure._values[i] for i in replica_ids]
    if type(structure) in LEAF_TYPES and not isinstance(structure, DistributedValues):  # the same everywhere
        return [structure] * len(replica_ids)
    if type(structure) is tuple and any(type(x) is not PerReplica for x in structure):
        # run()'s args: each argument on its own keeps a flat list of per-replica values on the fast path
        return [tuple(args) for args in zip(*(_select(x, replica_ids, count, exact, path + (k,))
                                                    for k, x in enumerate(structure)))] or \
            [()] * len(replica_ids)
    leaves, spec = flatten(structure)
    if leaves and set(map(type, leaves)).issubset(_PLAIN_DISTRIBUTED):  # e.g. a list of gradients, in C loops
        try:
            picked = list(zip(*map(_components, leaves), strict=True))  # picked[i]: replica i's leaves
        except ValueError:  # components differ in number: the general path below names the leaf
            picked = []
        if len(picked) == count:
            return [unflatten(spec, list(picked[i])) for i in replica_ids]
    if any(_on_one_device(leaf, count) for leaf in leaves):
        leaves = [leaf._values[0] if _on_one_device(leaf, count) else leaf for leaf in leaves]
        structure = unflatten(spec, leaves)
    distributed = [k for k, leaf in enumerate(leaves) if type(leaf) in _PLAIN_DISTRIBUTED or
                   (isinstance(leaf, DistributedValues) and not is_distributed_variable(leaf))]
    if not distributed:
        return [structure] * len(replica_ids)
    for k in distributed:
        problem = _missing_components(leaves[k], count, exact)
        if problem is not None:
            raise ValueError(f"{problem} at path {format_path(path + spec.paths()[k])}.")
    if len(distributed) == len(leaves):  # e.g. a list of gradients: every leaf is per-replica
        return [unflatten(spec, [leaf._values[i] for leaf in leaves]) for i in replica_ids]
    out = []
    for replica_id in replica_ids:
        picked = list(leaves)
        for k in distributed:
            picked[k] = leaves[k]._values[replica_id]
        out.append(unflatten(spec, picked))
    return out


_components = operator.attrgetter("_values")


def _on_one_device(value: Any, count: int) -> bool:
    """Whether `value` is a Mirrored on one device (reduced to one destination) handed to several replicas: the
    same value for each, as TensorFlow hands each replica the tensor such a reduction returns."""
    return type(value) is Mirrored and len(value._values) == 1 and count > 1


def _missing_components(value: DistributedValues, count: int, exact: bool) -> str | None:
    """What is wrong unless `value` has `count` components (with `exact`) or at least `count`; else None."""
    have = len(value._values)
    if have < count or (exact and have != count):
        needed = count if exact else f"at least {count}"
        return f"A {type(value).__name__} needs one component per replica ({needed}). Received: {have} components"
    return None


def holds_leaf(value: Any, kind: type, containers: tuple = (dict, list, tuple)) -> bool:
    """Whether `value` is one of `containers` with a leaf of `kind` (a PerReplica, any distributed value) in it."""
    return isinstance(value, containers) and any(isinstance(leaf, kind) for leaf in flatten(value)[0])


def local_components(value: Any) -> tuple | None:
    """The per-replica components of a distributed value or variable; None for anything else."""
    return tuple(value.values) if isinstance(value, DistributedValues) else None


def is_zero_scalar(value: Any) -> bool:
    """A Python or NumPy scalar 0, which TensorFlow's reductions pass through unchanged whatever the op."""
    return isinstance(value, numbers.Number) and not isinstance(value, (bool, np.bool_)) and value == 0


def regroup(per_replica: Sequence[Any], wrap_class: type = PerReplica, always_wrap: bool = False,
            rule: str = "Every replica must return the same structure") -> Any:
    """Combines one structure per replica into one structure of distributed values (TensorFlow's rules).

    At each leaf the first matching rule wins: the same distributed variable everywhere -> it; the same object
    everywhere -> it, unwrapped (unless `always_wrap`); the components of one distributed variable -> the
    variable; otherwise `wrap_class(values)`.

    Raises:
      ValueError: the replicas' structures differ; the message (`rule`, then where) names the replica and the path.
    """
    first = per_replica[0]
    kind = type(first)
    if len(per_replica) == 1 and not always_wrap and kind in LEAF_TYPES:  # one replica's array: itself
        return first
    if always_wrap:  # every leaf wrapped, None included: TensorFlow's values from a function
        return _regroup_by_first_fit(per_replica, (_flatten_none_too,), wrap_class, True, rule)
    if _is_empty(first) and all(type(x) is type(first) and not x for x in per_replica):  # nothing to combine
        return {} if type(first) is dict else first
    if len(per_replica) == 1:  # every leaf is "the same object everywhere": itself
        leaves, spec = flatten(first)
        return unflatten(spec, leaves)
    if kind in LEAF_TYPES and per_replica[1] is not first and \
            all(type(x) is kind for x in per_replica):  # one distinct array per replica: the usual result of a run
        return wrap_class._wrap(tuple(per_replica))
    # then, for None on some replicas where the others have a value, None as a leaf there, as in tf.nest
    return _regroup_by_first_fit(per_replica, (flatten, _flatten_none_too), wrap_class, False, rule)


class _StructureMismatch(Exception):
    """Two replicas' structures differ under one way of flattening them (never leaves `regroup`)."""


def _regroup_by_first_fit(per_replica: Sequence[Any], flattens: Sequence[Callable], wrap_class: type,
                          always_wrap: bool, rule: str) -> Any:
    """`_regroup_leaves` with the first of `flattens` under which every replica's structure matches; else the
    ValueError of the first mismatch."""
    mismatch = None
    for flatten_one in flattens:
        try:
            return _regroup_leaves(per_replica, flatten_one, wrap_class, always_wrap, rule)
        except _StructureMismatch as exc:
            mismatch = mismatch or exc
    raise ValueError(str(mismatch)) from None


def holds_none(structure: Any) -> bool:
    """Whether `structure` is None or has None among its leaves (`flatten` drops them, as empty structures)."""
    return structure is None or type(structure) not in LEAF_TYPES and \
        any(leaf is None for leaf in _flatten_none_too(structure)[0])


def _flatten_none_too(structure: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    return optree.tree_flatten(structure, none_is_leaf=True, namespace=_NAMESPACE)


def _regroup_leaves(per_replica: Sequence[Any], flatten_one: Callable, wrap_class: type, always_wrap: bool,
                    rule: str) -> Any:
    first_leaves, spec = flatten_one(per_replica[0])
    columns = [first_leaves]
    for replica_id, structure in enumerate(per_replica[1:], start=1):
        leaves, other_spec = flatten_one(structure)
        if other_spec != spec:
            raise _StructureMismatch(structure_mismatch(rule, replica_id, spec.paths(), other_spec.paths(), spec,
                                                        other_spec))
        columns.append(leaves)
    out = []
    for values in zip(*columns):
        first = values[0]
        if len(values) > 1 and values[1] is not first and type(first) in LEAF_TYPES:
            out.append(wrap_class._wrap(values))  # the common case: distinct arrays, no variable components
        else:
            out.append(_regroup_leaf(values, wrap_class, always_wrap))
    return unflatten(spec, out)


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


def structure_mismatch(rule: str, replica_id: int, first_paths: list, paths: list, spec, other_spec,
                       first_id: int = 0) -> str:
    """Error text naming the first path where replica `replica_id` differs from replica `first_id`."""
    first, other = set(first_paths), set(paths)
    only_first = [p for p in first_paths if p not in other]
    only_other = [p for p in paths if p not in first]
    if only_first or only_other:
        where = only_first[0] if only_first else only_other[0]
        side = f"replica {first_id}" if only_first else f"replica {replica_id}"
        detail = f"path {format_path(where)} exists only on {side}"
    else:
        where, first_node, other_node = _first_difference(spec, other_spec)
        with_keys = first_node.type is other_node.type
        detail = (f"path {format_path(where)} is {_describe(other_node, with_keys)} on replica {replica_id} but "
                  f"{_describe(first_node, with_keys)} on replica {first_id}")
    return f"{rule}. Received: replica {replica_id}, {detail}."


def _first_difference(spec, other, path: tuple = ()) -> tuple[tuple, Any, Any]:
    """(path, node, other node) of the outermost node where two structures differ in type or keys."""
    if spec.type is other.type and spec.entries() == other.entries():
        for entry, child, other_child in zip(spec.entries(), spec.children(), other.children()):
            if child != other_child:
                return _first_difference(child, other_child, path + (entry,))
    return path, spec, other


def _describe(spec, with_keys: bool) -> str:
    if spec.type is None:
        return "a leaf"
    if spec.type is type(None):
        return "None"
    return f"a {spec.type.__name__}" + (f" with keys {list(spec.entries())}" if with_keys else "")


for _cls in (PerReplica, Mirrored, np.ndarray, np.float16, np.float32, np.float64, np.int8, np.int16, np.int32,
             np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.bool_, np.complex64, np.complex128):
    register_leaf_type(_cls)
