"""PyTorch tensors made ready for DLPack, by both backends, without importing torch unless a tensor is given."""

from __future__ import annotations

from typing import Any

import numpy as np

# torch dtypes NumPy holds as they are.
_NUMPY_DTYPES = frozenset({"bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
                           "float16", "float32", "float64", "complex64", "complex128"})
# torch dtypes that DLPack readers (NumPy, CuPy) do not take: exported as integers of the same width, then
# viewed as ml_dtypes' type of the same name (the same bits, reinterpreted; no copy).
_BIT_VIEWS = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8", "float8_e4m3fnuz": "uint8",
              "float8_e5m2fnuz": "uint8", "float8_e8m0fnu": "uint8"}


def is_torch_tensor(value: Any) -> bool:
    """Whether `value` is a `torch.Tensor` (`nn.Parameter` and other subclasses included)."""
    return any(cls.__name__ == "Tensor" and cls.__module__ == "torch" for cls in type(value).__mro__)


def torch_device(tensor: Any) -> str:
    """The tensor's device type as torch names it: 'cpu', 'cuda', 'mps', 'meta', ..."""
    return tensor.device.type


def exportable(tensor: Any) -> tuple[Any, Any]:
    """`tensor` as a tensor that `__dlpack__` exports, and the NumPy dtype to view the result as (None: its own).

    The values leave autograd (`detach`, as a tensor fed to TensorFlow carries no gradient tape), lazy conjugate
    and negative views are resolved (DLPack has no flag for them), and bfloat16 or float8 travel as integers
    of their width, to be viewed as `ml_dtypes`' type. No copy, except to resolve a lazy conjugate or negation.

    Raises:
      TypeError: the tensor holds no plain array of numbers (sparse, quantized, meta, a dtype such as complex32
        or uint4 that NumPy has no type for), or its dtype needs `ml_dtypes`, which is not installed.
    """
    import torch  # already imported: `tensor` is one of its tensors

    dtype = str(tensor.dtype).removeprefix("torch.")
    received = f"Received: a torch.{dtype} tensor of shape {tuple(tensor.shape)}"
    if tensor.layout != torch.strided:
        raise TypeError(f"A torch tensor must be dense (layout torch.strided). {received} and layout "
                        f"{tensor.layout}; pass tensor.to_dense().")
    if tensor.is_quantized:
        raise TypeError(f"A torch tensor must hold plain numbers, not quantized ones. {received}; pass "
                        "tensor.dequantize().")
    if torch_device(tensor) == "meta":
        raise TypeError(f"A torch tensor must hold values; a meta tensor has only a shape and dtype. {received} "
                        "on device meta.")
    if dtype not in _NUMPY_DTYPES and dtype not in _BIT_VIEWS:
        raise TypeError(f"A torch tensor must have a dtype NumPy holds (bool, integers of 8 to 64 bits, float16 to "
                        f"float64, bfloat16, float8, complex64/128). {received}; cast it with tensor.to(...).")
    tensor = tensor.detach().resolve_conj().resolve_neg()
    if dtype not in _BIT_VIEWS:
        return tensor, None
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(f"A torch.{dtype} tensor needs ml_dtypes, NumPy's {dtype} (pip install ml_dtypes). "
                        f"{received}.") from None
    if not hasattr(ml_dtypes, dtype):
        raise TypeError(f"ml_dtypes {ml_dtypes.__version__} has no {dtype}; upgrade it (pip install -U ml_dtypes). "
                        f"{received}.")
    return tensor.view(getattr(torch, _BIT_VIEWS[dtype])), np.dtype(getattr(ml_dtypes, dtype))
