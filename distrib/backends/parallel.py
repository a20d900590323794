"""Host work of a collective split into shares, run by threads a strategy lends while they wait at its rendezvous.

A MirroredStrategy's replica threads sleep while the merge thread executes a collective. On the CPU emulator
that collective is NumPy work on host memory, and NumPy releases the GIL inside its loops, so the strategy
lends its waiting replica threads (`lend`) and the backend cuts the work into contiguous element ranges
(`run_shares`), one per thread, as a reduce-scatter would. Each range is computed exactly as the whole buffer
would be, so results do not depend on how many threads share the work.
"""

from __future__ import annotations

import abc
import os
import threading
from typing import Callable, Sequence

# Below this many bytes per share, waking one more thread costs more than the share of the work it takes.
MIN_SHARE_BYTES = 1 << 18
_ALIGN_BYTES = 64  # shares start on cache lines, so two threads never write into the same line

_lent = threading.local()


class Team(abc.ABC):
    """Threads that run the tasks of one call together: the calling thread and `size - 1` lent helpers."""

    size: int = 1

    @abc.abstractmethod
    def run(self, tasks: Sequence[Callable[[], None]]) -> None:
        """Runs every task (at most `size`) at once, the first on the calling thread; returns when all have.

        The first exception a task raises is raised here, after every task has finished.
        """


class lend:
    """Makes `team` the calling thread's helpers for the block (None: none), restoring the previous after.

    Args:
      team: the helpers, or None.
    """

    __slots__ = ("_team", "_previous")

    def __init__(self, team: Team | None):
        self._team = team

    def __enter__(self) -> None:
        self._previous = getattr(_lent, "team", None)
        _lent.team = self._team

    def __exit__(self, *exc_info) -> None:
        _lent.team = self._previous

    def __repr__(self) -> str:
        return f"<lend {self._team!r}>"


def lent_team() -> Team | None:
    """The team lent to the calling thread, if any."""
    return getattr(_lent, "team", None)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def shares(length: int, itemsize: int, parts: int) -> list[tuple[int, int]]:
    """`length` elements cut into at most `parts` contiguous [start, stop) ranges of nearly equal size.

    Fewer ranges when the ranges would fall below MIN_SHARE_BYTES; inner bounds are cache-line aligned.

    Example:
      >>> shares(1_000_000, 4, 2)
      [(0, 500000), (500000, 1000000)]
      >>> shares(1_000, 4, 2)
      [(0, 1000)]
    """
    parts = max(1, min(parts, length * itemsize // MIN_SHARE_BYTES))
    align = max(1, _ALIGN_BYTES // itemsize)
    bounds = [0] + [-(-length * k // parts // align) * align for k in range(1, parts)] + [length]
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def run_split(jobs: Sequence[Callable[[], None]], nbytes: int) -> None:
    """Runs independent `jobs` that move `nbytes` in all, spread over the lent team's threads if any."""
    team = lent_team()
    if team is None or len(jobs) < 2 or nbytes < 2 * MIN_SHARE_BYTES:  # nothing worth a second thread
        _run_all(jobs)
        return
    parts = max(1, min(team.size, usable_cores(), len(jobs), nbytes // MIN_SHARE_BYTES))
    if parts == 1:
        _run_all(jobs)
    else:
        team.run([lambda group=jobs[k::parts]: _run_all(group) for k in range(parts)])


def _run_all(jobs: Sequence[Callable[[], None]]) -> None:
    for job in jobs:
        job()


def run_shares(length: int, itemsize: int, body: Callable[[int, int], None]) -> None:
    """Calls `body(start, stop)` over ranges covering `length` elements, on the lent team's threads if any."""
    team = lent_team()
    if team is None or length * itemsize < 2 * MIN_SHARE_BYTES:  # one share: skip the affinity lookup and cuts
        body(0, length)
        return
    ranges = shares(length, itemsize, min(team.size, usable_cores()))
    if len(ranges) <= 1:
        body(0, length)
        return
    team.run([lambda lo=lo, hi=hi: body(lo, hi) for lo, hi in ranges])
