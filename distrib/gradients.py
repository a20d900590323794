"""What an optimizer takes as a gradient: checked (floating-point numbers of the variable's shape), IndexedSlices
regrouped per replica, and the norms that gradient clipping needs."""

from __future__ import annotations

from typing import Any

import numpy as np

from distrib.plan import dtype_name
from distrib.values import DistributedValues, PerReplica
from distrib.variables import IndexedSlices


def squared_norm(xp: Any, grads: list) -> Any:
    """The sum of the squares of every element of `grads`, a scalar on their device in their widest dtype."""
    dtype = np.result_type(*[g.dtype for g in grads])
    return sum(squared_sum(xp, g).astype(dtype) for g in grads)


def squared_sum(xp: Any, g: Any) -> Any:
    """The sum of the squares of `g`'s elements, a scalar on its device (a dot product: no temporary array)."""
    flat = g.reshape(-1)
    return xp.dot(flat, flat)


def global_norm(xp: Any, grads: list) -> Any:
    return xp.sqrt(squared_norm(xp, grads))


def clip_by_global_norm(xp: Any, grads: list, norm: Any, clip_norm: float) -> list:
    """Keras's clip_by_global_norm: every gradient times `clip_norm * min(1 / norm, 1 / clip_norm)` (here
    `clip_norm / max(norm, clip_norm)`, the same number without dividing by a zero norm), NaN for a norm that
    is not finite."""
    dtype = np.result_type(*[g.dtype for g in grads])
    norm = xp.asarray(norm, dtype=dtype)
    clip = dtype.type(clip_norm)
    scale = clip / xp.maximum(norm, clip) + (norm - norm)
    return [g * scale.astype(g.dtype) for g in grads]


def check_gradient_shape(grad: Any, var: Any) -> None:
    components = grad.values if isinstance(grad, DistributedValues) else (grad,)
    for component in components:
        if tuple(np.shape(component)) != tuple(var.shape):
            raise ValueError(f"A gradient must have its variable's shape. Received: shape "
                             f"{tuple(np.shape(component))} for variable {var.name!r} of shape {var.shape}.")


def _regrouped_slices(grad: IndexedSlices) -> Any:
    """A PerReplica of IndexedSlices for IndexedSlices of PerReplica values or indices (what a distributed
    function returning IndexedSlices gives, as a NamedTuple is a structure); else `grad` itself."""
    parts = [p for p in (grad.values, grad.indices) if isinstance(p, DistributedValues)]
    if not parts:
        return grad
    count = len(parts[0].values)
    pick = lambda p, i: p.values[i] if isinstance(p, DistributedValues) else p  # noqa: E731
    return PerReplica(tuple(IndexedSlices(pick(grad.values, i), pick(grad.indices, i), grad.dense_shape)
                            for i in range(count)))


def checked_gradient(grad: Any, var: Any) -> Any:
    """`grad`, a list made an array, after checking that it holds floating-point numbers: its values are cast to
    the variable's compute dtype, and a complex, integer or bool gradient is a mistake that cast would hide (TF2's
    Keras refuses any dtype but the variable's; distrib, like Keras 3, casts between floating-point dtypes)."""
    if isinstance(grad, IndexedSlices):
        grad = _regrouped_slices(grad)
    if isinstance(grad, IndexedSlices):
        _check_gradient_dtype(grad.values, var)
        return grad
    if isinstance(grad, DistributedValues):
        for component in grad.values:
            _check_gradient_dtype(component.values if isinstance(component, IndexedSlices) else component, var)
        return grad
    return _check_gradient_dtype(grad, var)


def _check_gradient_dtype(grad: Any, var: Any) -> Any:
    dtype = getattr(grad, "dtype", None)
    if dtype is None or isinstance(grad, (list, tuple)):  # lists, numbers, __array__ objects: NumPy's reading
        try:
            grad = np.asarray(grad)
        except ValueError as error:  # ragged nesting
            raise TypeError(f"A gradient must be an array of numbers for variable {var.name!r}. Received: a "
                            f"ragged {type(grad).__name__} ({error}).") from None
        dtype = grad.dtype
    try:
        dtype = np.dtype(dtype)
    except TypeError:  # another library's dtype (torch.float32): by its name, or left to the copy to NumPy
        try:
            dtype = np.dtype(str(dtype).rsplit(".", 1)[-1])
        except TypeError:
            return grad
    if dtype.kind != "f" and dtype_name(dtype) != "bfloat16":
        raise TypeError(f"A gradient must hold floating-point numbers for variable {var.name!r} of dtype "
                        f"{var.dtype}. Received: dtype {dtype}.")
    return grad
