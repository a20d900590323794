"""Which variables an optimizer updates, and the dtype its slots and update math use for each."""

from __future__ import annotations

from typing import Any

import numpy as np

from distrib.plan import dtype_name

HALF_FLOATS = ("float16", "bfloat16")  # updated in float32: their own precision would lose small steps


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """Slots and update math use the variable's dtype, except float32 for 16-bit floats (float16, bfloat16).

    Example:
      >>> compute_dtype(np.dtype(np.float16)), compute_dtype(np.dtype(np.float64))
      (dtype('float32'), dtype('float64'))
    """
    return np.dtype(np.float32) if dtype_name(dtype) in HALF_FLOATS else np.dtype(dtype)


def check_trainable_dtype(var: Any) -> None:
    """Optimizers update real floating-point variables: float16, bfloat16 (ml_dtypes), float32, float64."""
    if var.dtype.kind != "f" and dtype_name(var.dtype) != "bfloat16":
        raise TypeError(f"Optimizers update floating-point variables. Received: variable {var.name!r} of dtype "
                        f"{var.dtype}.")
