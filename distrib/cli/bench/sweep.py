"""The types and reduction ops one `distrib bench` run measures: `-d`/`-o` one of each, or nccl-tests' `all`.

With `-d all` every type runs in turn, and with `-o all` every op, types outermost, in nccl-tests' order and under
its names, one table; combinations distrib cannot run are listed above the table instead of failing the run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distrib.install_hint import pip_install

# nccl-tests' type names (and NumPy's), as -d takes them; -d all runs nccl-tests' list, in its order
TYPES = {"int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32", "int64": "int64",
         "uint64": "uint64", "half": "float16", "float": "float32", "double": "float64", "bfloat16": "bfloat16",
         "float16": "float16", "float32": "float32", "float64": "float64"}
ALL_TYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double", "bfloat16")
NCCL_TYPE_NAMES = {"float16": "half", "float32": "float", "float64": "double"}
NCCL_OPS = ("sum", "prod", "max", "min", "avg", "mulsum")  # -o all, in nccl-tests' order
OPS = ("sum", "avg")  # the ones distrib has: ReduceOp SUM and MEAN


class SweepError(ValueError):
    """A -d/-o request distrib cannot measure; the message says why."""


@dataclass(frozen=True)
class Combination:
    """One pass of the size sweep: the element type (NumPy, and nccl-tests' name) and the op's nccl-tests name."""

    dtype: np.dtype
    type_name: str
    op: str

    def __repr__(self) -> str:
        return f"<Combination {self.type_name} {self.op}>"


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a `-d` name; bfloat16 comes from ml_dtypes.

    Raises:
      SweepError: bfloat16 without ml_dtypes.
    """
    if TYPES[name] == "bfloat16":
        try:
            import ml_dtypes
        except ModuleNotFoundError:
            raise SweepError(f"-d bfloat16 needs ml_dtypes: {pip_install('bench')}.") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(TYPES[name])


def _unsupported(dtype: str, op: str, collective: str) -> str | None:
    """Why distrib cannot run `op` on `dtype` in `collective` (None if it can)."""
    if op == "avg" and collective == "reduce_scatter":
        return ("reduce_scatter sums only (-o sum): distrib's reduce-scatter is the first half of a ring "
                "all-reduce, which divides after the gather")
    if op == "avg" and not (dtype.startswith("float") or dtype == "bfloat16"):
        return "-o avg needs a floating type (distrib's integer MEAN returns floats, as TensorFlow's)"
    return None


def combinations(datatype: str, op: str, collective: str, reduces: bool) -> tuple[list[Combination], list[str]]:
    """The passes to run, and the header notes on what `all` left out.

    Args:
      datatype: the -d value: a name of TYPES, or "all".
      op: the -o value: sum, avg, or "all".
      collective: the collective's name.
      reduces: whether it takes an op (others run each type once, redop none).

    Raises:
      SweepError: a single -d/-o that distrib cannot run, saying why.

    Example:
      >>> [(c.type_name, c.op) for c in combinations("all", "all", "all_reduce", True)[0]][:3]
      [('int8', 'sum'), ('uint8', 'sum'), ('int32', 'sum')]
    """
    if not reduces and op != "sum":  # nccl-tests ignores -o where nothing is reduced (redop none)
        passes, notes = combinations(datatype, "sum", collective, reduces)
        return passes, [f"# -o {op} ignored: {collective} has no reduction op (as in nccl-tests)", *notes]
    if op in NCCL_OPS and op not in OPS:
        raise SweepError(f"-o {op} is an nccl-tests op that distrib does not have: distrib reduces with SUM and "
                         f"MEAN only, as tf.distribute's ReduceOp. Use -o sum, -o avg or -o all.")
    if op not in OPS + ("all",):
        raise SweepError(f"-o takes sum, avg or all. Received: {op!r}.")
    types = ALL_TYPES if datatype == "all" else (datatype,)
    ops = (OPS if op == "all" else (op,)) if reduces else ("sum",)
    out, notes, skipped = [], [], {}
    if op == "all" and reduces:
        notes.append(f"# -o all: {' '.join(OPS)} (distrib's SUM and MEAN; nccl-tests' "
                     f"{' '.join(o for o in NCCL_OPS if o not in OPS)} have no distrib op)")
    for name in types:
        try:
            dtype = numpy_dtype(name)
        except SweepError as exc:
            if datatype != "all":
                raise
            notes.append(f"# -d {name} skipped: {exc}")
            continue
        for this_op in ops:
            reason = _unsupported(TYPES[name], this_op, collective)
            if reason and datatype != "all" and op != "all":
                raise SweepError(f"{reason}. Received: -d {name} -o {this_op}.")
            if reason:
                skipped.setdefault(reason, []).append(f"{name}/{this_op}")
                continue
            out.append(Combination(dtype, NCCL_TYPE_NAMES.get(dtype.name, dtype.name), this_op))
    notes += [f"# skipped {' '.join(which)}: {reason}" for reason, which in skipped.items()]
    if not out:
        raise SweepError(f"nothing to measure: {'; '.join(skipped) or 'no type is available'}. Received: "
                         f"-d {datatype} -o {op}.")
    return out, notes
