"""Commands whose reader goes away (`distrib train | head`) finish their work: later output is dropped, not fatal."""

from __future__ import annotations

import os
import sys
from typing import Any


class _DropsOnceClosed:
    """`stream`, whose writes after the reader closed the pipe go to the null device instead of raising."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_null()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_null()

    def _to_null(self) -> None:
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
