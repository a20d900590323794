"""nccl-tests' conventions: the size sweep, each collective's buffer layout and bus-bandwidth factor, the table."""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence


def parse_size(text: str) -> int:
    """A byte count as nccl-tests reads one: a number with an optional K, M or G (powers of 1024), which may be
    followed by B or iB (nccl-tests reads the first letter only).

    Example:
      >>> parse_size("8"), parse_size("64K"), parse_size("1.5m"), parse_size("1G"), parse_size("1KB")
      (8, 65536, 1572864, 1073741824, 1024)
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([KkMmGg])(?:[iI]?[bB])?)?\s*", str(text))
    if not match:
        raise ValueError(f"A size is a number of bytes with an optional K, M or G suffix (powers of 1024; KB and KiB "
                         f"read the same), such as 8, 64K or 1.5M. Received: {text!r}.")
    return int(float(match[1]) * 1024 ** " KMG".index((match[2] or " ").upper()))


def sizes(minbytes: int, maxbytes: int, stepfactor: int = 1, stepbytes: int = 1 << 20) -> list[int]:
    """The sizes nccl-tests sweeps: from minbytes to maxbytes, times stepfactor if it is > 1, else plus stepbytes.

    Example:
      >>> sizes(8, 64, stepfactor=2)
      [8, 16, 32, 64]
      >>> sizes(1 << 20, 3 << 20)
      [1048576, 2097152, 3145728]
    """
    if minbytes < 0 or maxbytes < minbytes:
        raise ValueError(f"Sizes need 0 <= minbytes <= maxbytes. Received: minbytes {minbytes}, maxbytes {maxbytes}.")
    if stepfactor <= 1 and stepbytes <= 0:
        raise ValueError(f"A sweep needs stepfactor > 1 or stepbytes > 0. Received: stepfactor {stepfactor}, "
                         f"stepbytes {stepbytes}.")
    out, size = [], minbytes
    while size <= maxbytes:
        out.append(size)
        if stepfactor > 1:
            if size == 0:
                break  # 0 times anything stays 0: nccl-tests would loop forever
            size *= stepfactor
        else:
            size += stepbytes
    return out


@dataclass(frozen=True)
class Layout:
    """One row's buffers: elements sent and received per rank, and what the table's size and count columns show.

    `algbw_bytes` is the byte count algbw divides by the time (nccl-tests' `baseBw` numerator).
    """

    send_count: int
    recv_count: int
    size: int
    count: int
    algbw_bytes: int


@dataclass(frozen=True)
class Collective:
    """A collective as nccl-tests measures it: its layout per requested size, and its bus-bandwidth factor.

    Args:
      name: "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce" or "batch_reduce".
      bus_factor: busbw / algbw on n ranks: how many times each byte crosses the slowest link, relative to
        what a perfect algorithm needs (nccl-tests' PERFORMANCE.md).
      reduces: whether it has a reduction op (the redop column).
      rooted: whether it has a root (the root column).
      layout: (requested bytes, itemsize, ranks) -> Layout.
    """

    name: str
    bus_factor: Callable[[int], float]
    reduces: bool
    rooted: bool
    layout: Callable[[int, int, int], Layout]

    def __repr__(self) -> str:
        return f"<Collective {self.name}>"


def _whole(size: int, itemsize: int, n: int) -> Layout:
    count = size // itemsize
    return Layout(count, count, count * itemsize, count, count * itemsize)


def _per_rank(size: int, itemsize: int, n: int) -> int:
    """nccl-tests' count per rank of all_gather and reduce_scatter: (count/nranks) & ~(16/eltSize - 1), whole
    16-byte slices."""
    aligned = max(1, 16 // itemsize)
    return size // itemsize // n // aligned * aligned


def _gather(size: int, itemsize: int, n: int) -> Layout:
    base = _per_rank(size, itemsize, n)
    return Layout(base, base * n, base * n * itemsize, base, base * n * itemsize)


def _scatter(size: int, itemsize: int, n: int) -> Layout:
    base = _per_rank(size, itemsize, n)
    return Layout(base * n, base, base * n * itemsize, base, base * n * itemsize)


def _ring_all_reduce(n: int) -> float:
    return 2 * (n - 1) / n


COLLECTIVES = {c.name: c for c in (
    Collective("all_reduce", _ring_all_reduce, True, False, _whole),
    Collective("all_gather", lambda n: (n - 1) / n, False, False, _gather),
    Collective("reduce_scatter", lambda n: (n - 1) / n, True, False, _scatter),
    Collective("broadcast", lambda n: 1.0, False, True, _whole),
    Collective("reduce", lambda n: 1.0, True, True, _whole),
    Collective("batch_reduce", _ring_all_reduce, True, False, _whole),
)}


def bandwidths(collective: Collective, layout: Layout, seconds: float, ranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10^9 bytes per second), as nccl-tests computes them.

    Example:
      >>> ar = COLLECTIVES["all_reduce"]
      >>> bandwidths(ar, ar.layout(1 << 30, 4, 8), 0.1, 8)   # 1 GiB in 100 ms on 8 ranks
      (10.73741824, 18.79048192)
    """
    if seconds <= 0:
        return math.inf, math.inf
    algbw = layout.algbw_bytes / 1e9 / seconds
    return algbw, algbw * collective.bus_factor(ranks)


# -- the table, in nccl-tests' text layout -----------------------------------------------------------------

LEAD = "# {:>10s}  {:>12s}  {:>8s}  {:>6s}  {:>6s}"
GROUP_WIDTH = 34  # "  %7s  %6s  %6s %6s"


def header(groups: Sequence[str], extra: Sequence[str] = ()) -> str:
    """nccl-tests' three header lines; `groups` name the column groups (nccl-tests: out-of-place, in-place)."""
    titles = "#" + " " * (len(LEAD.format("", "", "", "", "")) - 1) + "".join(f"{g:^{GROUP_WIDTH}s}" for g in groups)
    names = LEAD.format("size", "count", "type", "redop", "root") + "".join(
        f"  {'time':>7s}  {'algbw':>6s}  {'busbw':>6s} {'#wrong':>6s}" for _ in groups)
    units = LEAD.format("(B)", "(elements)", "", "", "") + "".join(
        f"  {'(us)':>7s}  {'(GB/s)':>6s}  {'(GB/s)':>6s}  {'':>5s}" for _ in groups)
    names += "".join(f"  {e:>10s}" for e in extra)
    return "\n".join((titles.rstrip(), names, units.rstrip()))


def format_time(us: float) -> str:
    """nccl-tests' time column: 2 decimals below 100 us, 1 below 10 ms, none above.

    Example:
      >>> format_time(12.345), format_time(123.45), format_time(12345.6)
      ('  12.35', '  123.5', '  12346')
    """
    if us >= 10000:
        return f"{us:7.0f}"
    return f"{us:7.1f}" if us >= 100 else f"{us:7.2f}"


@dataclass(frozen=True)
class Cell:
    """One column group of a row: time per call in microseconds and the wrong elements (None: not checked)."""

    us: float
    wrong: int | None


def row(collective: Collective, layout: Layout, type_name: str, op_name: str, root: int, ranks: int,
        cells: Sequence[Cell | None], extra: Sequence[str] = ()) -> str:
    """One line of the table: size, count, type, redop, root, then time, algbw, busbw and #wrong per group.

    A group without a measurement (None) prints N/A, as nccl-tests does for a value it did not measure.

    Example:
      >>> ar = COLLECTIVES["all_reduce"]
      >>> row(ar, ar.layout(1 << 20, 4, 4), "float", "sum", -1, 4, [Cell(100.0, 0), None])
      '     1048576        262144     float     sum      -1    100.0   10.49   15.73      0      N/A     N/A     N/A    N/A'
    """
    text = (f"{layout.size:12d}  {layout.count:12d}  {type_name:>8s}  {op_name if collective.reduces else 'none':>6s}"
            f"  {root if collective.rooted else -1:6d}")
    for cell in cells:
        if cell is None:
            text += f"  {'N/A':>7s}  {'N/A':>6s}  {'N/A':>6s}  {'N/A':>5s}"
            continue
        algbw, busbw = bandwidths(collective, layout, cell.us / 1e6, ranks)
        wrong = "N/A" if cell.wrong is None else f"{cell.wrong:g}"
        text += f"  {format_time(cell.us)}  {algbw:6.2f}  {busbw:6.2f}  {wrong:>5s}"
    return text + "".join(f"  {e:>10s}" for e in extra)


def footer(failures: int, busbw: Sequence[float]) -> str:
    """nccl-tests' closing lines, to the space: the measurements whose check failed, and the average bus bandwidth
    over every measurement (nccl-tests' `# %-20s : %d %s` and `# %-20s : %g %s`)."""
    average = statistics.fmean(busbw) if busbw else 0.0
    return (f"# {'Out of bounds values':<20s} : {failures} {'FAILED' if failures else 'OK'}\n"
            f"# {'Avg bus bandwidth':<20s} : {average:g} ")


def concluded(program: str) -> str:
    """nccl-tests' last line, after a line holding "#"."""
    return f"# Collective test concluded: {program}"
