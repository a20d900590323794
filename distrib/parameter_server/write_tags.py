"""Tags on a scheduled closure's writes, so a closure run again after its worker died applies each write once."""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any, Hashable, Iterator, Optional, Tuple

_local = threading.local()


@contextlib.contextmanager
def closure_writes(closure_id: int) -> Iterator[None]:
    """Tags every write made in the block with (closure_id, variable key, how many writes to it came before)."""
    previous = getattr(_local, "closure_id", None), getattr(_local, "counts", None)
    _local.closure_id, _local.counts = closure_id, collections.Counter()
    try:
        yield
    finally:
        _local.closure_id, _local.counts = previous


def next_tag(key: Hashable) -> Optional[Tuple[int, Any]]:
    """The tag of the next write to variable `key`: None outside a scheduled closure (such writes always apply).

    A closure run again makes the same writes to the same variables, so they get the same tags whatever
    values the new run computes; counting per variable keeps a branch taken in one run and not in the other
    from shifting the tags of the writes after it.
    """
    counts = getattr(_local, "counts", None)
    if counts is None:
        return None
    counts[key] += 1
    return _local.closure_id, (key, counts[key])
