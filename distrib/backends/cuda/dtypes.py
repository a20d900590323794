"""How each dtype crosses NCCL and the reduce kernel: the type on the wire, elements per value, the NCCL op."""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

# ncclDataType_t and ncclRedOp_t (nccl.h); cupy.cuda.nccl names the same numbers NCCL_INT8, NCCL_SUM, ...
NCCL_TYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
              "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
NCCL_OPS = {"SUM": 0, "MAX": 2, "AVG": 4}

# NCCL 2.10.3 added ncclAvg and ncclBfloat16. Versions read X*1000+Y*100+Z up to 2.8 and X*10000+Y*100+Z
# since 2.9 (2.10.3 -> 21003), so one comparison covers both.
AVG_MIN_VERSION = 21003


class Wire(NamedTuple):
    """What a reduction of one dtype sends: `factor` elements of `dtype` per value, combined with `op`."""

    dtype: str  # the reduce_<dtype> kernel's type, or for NCCL a key of NCCL_TYPES
    factor: int  # NCCL sends a complex value as two floats
    op: str  # "SUM", or "MAX" for bool (NumPy adds booleans as logical or)


# Reductions through the reduce kernel (the same-device path and add_n).
KERNEL_WIRES: dict[str, Wire] = {
    **{name: Wire(name, 1, "SUM") for name in NCCL_TYPES},
    "int16": Wire("int16", 1, "SUM"),
    "uint16": Wire("uint16", 1, "SUM"),
    "complex64": Wire("complex64", 1, "SUM"),  # divided as NumPy divides complex values (reduce.cu)
    "complex128": Wire("complex128", 1, "SUM"),
    "bool": Wire("bool", 1, "MAX"),
}

# Reductions through NCCL. int16 and uint16 have no NCCL type: they are summed as int32 / uint32 and cast back,
# which wraps exactly as NumPy's 16-bit adds do.
NCCL_WIRES: dict[str, Wire] = {
    **{name: KERNEL_WIRES[name] for name in NCCL_TYPES},
    "complex64": Wire("float32", 2, "SUM"),
    "complex128": Wire("float64", 2, "SUM"),
    "bool": Wire("uint8", 1, "MAX"),
}
WIDER = {"int16": "int32", "uint16": "uint32"}
FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})  # wire types that can be averaged


class NcclReduction(NamedTuple):
    """How one all-reduce or reduce-scatter of a dtype runs through NCCL."""

    cast: str | None  # dtype the values are cast to for the call and back from afterwards, if any
    nccl_type: int
    factor: int
    op: int
    divide: bool  # a mean without ncclAvg: sum, then divide by the device count


def _unsupported(api: str, dtype: str, table: dict) -> TypeError:
    return TypeError(f"{api} on the CUDA backend reduces {', '.join(sorted(table))}. Received: dtype {dtype}.")


def kernel_wire(dtype: str, api: str) -> Wire:
    """The reduce kernel's type and element factor for arrays of `dtype` (a NumPy dtype name)."""
    try:
        return KERNEL_WIRES[dtype]
    except KeyError:
        raise _unsupported(api, dtype, KERNEL_WIRES) from None


@functools.lru_cache(maxsize=512)  # asked per buffer per step; refusals raise and are not cached
def nccl_reduction(dtype: str, mean: bool, nccl_version: int, api: str) -> NcclReduction:
    """How NCCL reduces `dtype`: a mean uses ncclAvg when the loaded NCCL has it, else a sum and a division.

    Example:
      >>> nccl_reduction("complex64", True, 22501, "all_reduce")
      NcclReduction(cast=None, nccl_type=7, factor=2, op=4, divide=False)
    """
    cast = WIDER.get(dtype)
    wire = NCCL_WIRES.get(cast or dtype)
    if wire is None:
        raise _unsupported(api, dtype, {**NCCL_WIRES, **WIDER})
    if wire.dtype == "bfloat16" and nccl_version < AVG_MIN_VERSION:
        raise TypeError(f"{api} of bfloat16 needs NCCL 2.10.3 or later. Received: NCCL version code {nccl_version}; "
                        f"pip install 'nvidia-nccl-cu12>=2.18.1' (in distrib[cuda12]), or on CUDA 13 "
                        f"'nvidia-nccl-cu13>=2.27' (in distrib[cuda13]).")
    if mean and wire.dtype not in FLOATS:
        raise ValueError(f"{api} takes a mean of float and complex values only (integer means are divided after "
                         f"the sum). Received: mean of dtype {dtype}.")
    average = mean and nccl_version >= AVG_MIN_VERSION
    op = "AVG" if average else wire.op
    return NcclReduction(cast, NCCL_TYPES[wire.dtype], wire.factor, NCCL_OPS[op], mean and not average)


def chunk_calls(chunks: Sequence[tuple[int, int]], itemsize: int, factor: int) -> list[tuple[int, int]]:
    """One NCCL call per chunk of a plan's buffer: the byte offset where it starts and its count of wire elements.

    Example:
      >>> chunk_calls([(0, 3), (3, 6), (6, 10)], itemsize=8, factor=2)  # complex64 values, sent as float32 pairs
      [(0, 6), (24, 6), (48, 8)]
    """
    return [(start * itemsize, (stop - start) * factor) for start, stop in chunks]


# Data movement (all-gather, broadcast) ignores the dtype: any array travels as its bytes.
BYTES = NCCL_TYPES["uint8"]
