"""Which threads wait forever on which other threads, read from their Python stacks: a join or a future's result.

A run of a strategy holds the strategy's run lock until its replica functions return. A replica function that
starts a helper thread and waits for it (`Thread.join`, `Future.result`) while the helper calls `run` on the
same strategy would wait forever, and so would the helper. `wait_chain` finds such a wait, so that `run`
raises at once instead of at the timeout. Only waits without a timeout count: a wait that ends on its own is
no deadlock.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread
import gc
import sys
import threading
from types import FrameType
from typing import Iterable, Iterator

_JOIN = threading.Thread.join.__code__
_RESULT = {concurrent.futures.Future.result.__code__, concurrent.futures.Future.exception.__code__}
_WAIT_ALL = concurrent.futures.wait.__code__
_WAITS = {_JOIN, _WAIT_ALL, *_RESULT}
_WORK_ITEM = concurrent.futures.thread._WorkItem.run.__code__  # a pool thread running a submitted function
_WAIT_DEPTH = 4  # a blocking call sits within the innermost frames (join -> _wait_for_tstate_lock -> acquire)


def wait_chain(waiters: Iterable[int], target: int, notes: dict[int, str] | None = None) -> list[str] | None:
    """How one of the threads `waiters` (idents) waits, through joins and futures, for thread `target`; None
    if none does in a way that could never end. `notes` adds a word after a thread's name ("(replica 1)").

    Returns one line per step of the chain, such as "'distrib-replica-0' waits in Thread.join for 'helper'".

    Example:
      >>> import threading
      >>> wait_chain([threading.get_ident()], threading.get_ident() + 1) is None
      True
    """
    frames = _current_frames()
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    for ident, note in (notes or {}).items():
        names[ident] = f"{names.get(ident, ident)} {note}"
    edges = _edges(frames)
    steps: dict[int, tuple[int, str]] = {}  # thread -> (the thread that waits for it, how)
    todo = [ident for ident in waiters if ident in frames]
    seen = set(todo)
    while todo:
        ident = todo.pop()
        for other, how in edges.get(ident, ()):
            if other in seen:
                continue
            seen.add(other)
            steps[other] = (ident, how)
            if other == target:
                return _describe(steps, target, names)
            todo.append(other)
    return None


def _current_frames() -> dict[int, FrameType]:
    """sys._current_frames() with the cyclic collector held off: where CPython lacks the fix of gh-106883 (3.11,
    early 3.12), a collection started by a frame object it allocates runs with the interpreter's thread-list
    lock held, and a threading.local freed by that collection takes the same lock: the process hangs for good."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()


def _describe(steps: dict[int, tuple[int, str]], target: int, names: dict[int, str]) -> list[str]:
    lines = []
    while target in steps:
        waiter, how = steps[target]
        lines.append(f"{names.get(waiter, waiter)!r} waits in {how} for {names.get(target, target)!r}")
        target = waiter
    return lines[::-1]


def _edges(frames: dict[int, FrameType]) -> dict[int, list[tuple[int, str]]]:
    """thread -> [(a thread it waits for without a timeout, the call it waits in)]."""
    running = {}  # future -> the pool thread running its function
    for ident, frame in frames.items():
        for outer in _stack(frame):
            if outer.f_code is _WORK_ITEM:
                running[outer.f_locals["self"].future] = ident
    edges: dict[int, list[tuple[int, str]]] = {}
    for ident, frame in frames.items():
        for inner, _ in zip(_stack(frame), range(_WAIT_DEPTH)):
            code = inner.f_code
            if code not in _WAITS:
                continue
            local = inner.f_locals
            if code is _JOIN:
                if local.get("timeout") is None and local["self"].ident is not None:
                    edges[ident] = [(local["self"].ident, "Thread.join")]
            elif code in _RESULT:
                future = local["self"]
                if local.get("timeout") is None and not future.done() and future in running:
                    edges[ident] = [(running[future], f"Future.{code.co_name}")]
            elif code is _WAIT_ALL:
                if local.get("timeout") is None and local.get("return_when") == concurrent.futures.ALL_COMPLETED:
                    edges[ident] = [(running[f], "concurrent.futures.wait") for f in local.get("fs", ())
                                    if not f.done() and f in running]
            break  # the innermost blocking call is the one the thread is in
    return edges


def _stack(frame: FrameType | None) -> Iterator[FrameType]:
    """The frames of one thread, innermost first."""
    while frame is not None:
        yield frame
        frame = frame.f_back
