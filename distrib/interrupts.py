"""Deferring Ctrl-C over the few steps that must happen all together or not at all (updating every copy)."""

from __future__ import annotations

import signal
import threading
from typing import Any

_MAIN_THREAD = threading.main_thread().ident


class _Deferral:
    """The context manager `deferred_interrupts` returns: a depth count and the signal held back."""

    def __init__(self):
        self.depth = 0  # main thread only: no other thread ever receives KeyboardInterrupt
        self.held: tuple[int, Any] | None = None
        self.forward: Any = None  # the handler ours stands in front of

    def handle(self, signum: int, frame: Any) -> None:
        if self.depth:
            self.held = self.held or (signum, frame)
        else:
            self.forward(signum, frame)

    def __enter__(self) -> None:
        if threading.get_ident() != _MAIN_THREAD:
            return
        if self.forward is None:  # once: a program that replaces the handler later simply gets no deferral
            current = signal.getsignal(signal.SIGINT)
            if not callable(current):  # SIG_IGN or SIG_DFL: Python raises nothing, so nothing to defer
                return
            self.forward = current
            signal.signal(signal.SIGINT, self.handle)
        self.depth += 1

    def __exit__(self, *exc_info) -> None:
        if self.depth == 0 or threading.get_ident() != _MAIN_THREAD:
            return
        self.depth -= 1
        if self.depth == 0 and self.held is not None:
            held, self.held = self.held, None
            self.forward(*held)

    def __repr__(self) -> str:
        return f"<deferred_interrupts depth={self.depth}>"


_DEFERRAL = _Deferral()


def deferred_interrupts() -> _Deferral:
    """A context manager that holds back SIGINT until the block ends, then delivers it as the program's handler would.

    Python raises KeyboardInterrupt between any two bytecodes of the main thread; inside this block it is
    raised when the block ends instead, so the block's steps (every copy of a mirrored variable written, or
    every replica thread handed its next phase) happen all together. Blocks nest and cost well under a
    microsecond; other threads never receive KeyboardInterrupt, so there the block does nothing. The first
    block puts a handler in front of the program's SIGINT handler, which it calls whenever no block is open.

    Example:
      >>> from distrib.interrupts import deferred_interrupts
      >>> copies = [0, 0]
      >>> with deferred_interrupts():
      ...     for i in range(len(copies)):
      ...         copies[i] += 1
      >>> copies
      [1, 1]
    """
    return _DEFERRAL
