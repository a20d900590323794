"""Whether the largest size of a sweep fits in memory, checked before the first measurement (nccl-tests lowers
maxBytes to what fits; distrib bench says so and stops)."""

from __future__ import annotations

import resource
from typing import Sequence

GiB = 1 << 30


def needed_bytes(send_bytes: int, recv_bytes: int, local_ranks: int) -> int:
    """A floor on what one row holds per process: every local rank's send and receive buffers, twice over (the
    host's copies and the series' own: inputs, results, the host's answer for the check)."""
    return 2 * local_ranks * (send_bytes + recv_bytes)


def available_bytes(kind: str, ordinals: Sequence[int] = ()) -> int | None:
    """Memory this process can still take: on the emulator the host's (within `ulimit -v`), on GPUs the least
    free on any of `ordinals`; None where it cannot tell."""
    if kind == "cuda":
        try:
            import cupy

            return min(cupy.cuda.Device(o).mem_info[0] for o in ordinals) if ordinals else None
        except Exception:  # no answer from the driver: measure, and let an allocation failure say it
            return None
    free = _meminfo("MemAvailable")
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        used = _status("VmSize")
        room = limit - used if used is not None else limit
        free = room if free is None else min(free, room)
    return free


def describe(nbytes: int) -> str:
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB else f"{nbytes / (1 << 20):.0f} MiB"


def _meminfo(key: str) -> int | None:
    return _kib_field("/proc/meminfo", key)


def _status(key: str) -> int | None:
    return _kib_field("/proc/self/status", key)


def _kib_field(path: str, key: str) -> int | None:
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
