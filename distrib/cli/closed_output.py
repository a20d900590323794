"""Commands whose reader goes away (`distrib train | head`) finish their work: later output is dropped, not fatal;
output that cannot be written (`> /dev/full`) is said once on stderr and makes the exit status 1."""

from __future__ import annotations

import os
import sys
from typing import Any


class _DropsOnceClosed:
    """`stream`, whose writes after the reader closed the pipe, or after a write failed, go to the null device
    instead of raising."""

    def __init__(self, stream: Any):
        self._stream = stream
        self.failure: OSError | None = None  # the write error other than a closed pipe, if one came

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._drop(exc)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            self._drop(exc)

    def _drop(self, exc: OSError) -> None:
        if not isinstance(exc, BrokenPipeError) and self.failure is None:  # a reader that left is no failure
            self.failure = exc
            sys.stderr.write(f"distrib: cannot write its output ({exc}); the rest of it is dropped.\n")
        # the descriptor itself, so that what is still buffered, and Python's flush at exit, go nowhere quietly
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._stream.fileno())
        finally:
            os.close(null)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def finish_when_output_closes() -> None:
    """From here on, a closed stdout pipe no longer stops the command: a training run still trains and writes its
    checkpoint, history and plot (before, the first print after `head` exited raised BrokenPipeError, and a run
    started with --overwrite had already deleted the one it replaced)."""
    stream = sys.stdout
    if stream is not None and not isinstance(stream, _DropsOnceClosed) and hasattr(stream, "fileno"):
        sys.stdout = _DropsOnceClosed(stream)


def output_failed() -> bool:
    """Whether some of stdout's output could not be written (flushing what is buffered first): the command then
    ends with status 1, as `echo hi > /dev/full` does, instead of 0 with its output lost."""
    stream = sys.stdout
    if not isinstance(stream, _DropsOnceClosed):
        return False
    stream.flush()
    return stream.failure is not None
