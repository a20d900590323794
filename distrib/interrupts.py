"""Deferring Ctrl-C over the few steps that must happen all together or not at all (updating every copy)."""

from __future__ import annotations

import _signal  # signal.signal and getsignal without the wrapper that maps handlers to enums (2 µs a call)
import signal
import threading
from typing import Any

_MAIN_THREAD = threading.main_thread().ident
_SIGINT = int(signal.SIGINT)


class _Deferral:
    """The context manager `deferred_interrupts` returns: a depth count and the signal held back.

    Its handler stands in front of the program's only while a block is open, so `signal.getsignal` outside
    blocks returns what the program installed.
    """

    def __init__(self):
        self.depth = 0  # main thread only: no other thread ever receives KeyboardInterrupt
        self.held: tuple[int, Any] | None = None
        self.previous: Any = None  # the program's handler, restored when the outermost block ends
        self._hold = self.hold  # one bound method, so that `is` recognises it as installed

    def hold(self, signum: int, frame: Any) -> None:
        self.held = self.held or (signum, frame)

    def __enter__(self) -> None:
        if threading.get_ident() != _MAIN_THREAD:
            return
        if self.depth:
            self.depth += 1
            return
        if not callable(_signal.getsignal(_SIGINT)):  # SIG_IGN, SIG_DFL: Python raises nothing, nothing to defer
            return
        self.held = None
        # a SIGINT pending before the swap runs the program's handler inside signal() (no block yet); one after
        # it runs ours, which holds it whatever the depth
        self.previous = _signal.signal(_SIGINT, self._hold)
        self.depth = 1

    def __exit__(self, *exc_info) -> None:
        if self.depth == 0 or threading.get_ident() != _MAIN_THREAD:
            return
        self.depth -= 1
        if self.depth:
            return
        current = _signal.getsignal(_SIGINT)
        if current is self._hold:  # else the block installed a handler of its own: it stays
            _signal.signal(_SIGINT, self.previous)  # a SIGINT pending now is held first, then delivered below
            current = self.previous
        self.previous = None
        held, self.held = self.held, None
        if held is not None and callable(current):
            current(*held)

    def __repr__(self) -> str:
        return f"<deferred_interrupts depth={self.depth}>"


_DEFERRAL = _Deferral()


def deferred_interrupts() -> _Deferral:
    """A context manager that holds back SIGINT until the block ends, then delivers it as the program's handler would.

    Python raises KeyboardInterrupt between any two bytecodes of the main thread; inside this block it is
    raised when the block ends instead, so the block's steps (every copy of a mirrored variable written, or
    every replica thread handed its next phase) happen all together. Blocks nest; the outermost costs about
    1.4 µs (two sigaction calls), a nested one well under a microsecond; other threads never receive
    KeyboardInterrupt, so there the block does nothing. The outermost block puts a handler in front of the
    program's SIGINT handler and restores the program's as it ends, so outside blocks
    `signal.getsignal(signal.SIGINT)` returns the program's own.

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
